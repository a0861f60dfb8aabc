"""`dflash2 bench`: every decoding method side by side in ONE process, trial by trial, with a lossless check.

Methods: mlx-lm's own generation (the baseline users know), plain decoding through our loop, mlx-lm's
classic speculative decoding (with --baseline-draft-model), each DFlash drafter at each block size
(DFlash 2 with both walks), and peer engines with the same drafters (`peer_engines.py`, each in its own process).
Each prompt runs every method back to back, in alternating order (A B C, then C B A from one prompt and one
trial to the next: the ABBA design), so drift on a shared machine hits them alike: over a pair a linear drift
adds the same to every method's time, and a prompt's methods are compared on runs seconds apart, not minutes.
At T = 0 every method's tokens must hash to the baseline's: a mismatch is reported as an error.
The report (terminal tables, markdown, JSON) and its per-prompt statistics are `bench_report.py`. `--tree-sim DATA`
and `--replay` run the commands `dflash2 tree-sim DATA` (`tree_sim.py`) and `dflash2 replay` (`replay.py`), saying
so on stderr: aliases kept for the commands written with them.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import stream_generate as mlx_stream
from mlx_lm.sample_utils import make_sampler
from rich.progress import Progress

from dflash2_apps import replay, tree_sim
from dflash2_apps.bench_report import (
    Method,
    Run,
    adaptive_summary,
    per_prompt_rows,
    render,
    report_console,
    report_context,
    report_json,
)
from dflash2_apps.common import add_bench_model_args, bench_prompts, command_line, load_bench_models, write_markdown
from dflash2_apps.compare import load_comparison, render_comparison
from dflash2_apps.peer_engines import PeerEngines, PeerError, check_python, parse_engines
from dflash2_mlx import stream_cycles
from dflash2_mlx.adaptive import AdaptiveConfig, ShadowBlocks
from dflash2_mlx.costs import load_or_measure_costs
from dflash2_mlx.decode import dflash_steps
from dflash2_mlx.generate import resolve_block_size
from dflash2_mlx.kernels import use_metal
from dflash2_mlx.loading import bind_drafter, load_target
from dflash2_mlx.lookup import COPYSPEC_MODES
from dflash2_mlx.machine import runtime_info
from dflash2_mlx.prompts import prompts_sha256
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.tree import TREE_BUDGET_MAX, default_budget


def run_method(
    method: Method, model, tokenizer, prompt: list[int], max_tokens: int, temp: float, classic_draft=None
) -> Run:
    """One generation; tokens exclude EOS so every method is compared on the same footing."""
    eos = set(tokenizer.eos_token_ids)
    if method.kind == "peer":
        seed = int(mx.random.randint(0, 1 << 30, ()).item())  # follows the trial's seed, as ours do
        r = method.peer.request(
            op="run", prompt=prompt, max_tokens=max_tokens, temp=temp, block_size=method.block_size, seed=seed
        )
        return Run(
            [t for t in r["tokens"] if t not in eos],
            r["generation_tps"],
            r["prompt_tps"],
            len(prompt) / r["prompt_tps"],
            r["peak_memory_gb"],
            r["accepted"],
            cycle_s=r["cycle_s"],
        )
    if method.kind in ("mlx-lm", "mlx-lm-spec"):
        spec = method.kind == "mlx-lm-spec"
        kwargs = {"draft_model": classic_draft, "num_draft_tokens": method.block_size - 1} if spec else {}
        tokens, from_draft, last = [], [], None
        for last in mlx_stream(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp), **kwargs):
            tokens.append(last.token)
            from_draft.append(last.from_draft)
        return Run(
            [t for t in tokens if t not in eos],
            last.generation_tps,
            last.prompt_tps,
            len(prompt) / last.prompt_tps,
            last.peak_memory,
            accepted_per_cycle(from_draft) if spec else [],
        )
    tokens, accepted, plain_tokens, cycle_s, lookup_tokens, last = [], [], 0, [], 0, None
    mode = "off" if method.kind == "plain" else method.kind
    tree = {"tree_budget": method.tree_budget} if mode == "ddtree" else {}
    tic = time.perf_counter()
    for last in stream_cycles(
        model,
        tokenizer,
        prompt,
        method.drafter,
        max_tokens=max_tokens,
        temp=temp,
        block_size=method.block_size,
        verify_mode=mode,
        walk=method.walk,
        copyspec_mode=method.copyspec,
        **tree,
    ):
        tokens += last.tokens
        lookup_tokens += last.accepted if last.branch == "lookup" else 0
        if last.accepted is not None:
            accepted.append(last.accepted)
            cycle_s.append(time.perf_counter() - tic)
        plain_tokens += len(last.tokens) if last.block_size == 1 else 0
        tic = time.perf_counter()
    return Run(
        [t for t in tokens if t not in eos],
        last.generation_tps,
        last.prompt_tps,
        len(prompt) / last.prompt_tps,
        last.peak_memory,
        accepted,
        plain_tokens,
        cycle_s,
        lookup_tokens,
    )


def with_copyspec_modes(methods: list[Method], modes: list[str]) -> list[Method]:
    """Each of our speculative rows once per --copyspec-modes mode (named "... copy MODE" when there are several,
    next to each other so the ABBA order runs them back to back)."""
    bad = [m for m in modes if m not in COPYSPEC_MODES]
    if bad:
        raise ValueError(f"--copyspec-modes takes modes from {COPYSPEC_MODES}, comma-separated; got {bad}")
    out = []
    for m in methods:
        if m.drafter is None or m.kind == "peer":
            out.append(m)
            continue
        for mode in modes:
            suffix = f" copy {mode}" if len(modes) > 1 else ""
            out.append(replace(m, name=m.name + suffix, label=m.label + suffix, copyspec=mode))
    return out


def accepted_per_cycle(from_draft: list[bool]) -> list[int]:
    """Accepted draft counts of mlx-lm's speculative cycles, read off its `from_draft` flags.

    Each cycle yields its accepted draft tokens (True) and then the target's own token (False); a run of
    True flags cut off by max_tokens or EOS has no target token and is not a whole cycle, so it is dropped.
    """
    counts, run = [], 0
    for flag in from_draft:
        if flag:
            run += 1
        else:
            counts.append(run)
            run = 0
    return counts


def token_hash(runs: list[Run]) -> str:
    return hashlib.sha256(json.dumps([r.tokens for r in runs]).encode()).hexdigest()


def acceptance_by_position(accepted: list[int], block_size: int) -> list[float]:
    """Share of cycles whose draft at position j (1..B-1) was accepted: the suffix-decay profile."""
    if not accepted:
        return []
    return [sum(a >= j for a in accepted) / len(accepted) for j in range(1, block_size)]


def method_row(method: Method, trials: list[list[Run]], baseline_tps: float | None) -> dict:
    """trials[t][p]: the run of prompt p in trial t."""
    per_trial_tps = []
    for runs in trials:
        tokens = sum(len(r.tokens) for r in runs)
        seconds = sum(len(r.tokens) / r.generation_tps for r in runs if r.generation_tps > 0)
        per_trial_tps.append(tokens / seconds if seconds else 0.0)
    accepted = [a for runs in trials for r in runs for a in r.accepted]
    cycles = len(accepted)
    median = statistics.median(per_trial_tps)
    return {
        "method": method.name,
        "label": method.label,
        "kind": method.kind,
        "drafter": method.drafter_label,
        "block_size": method.block_size,
        "walk": method.walk if method.kind in ("dflash", "adaptive", "peer") else None,
        "generation_tps_median": median,
        "generation_tps_min": min(per_trial_tps),
        "generation_tps_max": max(per_trial_tps),
        "speedup": median / baseline_tps if baseline_tps else None,
        "tau": (sum(accepted) + cycles) / cycles if cycles else None,
        "cycles": cycles,
        # accepted drafts by where they came from: lookups' continuations (--copyspec-mode) and the drafter
        "lookup_tokens": sum(r.lookup_tokens for runs in trials for r in runs),
        "drafter_tokens": sum(accepted) - sum(r.lookup_tokens for runs in trials for r in runs),
        "copyspec": method.copyspec if method.drafter is not None else None,
        "plain_share": (
            sum(r.plain_tokens for runs in trials for r in runs)
            / max(1, sum(len(r.tokens) for runs in trials for r in runs))
        )
        if method.kind == "adaptive"
        else None,
        "acceptance_by_position": acceptance_by_position(accepted, method.block_size) if cycles else [],
        "prompt_tps_median": statistics.median(r.prompt_tps for runs in trials for r in runs),
        "ttft_s_median": statistics.median(r.ttft_s for runs in trials for r in runs),
        "peak_memory_gb": max(r.peak_memory_gb for runs in trials for r in runs),
        "token_sha256": token_hash(trials[0]),
        # the median cycle: a cycle stalled by another process on a shared machine does not move it
        "cycle_ms": 1000 * statistics.median(t for runs in trials for r in runs for t in r.cycle_s)
        if cycles and method.kind in ("dflash", "peer")
        else None,
        "note": method.note,
    }


def unavailable_row(method: Method) -> dict:
    """The row of a peer that cannot run: its reason, no numbers."""
    keys = (
        "generation_tps_median",
        "generation_tps_min",
        "generation_tps_max",
        "speedup",
        "tau",
        "plain_share",
        "prompt_tps_median",
        "ttft_s_median",
        "peak_memory_gb",
        "token_sha256",
        "cycle_ms",
        "lossless",
    )
    return {
        "method": method.name,
        "label": method.label,
        "kind": method.kind,
        "drafter": method.drafter_label,
        "block_size": method.block_size,
        "walk": method.walk,
        "cycles": 0,
        "acceptance_by_position": [],
        "note": method.note,
        **dict.fromkeys(keys),
    }


def cost_curves(model, methods: list[Method]) -> list[dict]:
    """The measured cost model behind each adaptive row (the physical limit of drafting on this machine) and
    behind each ddtree row left to the default budget (the verify curve to TREE_BUDGET_MAX + 1 tokens, and the
    budget it picks)."""
    curves, seen = [], set()
    for m in methods:
        tree = m.kind == "ddtree" and m.tree_budget is None
        if (m.kind != "adaptive" and not tree) or (m.drafter_label, m.block_size, tree) in seen:
            continue
        seen.add((m.drafter_label, m.block_size, tree))
        target = bind_drafter(m.drafter, model)
        costs = load_or_measure_costs(target, m.drafter, m.block_size, TREE_BUDGET_MAX + 1 if tree else None)
        step = costs.verify_s[0]
        curves.append(
            {
                "drafter": m.drafter_label,
                "step_s": step,
                "block_size": m.block_size,
                "verify_steps": [s / step for s in costs.verify_s],
                "draft_steps": [s / step for s in costs.draft_s],
                "tree_budget": default_budget(costs, m.block_size) if tree else None,
            }
        )
    return curves


def cycle_parts(method: Method, model, prompt: list[int], repeats: int = 10) -> tuple[float, float] | None:
    """(drafter pass, target verify pass) of one steady-state cycle in seconds (medians), each timed alone
    outside the loop (the loop itself never waits between its two passes): the prompt is in both caches,
    and the drafter takes one new context row, as a cycle that accepted nothing does. The rest of a
    cycle's time is the loop's own overhead. PeerEngines time theirs the same way (`peer_worker.py`)."""
    if method.kind == "peer":
        t = method.peer.request(op="timings", prompt=prompt, block_size=method.block_size, repeats=repeats)
        return t["draft_s"], t["verify_s"]
    if method.kind != "dflash":
        return None
    drafter, B = method.drafter, method.block_size
    target = bind_drafter(drafter, model)
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    with target.capture() as tap:
        logits, context = tap.prefill(mx.array(prompt), cache)
        block = mx.array([[int(prompt[-1])] + [drafter.config.mask_token_id] * (B - 1)])
        mx.eval(drafter.propose(block, context[None], draft_cache, SamplingParams(), method.walk).tokens)
        draft_s, verify_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proposal = drafter.propose(block, context[None, -1:], draft_cache, SamplingParams(), method.walk)
            mx.eval(proposal.tokens)
            t1 = time.perf_counter()
            verified = tap.verify(mx.concatenate([block[0, :1], proposal.tokens.astype(block.dtype)]), cache)
            mx.eval(verified.logits, verified.features)
            t2 = time.perf_counter()
            tap.rollback(cache, verified, 0)
            for c in draft_cache:
                c.trim(1)
            draft_s.append(t1 - t0)
            verify_s.append(t2 - t1)
    return statistics.median(draft_s), statistics.median(verify_s)


def add_cycle_parts(row: dict, parts: list[tuple[float, float]]) -> None:
    """draft_share (the drafter's part of draft + verify) and, with the row's measured cycle time, the
    per-cycle overhead: cycle time minus the drafter and verify passes (`parts`: those of each trial)."""
    draft_s, verify_s = (statistics.median(p[i] for p in parts) for i in (0, 1)) if parts else (None, None)
    row["draft_share"] = draft_s / (draft_s + verify_s) if parts else None
    row["draft_ms"] = 1000 * draft_s if parts else None
    row["verify_ms"] = 1000 * verify_s if parts else None
    row["overhead_ms"] = row["cycle_ms"] - row["draft_ms"] - row["verify_ms"] if parts and row["cycle_ms"] else None


def bench(
    model,
    tokenizer,
    prompts: list[list[int]],
    methods: list[Method],
    max_tokens: int,
    trials: int,
    temps: list[float],
    classic_draft=None,
    progress: bool = True,
) -> dict:
    def attempt(m: Method, run, *args):
        """run(m, *args), except that a peer failing makes its method a row that says why."""
        if m.kind == "peer" and m.peer is None:
            return None
        try:
            return run(m, *args)
        except PeerError as e:
            m.peer, m.note = None, str(e)
            return None

    results, sample, per_prompt, summary, calibration = [], None, [], [], []
    parts = {m.name: [] for m in methods}  # (drafter pass, verify pass) per trial of the first temperature
    with Progress(disable=not progress, transient=True) as bar:
        total = len(temps) * (trials * len(prompts) + 1) * len(methods)
        task = bar.add_task("bench", total=total)
        for temp in temps:
            runs = {m.name: [] for m in methods}
            for m in methods:  # warm-up (compilation, allocator), not counted: a short run of the first prompt
                attempt(m, run_method, model, tokenizer, prompts[0], min(max_tokens, 16), temp, classic_draft)
                bar.advance(task)
            for trial in range(1, trials + 1):
                for m in methods:
                    runs[m.name].append([None] * len(prompts))
                for i, p in enumerate(prompts):
                    for m in methods if (trial + i) % 2 else methods[::-1]:  # ABBA: see the module's docstring
                        mx.random.seed(trial)
                        runs[m.name][-1][i] = attempt(
                            m, run_method, model, tokenizer, p, max_tokens, temp, classic_draft
                        )
                        bar.advance(task)
                if temp == temps[0]:  # greedy timings of each method's passes, right after the trial's runs
                    for m in methods:
                        parts[m.name].append(attempt(m, cycle_parts, model, prompts[0]))
            baseline = method_row(methods[0], runs[methods[0].name], None)
            if sample is None:  # every method agreeing proves nothing if the target itself babbles
                sample = {"temperature": temp, "text": tokenizer.decode(runs[methods[0].name][0][0].tokens)}
            for m in methods:
                if m.kind == "peer" and m.peer is None:
                    row = unavailable_row(m)
                    row["temperature"] = temp
                    results.append(row)
                    continue
                row = method_row(m, runs[m.name], baseline["generation_tps_median"])
                row["temperature"] = temp
                add_cycle_parts(row, [p for p in parts[m.name] if p is not None])
                if temp == 0:
                    row["lossless"] = row["token_sha256"] == baseline["token_sha256"]
                else:
                    row["lossless"] = None  # sampled outputs are checked by the test suite's distribution tests
                results.append(row)
            rows = per_prompt_rows(methods, runs, temp)
            per_prompt += rows
            summary += adaptive_summary(methods, runs, rows)
            if temp > 0:
                calibration += shadow_calibration(model, tokenizer, prompts, methods, results, max_tokens, temp)
    errors = [
        f"{r['method']} at T=0 produced different tokens than {methods[0].name}"
        for r in results
        if r["lossless"] is False
    ]
    return {
        "results": results,
        "per_prompt": per_prompt,
        "adaptive_summary": summary,
        "shadow_calibration": calibration,
        "sample_output": sample,
        "costs": cost_curves(model, methods),
        "errors": errors,
    }


def shadow_calibration(
    model, tokenizer, prompts: list[list[int]], methods: list[Method], results: list[dict], max_tokens: int, temp: float
) -> list[dict]:
    """At T > 0, per drafter: the tau that adaptive mode's shadow probes expect at each fixed block size
    (1 + the mean over probes of sum_i P(drafts 1..i accepted)), from plain decoding with a probe before every
    block_max steps on the same prompts, against the tau the fixed-block rows measured. The probes (like adaptive
    mode's cycles) propose blocks of block_max, a fixed block of B proposes a block of B: at B = block_max the two
    are the same drafter pass, below it the row also shows what the larger block's drafts are worth."""
    eos, rows = set(tokenizer.eos_token_ids), []
    for label, drafter in {m.drafter_label: m.drafter for m in methods if m.kind == "adaptive"}.items():
        measured = {
            r["block_size"]: r["tau"]
            for r in results
            if r["kind"] == "dflash"
            and r["drafter"] == label
            and r["temperature"] == temp
            and r["walk"] == "greedy"
            and r["tau"]
        }
        if not measured:
            continue
        target, block_max = bind_drafter(drafter, model), drafter.config.block_size
        costs = load_or_measure_costs(target, drafter, block_max)
        chains = []
        for seed, prompt in enumerate(prompts, 1):
            mx.random.seed(seed)
            steps = dflash_steps(
                target,
                drafter,
                mx.array(prompt, mx.uint32),
                SamplingParams(temperature=temp),
                ShadowBlocks(costs, AdaptiveConfig(block_max)),
                max_tokens,
            )
            produced = 0
            for step in steps:
                chains += [step.shadow] if step.shadow is not None else []
                produced += len(step.tokens)
                if produced >= max_tokens or eos.intersection(step.tokens):
                    break
            steps.close()
        for B, tau in sorted(measured.items()):
            whole = [c for c in chains if len(c) >= B - 1]
            expected = 1 + sum(sum(c[: B - 1]) for c in whole) / len(whole) if whole else None
            rows.append(
                {
                    "temperature": temp,
                    "drafter": label,
                    "block_size": B,
                    "probe_block": block_max,
                    "probes": len(whole),
                    "expected_tau": expected,
                    "measured_tau": tau,
                    "relative": expected / tau - 1 if expected else None,
                }
            )
    return rows


def methods_for(
    drafters: list[tuple[str, object]],
    block_sizes: list[int] | None,
    classic: bool,
    walks: tuple[str, ...] = ("greedy", "viterbi"),
    tree_budgets: tuple[int | None, ...] = (),
) -> list[Method]:
    """The bench's rows: mlx-lm, plain decoding, and per drafter adaptive mode, each fixed block (each walk of a
    DFlash 2 drafter) and each tree budget; mlx-lm's classic speculative decoding with a `classic` draft model.
    Each is named by its drafter's label (the JSON's "method") and labelled by its drafter's kind for the report
    ("DFlash 2 · B=5 greedy": `drafter_names`)."""
    names = drafter_names(drafters)
    methods = [Method("mlx-lm", "mlx-lm"), Method("plain", "plain")]
    for label, drafter in drafters:
        methods.append(
            Method(
                f"{label} adaptive",
                "adaptive",
                drafter,
                drafter.config.block_size,
                "greedy",
                label,
                label=f"{names[label]} · adaptive",
            )
        )
        for B in fixed_block_sizes(drafter, block_sizes):
            for walk in walks if len(drafter.walks) > 1 else drafter.walks:
                which = f"B={B}" + (f" {walk}" if len(drafter.walks) > 1 else "")
                methods.append(
                    Method(f"{label} {which}", "dflash", drafter, B, walk, label, label=f"{names[label]} · {which}")
                )
            for budget in tree_budgets:  # trees as deep as the linear rows' blocks, for a like-for-like tau
                methods.append(
                    Method(
                        f"{label} B={B} ddtree {budget or 'auto'}",
                        "ddtree",
                        drafter,
                        B,
                        "greedy",
                        label,
                        tree_budget=budget,
                        label=f"{names[label]} · B={B} tree {budget or 'auto'}",
                    )
                )
    if classic:
        for B in block_sizes or [4]:
            methods.append(
                Method(
                    f"mlx-lm speculative k={B - 1}",
                    "mlx-lm-spec",
                    block_size=B,
                    label=f"mlx-lm · speculative k={B - 1}",
                )
            )
    return methods


# What the report calls a drafter of each kind (`DFlashDraftModel.kind`).
DRAFTER_KINDS = {"v1": "v1", "dflash2": "DFlash 2"}


def drafter_names(drafters: list[tuple[str, object]]) -> dict[str, str]:
    """The name each drafter goes by on the report, by its label: its kind ("v1", "DFlash 2"), numbered where
    several share one ("DFlash 2 (1)", "DFlash 2 (2)"); the report's header gives each name's drafter once."""
    kinds = [DRAFTER_KINDS.get(drafter.kind, drafter.kind) for _, drafter in drafters]
    return {
        label: kind + (f" ({kinds[: i + 1].count(kind)})" if kinds.count(kind) > 1 else "")
        for i, ((label, _), kind) in enumerate(zip(drafters, kinds))
    }


def fixed_block_sizes(drafter, block_sizes: list[int] | None) -> list[int]:
    """The block sizes of a drafter's fixed-block rows: those asked for that it can run, else its default."""
    sizes = block_sizes or [None]
    return [resolve_block_size(drafter, B) for B in sizes if B is None or B <= drafter.config.block_size]


def peer_methods(peers: list, drafters: list[tuple[str, object]], block_sizes: list[int] | None) -> list[Method]:
    """A row per peer engine, drafter and block size of our fixed-block rows (the reference's greedy walk)."""
    methods, names = [], drafter_names(drafters)
    for peer in peers:
        drafter = dict(drafters)[peer.drafter_label]
        for B in fixed_block_sizes(drafter, block_sizes):
            methods.append(
                Method(
                    f"{peer.engine} {peer.drafter_label} B={B}",
                    "peer",
                    drafter,
                    B,
                    "greedy",
                    peer.drafter_label,
                    peer=peer.worker,
                    note=peer.note,
                    label=f"{peer.engine} · {names[peer.drafter_label]} · B={B}",
                )
            )
    return methods


# -- the command -------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="compare tokens/s of every decoding method side by side, in one process, with a lossless check",
        description="Run mlx-lm's generation, plain decoding through our loop, mlx-lm's classic speculative "
        "decoding (--baseline-draft-model) and each DFlash drafter (each block size; DFlash 2 with both walks), "
        "trial by trial after a warm-up, and report tokens/s, speedup, acceptance, memory and a token-hash check.",
    )
    add_bench_model_args(p)
    p.add_argument("--baseline-draft-model", help="a classic draft model for mlx-lm's speculative decoding")
    p.add_argument(
        "--prompts", default="math", help="suites (code, chat, math, long, copy; comma-separated) or a JSONL file"
    )
    p.add_argument("--num-prompts", type=int, default=4, help="prompts taken from each suite")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--copyspec-modes",
        default="auto",
        metavar="LIST",
        help="copy-draft modes our rows run, comma-separated (auto, conservative, aggressive, off; "
        "default auto): several give each row once per mode, e.g. auto,off",
    )
    p.add_argument("--block-sizes", help="comma-separated runtime block sizes (default: each drafter's default)")
    p.add_argument("--temp", type=float, action="append", help="temperature (repeatable; default 0)")
    p.add_argument("--json", metavar="OUT", help="write everything machine-readable here")
    p.add_argument("--markdown", metavar="OUT", help="write the report as markdown here")
    p.add_argument(
        "--walk",
        action="append",
        choices=["greedy", "viterbi"],
        help="DFlash 2 path walks to bench (repeatable; default both)",
    )
    p.add_argument("--quick", action="store_true", help="1 trial, 2 prompts, 24 tokens: a smoke run")
    p.add_argument(
        "--wide",
        action="store_true",
        help="every column on the terminal (default: method, tok/s, vs mlx-lm, tau, lossless; the markdown "
        "and the JSON have them all)",
    )
    p.add_argument(
        "--compare",
        metavar="FILE",
        help="CUDA-side results to show beside ours: a dflash2-compare/1 JSON, a z-lab benchmark log, "
        "SGLang responses (JSONL), or 'published'",
    )
    p.add_argument(
        "--tree-sim",
        metavar="DATA",
        help="runs `dflash2 tree-sim DATA` (teacher-forced tau of the linear path and of ddtree trees per "
        "budget, no timing) with the flags given here",
    )
    p.add_argument(
        "--tree-budgets",
        help="comma-separated tree budgets: a ddtree row per budget (at each block size; 'auto': the "
        "default budget from this machine's costs), or the columns of --tree-sim (default there: "
        "1,2,4,8,16,32)",
    )
    p.add_argument("--tree-sim-samples", type=int, default=8, help="held-out samples --tree-sim reads")
    p.add_argument(
        "--replay",
        action="store_true",
        help="runs `dflash2 replay` (plain steps, fixed blocks and adaptive mode replayed on recorded "
        "drafts, timed on a cost curve) with the flags given here",
    )
    p.add_argument(
        "--replay-traces",
        metavar="FILE",
        help="keep the recorded answers and proposals here (JSON) and reuse them when they match",
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        help="with --replay: replay on the cost curve in this JSON file instead of this machine's (a costs "
        'cache such as ~/.cache/dflash2/costs.json, one {"verify_s": [...], "draft_s": [...]} '
        'object, or a replay report\'s "costs")',
    )
    p.add_argument(
        "--replay-jitter",
        type=int,
        default=0,
        metavar="N",
        help="with --replay: also replay on N cost curves within +-3%% of the measured one and report "
        "adaptive mode averaged over them (a single curve's decisions swing by several percent)",
    )
    p.add_argument(
        "--engines",
        metavar="LIST",
        help="peer engines to add rows for, each in its own process with the same target, drafters and "
        "prompts: dflash (the authors' reference), dflash-mlx (oMLX's engine); comma-separated",
    )
    p.add_argument(
        "--peer-python",
        metavar="PYTHON",
        help="the interpreter the peer engines are installed in (default: this one), e.g. a venv's "
        "bin/python, so their pinned dependencies stay out of this environment",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    if args.compare:  # fail on a bad comparison file before spending time on the runs
        load_comparison(args.compare)
    engines = parse_engines(args.engines)
    if args.peer_python and not engines:
        raise ValueError("--peer-python goes with --engines (the peer engines it runs)")
    if args.replay_jitter and not args.replay:
        raise ValueError("--replay-jitter goes with --replay (it replays the kept answers on perturbed curves)")
    if args.costs and not args.replay:
        raise ValueError("--costs goes with --replay (it replays the recorded answers on that cost curve)")
    peer_python = check_python(args.peer_python) if args.peer_python else sys.executable
    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    if args.quick:
        args.trials, args.num_prompts, args.max_tokens = 1, 2, 24
    if args.tree_sim or args.replay:
        return run_alias(args)
    model, tokenizer, drafters, sources = load_bench_models(args)
    classic = load_target(args.baseline_draft_model, args.dtype)[0] if args.baseline_draft_model else None
    texts, prompts = bench_prompts(args, tokenizer)
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else None
    budgets = tuple(None if b == "auto" else int(b) for b in args.tree_budgets.split(",")) if args.tree_budgets else ()
    methods = methods_for(drafters, sizes, classic is not None, tuple(args.walk or ("greedy", "viterbi")), budgets)
    methods = with_copyspec_modes(methods, args.copyspec_modes.split(","))
    peers = PeerEngines()
    try:
        if engines:
            started = peers.start(
                engines,
                peer_python,
                args.model,
                args.dtype,
                model,
                [(label, d, src) for (label, d), src in zip(drafters, sources)],
            )
            methods += peer_methods(started, drafters, sizes)
        report = bench(model, tokenizer, prompts, methods, args.max_tokens, args.trials, args.temp or [0.0], classic)
    finally:
        peers.close()
    weights = [v for _, v in tree_flatten(model.parameters())]
    report["context"] = {
        "target": args.model or "SmolLM2-135M-Instruct (default)",
        "drafters": [label for label, _ in drafters],
        "drafter_names": drafter_names(drafters),
        "dtype": ",".join(sorted({str(w.dtype).split(".")[-1] for w in weights})),
        "prompts": len(prompts),
        "suites": args.prompts,
        "prompts_sha256": prompts_sha256(texts),
        "trials": args.trials,
        "max_tokens": args.max_tokens,
        "runtime": runtime_info(args.kernels),
        "engines": engines,
        "peer_python": peer_python if engines else None,
        "command": command_line(args),
        **report_context(),  # the commit and the package version
        "costs": report["costs"],  # the cost curves (in plain steps) adaptive mode and ddtree budgets ran on
    }
    console = report_console()
    markdown = render(report, console, args.wide)
    if args.compare:
        report["compare"] = load_comparison(args.compare)
        markdown += render_comparison(report["compare"], report["results"], console)
    if args.json:
        Path(args.json).write_text(report_json(report))
    write_markdown(args, markdown)
    return 1 if report["errors"] else 0


def run_alias(args) -> int:
    """`bench --tree-sim DATA` and `bench --replay`: say on stderr which command they are now, and run it."""
    if args.tree_sim:
        print(
            "dflash2 bench: --tree-sim DATA is the command `dflash2 tree-sim DATA` now, which takes the other "
            "flags as they are; running it",
            file=sys.stderr,
        )
        return tree_sim.run(args)
    print(
        "dflash2 bench: --replay is the command `dflash2 replay` now, which takes the other flags as they are; "
        "running it",
        file=sys.stderr,
    )
    return replay.run(args)
