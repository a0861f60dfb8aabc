"""One peer engine in its own process, for `dflash2 bench --engines` (see `peer_engines.py`, which starts it).

Runs in the peer's interpreter (`--peer-python`), so it imports nothing of this package: only the standard
library, MLX, mlx-lm and the engine. Requests arrive on stdin and replies leave on the original stdout, one
JSON object a line; everything the engine prints goes to stderr. Requests:

  {"op": "load", "target": FOLDER, "drafter": FOLDER or hub id, "dtype": None or a dtype to cast the target to}
      -> {"version": ...}
  {"op": "run", "prompt": [ids], "max_tokens": N, "temp": T, "block_size": B, "seed": S}
      -> {"tokens", "accepted" (drafts per cycle), "cycle_s" (each cycle's wall time), "generation_tps",
          "prompt_tps", "peak_memory_gb"}
  {"op": "timings", "prompt": [ids], "block_size": B, "repeats": N}  -> {"draft_s", "verify_s"}

A failure replies {"error": "..."}; the process stays up for the next request.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


class AuthorsEngine:
    """The authors' reference (`dflash` on PyPI, `dflash.model_mlx`): v1 and DFlash 2 drafters on any mlx-lm
    target. Its `load_draft` takes hub ids only: the parent hands it one that resolves, offline, to a
    constructed hub cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1). It wraps the target's layers for good."""

    def load(self, target: str, drafter: str, dtype: str | None) -> dict:
        from importlib.metadata import version

        from dflash import model_mlx

        self.m = model_mlx
        self.model, self.tokenizer = model_mlx.load(target)
        _cast(self.model, dtype)
        self.draft = model_mlx.load_draft(drafter)
        return {"version": version("dflash")}

    def run(self, prompt, max_tokens, temp, block_size) -> dict:
        tokens, accepted, cycle_s, last = [], [], [], None
        tic = time.perf_counter()
        for last in self.m.stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            prompt,
            block_size=block_size,
            max_tokens=max_tokens,
            temperature=temp,
        ):
            tokens += last.tokens
            if last.accepted is not None:  # its `accepted` counts the tokens committed (bonus included; a last
                # cycle cut by max_tokens counts fewer, where ours counts its accepted drafts: tau differs there)
                accepted.append(last.accepted - 1)
                cycle_s.append(time.perf_counter() - tic)
            tic = time.perf_counter()
        return {
            "tokens": tokens,
            "accepted": accepted,
            "cycle_s": cycle_s,
            "generation_tps": last.generation_tps,
            "prompt_tps": last.prompt_tps,
            "peak_memory_gb": last.peak_memory,
        }

    def timings(self, prompt, block_size, repeats) -> dict:
        """The drafter pass and the target's verify pass of one steady-state cycle (one new context row),
        each timed alone through the engine's own functions, as `bench_runs.cycle_parts` times ours."""
        import mlx.core as mx

        m, model, draft = self.m, self.model, self.draft
        m._patch_model(model, draft.config.target_layer_ids)
        draft.bind(model)
        cache, draft_cache = m.make_prompt_cache(model), m.make_prompt_cache(draft)
        _, hidden, _ = m._prefill_target(model, mx.array(prompt), cache, None, 2048)
        block = mx.array([[prompt[-1]] + [int(draft.config.mask_token_id)] * (block_size - 1)])

        def propose(context):
            if isinstance(draft, m.DFlash2DraftModel):
                return draft.propose(block, context, draft_cache, 0.0, logits_start=1)[0]
            return mx.argmax(draft(block, context, draft_cache, logits_start=1), axis=-1)

        mx.eval(propose(hidden))  # the prompt joins the drafter's cache, as in the first cycle
        draft_s, verify_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            tokens = propose(hidden[:, -1:])
            mx.eval(tokens)
            t1 = time.perf_counter()
            logits = model(mx.concatenate([block[:, :1], tokens], axis=1), cache)
            mx.eval(logits, mx.concatenate(model._hidden_states, axis=-1))
            t2 = time.perf_counter()
            m._trim_recent_cache(draft_cache, 1)
            m._trim_recent_cache(cache, block_size)
            draft_s.append(t1 - t0)
            verify_s.append(t2 - t1)
        return {"draft_s": statistics.median(draft_s), "verify_s": statistics.median(verify_s)}


class OmlxEngine:
    """oMLX's engine (`dflash-mlx` on PyPI, `dflash_mlx.runtime`): local folders accepted; its target ops
    exist for Qwen GatedDeltaNet and Gemma 4 targets only. Target and drafter are loaded separately so that
    a pair it cannot run is refused with both reasons."""

    def load(self, target: str, drafter: str, dtype: str | None) -> dict:
        from importlib.metadata import version

        from dflash_mlx.engine.target_ops import bind_draft_to_target
        from dflash_mlx.runtime.loading import load_draft_bundle, load_target_bundle

        reasons = []
        try:
            self.target = load_target_bundle(target)
            _cast(self.target.model, dtype)
        except Exception as e:  # noqa: BLE001 - whatever it refuses with is the row's reason
            reasons.append(f"target: {type(e).__name__}: {e}")
        try:
            self.draft, _ = load_draft_bundle(drafter)
        except Exception as e:  # noqa: BLE001
            reasons.append(f"drafter: {type(e).__name__}: {e}")
        if reasons:
            raise RuntimeError("; ".join(reasons))
        bind_draft_to_target(self.draft, self.target.model, target_ops=self.target.target_ops)
        return {"version": version("dflash-mlx")}

    def _events(self, prompt, max_tokens, block_size, profile=False):
        from dataclasses import replace

        from dflash_mlx.diagnostics import DiagnosticsConfig, TraceConfig
        from dflash_mlx.draft_backend import EagerDraftBackend
        from dflash_mlx.runtime import get_stop_token_ids, stream_dflash_generate
        from dflash_mlx.runtime.context import build_offline_runtime_context

        context = build_offline_runtime_context(verify_mode="dflash")
        if profile:  # its own per-cycle phase timings (they synchronize each phase: never in timed runs)
            context = replace(context, diagnostics=DiagnosticsConfig(trace=TraceConfig(cycle_events=True)))
        bundle = self.target
        yield from stream_dflash_generate(
            target_model=bundle.model,
            target_ops=bundle.target_ops,
            tokenizer=bundle.tokenizer,
            draft_model=self.draft,
            draft_backend=EagerDraftBackend(),
            max_new_tokens=max_tokens,
            block_tokens=block_size,
            stop_token_ids=get_stop_token_ids(bundle.tokenizer),
            prompt_tokens_override=list(prompt),
            publish_generation_snapshot=False,
            runtime_context=context,
        )

    def run(self, prompt, max_tokens, temp, block_size) -> dict:
        from dflash_mlx.engine.events import SummaryEvent, TokenEvent

        if temp != 0:
            raise ValueError("dflash-mlx's stream_dflash_generate takes no sampling settings: it decodes greedily only")
        tokens, cycle_s, cycles, summary = [], [], 0, None
        tic = time.perf_counter()
        for event in self._events(prompt, max_tokens, block_size):
            if isinstance(event, TokenEvent):
                tokens.append(int(event.token_id))
                if event.cycles_completed > cycles:  # a cycle's first token: the cycle ran since the last token
                    cycles = event.cycles_completed
                    cycle_s.append(time.perf_counter() - tic)
                tic = time.perf_counter()
            elif isinstance(event, SummaryEvent):
                summary = event
        prefill_s = summary.phase_timings_us.get("prefill", 0.0) / 1e6
        generation_s = summary.elapsed_us / 1e6 - prefill_s
        return {
            "tokens": tokens,
            "accepted": list(summary.acceptance_history),
            "cycle_s": cycle_s,
            "generation_tps": summary.generation_tokens / generation_s if generation_s > 0 else 0.0,
            "prompt_tps": len(prompt) / prefill_s if prefill_s > 0 else 0.0,
            "peak_memory_gb": summary.peak_memory_gb or 0.0,
        }

    def timings(self, prompt, block_size, repeats) -> dict:
        """The drafter and verify phases of its cycles, as its own cycle profiler measures them."""
        from dflash_mlx.engine.events import CycleCompleteEvent

        cycles = [
            e
            for e in self._events(prompt, repeats * block_size, block_size, profile=True)
            if isinstance(e, CycleCompleteEvent)
        ]
        return {
            "draft_s": statistics.median(c.draft_us for c in cycles) / 1e6,
            "verify_s": statistics.median(c.verify_us for c in cycles) / 1e6,
        }


def _cast(model, dtype: str | None) -> None:
    if dtype is not None:
        import mlx.core as mx

        model.set_dtype(getattr(mx, dtype))


ENGINES = {"dflash": AuthorsEngine, "dflash-mlx": OmlxEngine}


def serve(engine_name: str) -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the engine's own prints must not reach the replies
    engine = ENGINES[engine_name]()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "run":
                import mlx.core as mx

                mx.random.seed(request.pop("seed"))
            reply = getattr(engine, op)(**request)
        except ModuleNotFoundError as e:  # the engine (or MLX) is not installed in this interpreter
            reply = {"error": f"{type(e).__name__}: {e}", "missing": e.name}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
