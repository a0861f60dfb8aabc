"""What the server's handlers share (`App`): the worker, the request parser, the served names, the settings;
and `build_server`, which makes an `App` and its HTTP server from a loaded model."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from http.server import ThreadingHTTPServer

from .. import distributed
from ..adaptive import load_or_measure_costs
from ..generate import resolve_block_size
from ..loading import bind_drafter
from ..target import Target
from ..tree import TREE_BUDGET_MAX, default_budget
from .batched_worker import BATCHED_SPECULATION, BatchedWorker, batched_warm_start
from .http import make_server
from .protocol import GenerationArguments, RequestParser
from .scheduler import COUNTS

log = logging.getLogger("dflash2.serve")


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """The server's own settings (`dflash2 serve` takes its flags' defaults from here)."""

    host: str = "127.0.0.1"  # anything but loopback exposes the model to the network
    port: int = 8080  # 0 picks a free port
    queue_size: int = 8  # requests waiting beyond the running ones; more get 503
    request_timeout: float = 600.0  # seconds a request may take, queueing included
    context_length: int | None = None  # longest prompt + max_tokens accepted; None: the model's own
    prompt_cache: bool = True  # reuse cached prefixes (`PromptCaches`) for the prefix a request shares with one
    prompt_cache_size: int = 10  # prompt-cache slots (distinct cached sequences), as mlx_lm.server's flag
    prompt_cache_bytes: int | None = None  # their byte budget; None: bounded by the slot count alone
    decode_concurrency: int = 32  # most requests decoded together (mlx_lm.server's flag); more wait queued
    batched_speculation: str = "auto"  # "auto": where the measured batched curve pays; "on"; "off" (mlx-lm's batch)
    api_key: str | None = field(default=None, repr=False)  # required of every client (Bearer or x-api-key)
    allowed_origins: tuple[str, ...] = ()  # browser origins answered with CORS headers ("*": any); none by default
    max_body_bytes: int = 16 << 20  # a longer request body gets 413
    read_timeout: float = 30.0  # seconds a client has to send a request's headers and body; then it is dropped
    chat_template_args: Mapping | None = None  # keyword arguments of every chat template call (requests add theirs)

    def __post_init__(self):
        if self.batched_speculation not in BATCHED_SPECULATION:
            raise ValueError(
                f"--batched-speculation takes {', '.join(BATCHED_SPECULATION)}; got {self.batched_speculation!r}"
            )
        if self.read_timeout <= 0:
            raise ValueError(f"--read-timeout must be > 0 seconds, got {self.read_timeout:g}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty: give a key, or leave it unset to serve without one")
        if self.chat_template_args is not None and not isinstance(self.chat_template_args, Mapping):
            raise ValueError("--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": false}'")


def warm_start(model, drafter, defaults: GenerationArguments) -> dict:
    """`stream_cycles`'s keyword arguments that spare every request the measurement of this machine's cycle
    costs: adaptive mode's cost model, or ddtree's tree budget when --tree-budget is unset, loaded from the cache
    or measured now, before the server accepts a request. Requests never measure: a stale verdict during serving
    drops the cached copy (logged; the next start measures anew) while this curve stays in use, adaptive mode
    rescaling it online within each request by the cycles and plain steps it times.

    Args:
        model: the target (or rank 0's `distributed.ShardedTarget`).
        drafter: the drafter (None: plain decoding, nothing to measure).
        defaults: the server's generation arguments (its verify mode, block size and tree budget).
    """
    mode = defaults.verify_mode
    if drafter is None or mode not in ("adaptive", "ddtree"):
        return {}
    target = model if isinstance(model, Target) else bind_drafter(drafter, model)  # a sharded target is bound
    block = resolve_block_size(drafter, defaults.block_size, mode)
    if mode == "adaptive":
        return {"costs": load_or_measure_costs(target, drafter, block)}
    if defaults.tree_budget is None:
        return {
            "tree_budget": default_budget(load_or_measure_costs(target, drafter, block, TREE_BUDGET_MAX + 1), block)
        }
    return {}


def sharded_info(model) -> dict | None:
    """What /health says of a target sharded over processes (None: one process)."""
    if not isinstance(model, distributed.ShardedTarget):
        return None
    return {
        "mode": model.mode,
        "processes": model.group.size(),
        "batching": False,
        "note": "one request at a time: batched decoding would run the model in one process",
    }


class App:
    """What the HTTP handlers share: the worker, the request parser, the model's names and context, and the
    default generation arguments.

    The cycle costs adaptive mode (or ddtree's default budget) needs are loaded or measured here (`warm_start`),
    before the worker starts. `model` may be rank 0's `distributed.ShardedTarget` (its measurements announced
    to the other processes): requests then run one at a time, speculatively (`sharded`).

    Args:
        model, tokenizer, drafter: what generates (`stream_cycles`' own).
        model_id: the name clients use in 'model'.
        defaults: the generation arguments of what a request leaves unset (the server's flags).
        settings: the server's own settings.
        served_names: the names (beside `model_id`) clients may use in 'model' (--served-model-name).
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter,
        model_id: str,
        defaults: GenerationArguments,
        settings: ServeSettings,
        served_names: tuple[str, ...] = (),
    ):
        self.tokenizer, self.model_id, self.settings = tokenizer, model_id, settings
        self.sharded = sharded_info(model)
        self.model_names = list(dict.fromkeys([model_id, *served_names]))
        tic = time.perf_counter()
        measured = warm_start(model, drafter, defaults)
        self.defaults = replace(defaults, **measured)
        if measured:
            log.info("cycle costs ready in %.1f s (loaded or measured once, at startup)", time.perf_counter() - tic)
        self.request_timeout = settings.request_timeout
        target = model if isinstance(model, Target) else Target(model)
        self.vocab_size = target.vocab_size
        model_context = getattr(getattr(target.model, "args", None), "max_position_embeddings", None)
        self.context_length = settings.context_length or model_context
        if self.context_length is None:
            log.warning(
                "the model does not say its context length: prompts are not checked against one (set --context-length)"
            )
        mode = self.defaults.verify_mode
        draft_tokens = (
            0 if drafter is None or mode == "off" else resolve_block_size(drafter, self.defaults.block_size, mode) - 1
        )
        self.parser = RequestParser(
            tokenizer,
            self.defaults,
            self.model_names,
            self.vocab_size,
            self.context_length,
            draft_tokens,
            settings.chat_template_args,
        )
        self.responses: Counter = Counter()  # HTTP answers sent, by status code (`count_response`)
        self._responses_lock = threading.Lock()
        # a sharded target: mlx-lm's BatchGenerator would run the model on rank 0 alone, so never more than one
        concurrency = 1 if self.sharded else settings.decode_concurrency
        tic = time.perf_counter()
        costs, block_max, reason = batched_warm_start(
            model, drafter, self.defaults, concurrency, settings.batched_speculation
        )
        if costs is not None:
            log.info("batched step costs ready in %.1f s: %s", time.perf_counter() - tic, reason)
        self.worker = BatchedWorker(
            model,
            tokenizer,
            drafter,
            settings.queue_size,
            settings.prompt_cache,
            costs=costs,
            block_max=block_max,
            reason=reason,
            prompt_cache_size=settings.prompt_cache_size,
            prompt_cache_bytes=settings.prompt_cache_bytes,
            decode_concurrency=concurrency,
        )
        self.created = int(time.time())

    def count_response(self, status: int) -> None:
        """Count an HTTP answer sent (the handlers' threads call this)."""
        with self._responses_lock:
            self.responses[status] += 1

    def decoding_counts(self) -> dict:
        """What /health says of the speculative cycles run so far: the cycles and draft tokens they accepted, and
        those of them that came from lookups in the context (copy drafts)."""
        counts = dict(self.worker.counts)
        return {key: counts[key] for key in ("cycles", "accepted_tokens", "lookup_cycles", "lookup_tokens")}

    def batch_speculation(self) -> dict:
        """What /health says of speculation inside the batch: the batched cycles run, the drafts they accepted,
        and why they run (the measured batched curve pays) or never do."""
        worker = self.worker
        return {
            "batched_cycles": worker.batched_cycles,
            "batched_accepted_tokens": worker.batched_accepted,
            "speculative": worker.batched_costs is not None,
            "reason": worker.batched_reason,
        }

    def metrics(self) -> str:
        """The server's counters and gauges in Prometheus' text format (GET /metrics)."""
        worker = self.worker
        lines = []

        def metric(name: str, kind: str, what: str, samples) -> None:
            lines.extend([f"# HELP dflash2_{name} {what}", f"# TYPE dflash2_{name} {kind}"])
            lines.extend(f"dflash2_{name}{labels} {value}" for labels, value in samples)

        counts = dict(worker.counts)
        for key, what in COUNTS.items():
            metric(f"{key}_total", "counter", what, [("", counts[key])])
        batched = {
            "batched_cycles_total": ("batched steps that verified drafts (speculation inside the batch)", "cycles"),
            "batched_accepted_tokens_total": ("draft tokens accepted in batched cycles", "accepted_tokens"),
        }
        info = self.batch_speculation()
        for name, (what, key) in batched.items():
            metric(name, "counter", what, [("", info[f"batched_{key}"])])
        metric(
            "batched_tokens_total",
            "counter",
            "tokens committed by decode steps that served more than one request",
            [("", worker.batched_tokens)],
        )
        metric(
            "batched_seconds_total",
            "counter",
            "seconds those steps took (their rate over this one's: the batch's tokens per second)",
            [("", round(worker.batched_seconds, 6))],
        )
        metric(
            "http_responses_total",
            "counter",
            "HTTP answers sent, by status code",
            [(f'{{code="{code}"}}', n) for code, n in sorted(self.responses.copy().items())],
        )
        gauges = {
            "queue_length": ("requests waiting for the worker", worker.jobs.qsize()),
            "active_requests": ("requests generating now", len(worker.active)),
            "batch_size": ("requests in the batch's last decode step (0: none batched)", worker.batch_size),
            "batch_size_max": ("the most requests one decode step has served", worker.batch_size_max),
            "prompt_cache_slots": ("sequences the prompt cache holds", worker.cache_info["slots"]),
            "prompt_cache_bytes": ("bytes the prompt cache holds", worker.cache_info["bytes"]),
        }
        for name, (what, value) in gauges.items():
            metric(name, "gauge", what, [("", value)])
        return "\n".join(lines) + "\n"

    def close(self) -> bool:
        """End every job; True once no generation runs."""
        return self.worker.stop()


def build_server(
    model,
    tokenizer,
    drafter,
    *,
    model_id: str,
    defaults: GenerationArguments | None = None,
    settings: ServeSettings | None = None,
    served_names: tuple[str, ...] = (),
) -> tuple[App, ThreadingHTTPServer]:
    """An `App` and its HTTP server, bound to the settings' host and port but not yet serving.

    Serve with `server.serve_forever()`; stop with `server.shutdown()`, `app.close()`, `server.server_close()`.

    Args:
        model, tokenizer, drafter: what generates (a loaded target, its tokenizer, its drafter or None).
        model_id: the name clients use in 'model'.
        defaults: the generation arguments of what a request leaves unset (default: `stream_cycles`' own).
        settings: the server's own settings (default: `ServeSettings()`).
        served_names: other names clients may use in 'model'.
    """
    app = App(
        model,
        tokenizer,
        drafter,
        model_id,
        defaults or GenerationArguments(),
        settings or ServeSettings(),
        served_names,
    )
    try:
        return app, make_server(app)
    except BaseException:
        app.close()
        raise
