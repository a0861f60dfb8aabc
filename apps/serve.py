"""`dflash2 serve`: an OpenAI-compatible HTTP server over `stream_cycles`.

POST /v1/chat/completions and /v1/completions (server-sent events with `"stream": true`), GET /v1/models and
GET /health. Request fields are OpenAI's and mlx_lm.server's; every response carries `usage` and a `dflash`
object (verify mode that ran, tau, cycles, accepted drafts, reused prompt tokens), non-streaming ones also
`X-DFlash-*` headers, so a fallback to plain decoding is visible. `logprobs` come in OpenAI's shapes (chat:
`logprobs` true and `top_logprobs` N; completions: `logprobs` N), streamed with the text too.

One worker thread owns the model: a lone request decodes speculatively, concurrent ones together in mlx-lm's
`BatchGenerator` (`Worker`), each starting from the cached sequence sharing the longest prefix with it
(`PromptCaches`). HTTP threads (the standard library's ThreadingHTTPServer, one per connection) validate a
request, queue it (bounded: a full queue answers 503 with Retry-After) and relay its records. A job is
cancelled, at the next cycle or batch step, when its client disconnects, a stop string is met, or its timeout
passes; the generation is always closed, which releases the model's capture.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import queue
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences, TextStateMachine
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.server import ToolCallFormatter
from mlx_lm.utils import _parse_size as parse_size

from dflash2_apps import common
from dflash2_mlx import PromptCache, PromptCaches, distributed
from dflash2_mlx.adaptive import load_or_measure_costs
from dflash2_mlx.assets import DEFAULT_TARGET_NAME
from dflash2_mlx.generate import CycleResponse, encode_text, resolve_block_size, stream_cycles, summarize
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target
from dflash2_mlx.tree import TREE_BUDGET_MAX, default_budget

log = logging.getLogger("dflash2.serve")

MAX_BODY_BYTES = 16 << 20
GRACE_SECONDS = 30.0  # past a job's deadline, how long its client waits for the worker to notice
POLL_SECONDS = 0.2  # how often a waiting client connection is checked
SEND_TIMEOUT_SECONDS = 60  # a write to a client that reads nothing for this long fails (and cancels its job)
RESUME_MIN_TOKENS = 16  # a request left alone in the batch goes on speculatively if it has this many tokens to go
RESUME_GRACE_STEPS = 2  # ... once it has been alone, nothing queued, for this many batch steps: a client's next
# request (sent as its last answer ends) joins the batch then, sparing the request the move out and back
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class Record(CycleResponse):
    """A cycle's record as the worker relays it: its lazy `logprobs` rows dropped (a request's records would
    otherwise keep [tokens, V] alive), and, where the request asked for logprobs, their numbers read on the
    worker's thread: per token (its logprob, the top (token id, logprob) pairs, best first)."""

    token_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def token_logprobs(rows: mx.array, tokens: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per token: its log-probability in its row of `rows` ([len(tokens), V]) and the `n` best (token id,
    log-probability) pairs of that row, best first; one host read."""
    rows = rows.astype(mx.float32)
    chosen = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top = mx.argpartition(-rows, kth=max(n, 1) - 1, axis=-1)[:, :n]
    values = mx.take_along_axis(rows, top, axis=-1)
    mx.eval(chosen, top, values)
    return [(c, sorted(zip(i, v), key=lambda p: -p[1])) for c, i, v in zip(chosen.tolist(), top.tolist(), values.tolist())]


def relayed_cycles(model, tokenizer, prompt, drafter=None, *, logprobs: int | None = None, **kwargs):
    """The worker's generation: `stream_cycles`' records as `Record`s; `logprobs` N (None: none) reads each
    token's log-probability and the N best of its row, one host read per cycle, only for requests that ask."""
    records = stream_cycles(model, tokenizer, prompt, drafter, **kwargs)
    try:
        for r in records:
            numbers = None
            if logprobs is not None and r.logprobs is not None and r.tokens:
                numbers = token_logprobs(r.logprobs, r.tokens, logprobs)
            yield Record(**{**{f.name: getattr(r, f.name) for f in fields(r)}, "logprobs": None},
                         token_logprobs=numbers)
    finally:
        records.close()


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    pass


@dataclass(frozen=True)
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


@dataclass
class Job:
    prompt: list[int]  # token ids (MLX arrays are made in the worker's thread, which evaluates them)
    kwargs: dict  # relayed_cycles's keyword arguments
    deadline: float  # time.monotonic()
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0  # time.monotonic() when the worker took it
    batch_size: int = 0  # the most requests it was decoded together with (0: it ran alone)


@dataclass
class Batched:
    """A job decoding in the batch: its detokenizer and counts."""

    job: Job
    detokenizer: object
    generated: int  # tokens generated so far (speculatively, before it joined the batch, included)
    cached: int  # prompt tokens taken from the prompt cache
    prefill: int  # prompt (and committed) tokens the batch still had to run
    tic: float
    prompt_tps: float = 0.0


class Worker:
    """The one thread that runs generations. A lone request decodes speculatively (`relayed_cycles`); while
    more than one is active they decode together, by plain steps, in mlx-lm's `BatchGenerator` (continuous
    batching: requests join and leave between steps). A speculative request that others queue behind joins the
    batch at its next cycle boundary, moved there with its prompt and committed tokens and a copy of its target
    cache; one left alone in the batch with nothing queued for RESUME_GRACE_STEPS steps and at least
    RESUME_MIN_TOKENS to go leaves it and goes on speculatively (prefilling what no prompt-cache slot with the drafter's context holds). Admission is
    first come first served: the queue's head is admitted while fewer than `decode_concurrency` decode; a head
    the batch cannot take (a seeded request, whose draws a shared batch cannot reproduce, or any request on a
    target whose caches cannot be batched) waits for the batch to drain, later requests behind it.

    Events a job gets: ("record", Record) ..., then ("end", reason, cached prompt tokens) with
    reason "finished", "cancelled" or "timeout", or ("error", exc)."""

    def __init__(self, model, tokenizer, drafter, queue_size: int, prompt_cache: bool, prompt_cache_size: int = 10,
                 prompt_cache_bytes: int | None = None, decode_concurrency: int = 32):
        if queue_size < 1:
            raise ValueError(f"--queue-size must be at least 1, got {queue_size}")
        if decode_concurrency < 1:
            raise ValueError(f"--decode-concurrency must be at least 1, got {decode_concurrency}")
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.caches = PromptCaches(prompt_cache_size, prompt_cache_bytes) if prompt_cache else None
        self.cache_info = self._cache_info()
        self.decode_concurrency = decode_concurrency
        # mlx_lm.server's test: every cache layer can be merged into a batch
        self.batchable = decode_concurrency > 1 and all(hasattr(c, "merge") for c in make_prompt_cache(model))
        self.active: list[Job] = []  # generating now, oldest first (replaced, never changed in place)
        self.batch_size = 0  # requests in the batch's last decode step (0: none batched now)
        self.batch_size_max = 0  # the most requests one decode step has served
        self.batched_steps = 0  # decode steps that served more than one request
        self.durations: deque = deque(maxlen=16)  # seconds of recent jobs, for Retry-After
        self.idle, self.closed = threading.Event(), False
        self.idle.set()
        self.thread = threading.Thread(target=self._loop, name="dflash2-worker", daemon=True)
        self.thread.start()

    @property
    def running(self) -> Job | None:
        """The oldest job generating now."""
        active = self.active
        return active[0] if active else None

    def submit(self, job: Job) -> bool:
        if self.closed:
            return False
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free."""
        mean = sum(self.durations) / len(self.durations) if self.durations else 1.0
        return max(1, math.ceil(mean / max(1, len(self.active))))

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel everything queued and running; True once no generation runs. The thread itself is left
        parked, not ended: a thread that ran MLX work and exits while the process lives on can make the process
        abort at exit ("terminate called without an active exception", MLX 0.32 on Linux), so it stays a daemon
        blocked on the queue until the process ends."""
        self.closed = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            job.cancelled.set()
            job.events.put(("end", "cancelled", 0))
        for job in self.active:
            job.cancelled.set()
        return self.idle.wait(timeout)

    # -- the worker's thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            self.idle.clear()
            try:
                handover = self._solo(job)
                while handover is not None:  # batched until alone again, then speculative again, ...
                    back = self._batch(handover)
                    handover = None if back is None else self._solo(back[0].job, *back)
            except BaseException as e:  # noqa: BLE001 -- the worker outlives any one request
                log.exception("generation failed")
                for failed in self.active:
                    failed.events.put(("error", e))
            finally:
                self.active, self.batch_size = [], 0
                if self.jobs.empty():
                    self.idle.set()

    def _stopped(self, job: Job) -> str | None:
        """Why `job` must stop now ("cancelled", "timeout"), or None."""
        if self.closed:
            job.cancelled.set()
        if job.cancelled.is_set():
            return "cancelled"
        return "timeout" if time.monotonic() > job.deadline else None

    def _start(self, job: Job) -> bool:
        """Make `job` active; False (its end sent) when it was cancelled or timed out while queued."""
        reason = self._stopped(job)
        if reason is not None:
            job.events.put(("end", reason, 0))
            return False
        job.started = time.monotonic()
        self.active = [*self.active, job]
        return True

    def _end(self, job: Job, reason: str, cached: int) -> None:
        job.events.put(("end", reason, cached))
        self.durations.append(time.monotonic() - job.started)
        self.active = [j for j in self.active if j is not job]

    def _cache_info(self) -> dict:
        caches = self.caches
        if caches is None:
            return {"slots": 0, "bytes": 0, "max_slots": 0, "max_bytes": 0}
        return {"slots": len(caches), "bytes": caches.nbytes, "max_slots": caches.max_size,
                "max_bytes": caches.max_bytes}

    def _keep(self, slot: PromptCache) -> None:
        if self.caches is not None:
            self.caches.put(slot)
            self.cache_info = self._cache_info()

    def _can_batch(self, job: Job) -> bool:
        return self.batchable and job.kwargs.get("seed") is None

    def _head(self) -> Job | None:
        """The job first in the queue (only this thread takes from it; `stop` may empty it)."""
        with self.jobs.mutex:
            return self.jobs.queue[0] if self.jobs.queue else None

    def _solo(self, job: Job, resumed: Batched | None = None, tokens: list[int] | None = None):
        """Run `job` alone, speculatively; returns what `_batch` needs to continue it when others queued behind it
        (at a cycle boundary), else None. `resumed`: the job left a batch alone, having generated `tokens` (its
        prompt and every token generated so far) of which it sent `resumed.generated`."""
        if resumed is None and not self._start(job):
            return None
        kwargs, prompt, done = job.kwargs, job.prompt, 0
        if resumed is not None:
            prompt, done = tokens, resumed.generated
            kwargs = {**kwargs, "max_tokens": kwargs["max_tokens"] - done}
        plain = kwargs.get("verify_mode") == "off" or self.drafter is None or \
            kwargs.get("max_context") is not None and len(prompt) >= kwargs["max_context"]
        slot = PromptCache() if self.caches is None else \
            self.caches.take(self.model, None if plain else self.drafter, prompt)
        records = relayed_cycles(self.model, self.tokenizer, prompt, self.drafter, prompt_cache=slot, **kwargs)
        reason, generated, handover = "finished", done, False
        try:
            for r in records:
                generated += len(r.tokens)
                job.events.put(("record", r if resumed is None else self._continued(r, resumed, generated)))
                if r.finish_reason:
                    break
                reason = self._stopped(job) or reason
                if reason != "finished":
                    break
                head = self._head()
                if head is not None and self._can_batch(job) and self._can_batch(head):
                    handover = True
                    break
        finally:
            records.close()  # releases the model's capture, at once; the slot is left whole
        cached = slot.reused if resumed is None else resumed.cached
        if not handover:
            self._keep(slot)
            self._end(job, reason, cached)
            return None
        cache, covered, rest = slot.resume()
        self._keep(slot)
        return job, cache, covered, rest, generated, cached

    def _continued(self, r: Record, resumed: Batched, generated: int) -> Record:
        """A record of a generation resumed after a batch, as the whole request's: its text decoded after the
        tokens sent before (the resumed generation's own detokenizer starts blank), its counts from the start."""
        d = resumed.detokenizer
        for t in r.tokens if r.finish_reason != "stop" else r.tokens[:-1]:
            d.add_token(t)
        if r.finish_reason:
            d.finalize()
        return replace(r, text=d.last_segment, prompt_tokens=len(resumed.job.prompt), generation_tokens=generated)

    def _batch(self, handover) -> tuple[Batched, list[int]] | None:
        """Decode the job handed over and every job the queue's head brings, together, until none is left (None),
        or until one is left alone with nothing queued for RESUME_GRACE_STEPS steps and at least RESUME_MIN_TOKENS
        to go: then it leaves the batch, to go on speculatively (its entry and its tokens so far, for `_solo`)."""
        # mlx_lm.server's settings: its --decode-concurrency, --prompt-concurrency (8) and --prefill-step-size
        gen = BatchGenerator(self.model, completion_batch_size=self.decode_concurrency,
                             prefill_batch_size=min(8, self.decode_concurrency),
                             prefill_step_size=handover[0].kwargs.get("prefill_step_size") or 2048)
        entries: dict[int, Batched] = {}
        alone = 0  # steps since the batch last held more than one request or had a request queued
        try:
            job, cache, covered, rest, generated, cached = handover
            self._insert(gen, entries, job, rest, cache, covered, generated, cached)
            while True:
                self._admit(gen, entries)
                if not entries:
                    return
                _, responses = gen.next()
                if len(responses) > 1:
                    self.batched_steps += 1
                    self.batch_size_max = max(self.batch_size_max, len(responses))
                self.batch_size = len(entries)
                for r in responses:
                    e = entries[r.uid]
                    e.job.batch_size = max(e.job.batch_size, len(responses))
                    e.job.events.put(("record", self._record(e, r.token, r.logprobs, r.finish_reason)))
                    if r.finish_reason:
                        del entries[r.uid]
                        self._keep(PromptCache.of_target(self.model, r.all_tokens, r.prompt_cache))
                        self._end(e.job, "finished", e.cached)
                for uid, e in list(entries.items()):
                    reason = self._stopped(e.job)
                    if reason is not None:
                        left = gen.remove([uid], return_prompt_caches=True)
                        del entries[uid]
                        if uid in left:
                            cache, tokens = left[uid]
                            self._keep(PromptCache.of_target(self.model, tokens, cache))
                        self._end(e.job, reason, e.cached)
                if len(entries) != 1 or self._head() is not None:
                    alone = 0
                    continue
                alone += 1
                if alone > RESUME_GRACE_STEPS:
                    back = self._alone(gen, entries)
                    if back is not None:
                        return back
        finally:
            gen.close()

    def _alone(self, gen, entries: dict) -> tuple[Batched, list[int]] | None:
        """Take the batch's one request out of it, to go on speculatively, when that can pay: a drafter to draft
        with, a first token generated, at least RESUME_MIN_TOKENS to go. Its batch cache is kept as a slot (the
        speculative generation prefills what no slot with the drafter's context holds)."""
        ((uid, e),) = entries.items()
        kw = e.job.kwargs
        if self.drafter is None or kw.get("verify_mode") == "off" or not e.prompt_tps or \
                kw["max_tokens"] - e.generated < RESUME_MIN_TOKENS:
            return None
        cache, tokens = gen.remove([uid], return_prompt_caches=True)[uid]
        del entries[uid]
        tokens = list(tokens)
        self._keep(PromptCache.of_target(self.model, tokens, cache))
        if tokens[:len(e.job.prompt)] != e.job.prompt or len(tokens) != len(e.job.prompt) + e.generated:
            raise RuntimeError(f"a batched sequence holds {len(tokens)} tokens, not its prompt and its "
                               f"{e.generated} generated tokens")
        self.batch_size = 0
        return e, tokens

    def _admit(self, gen, entries: dict) -> None:
        """Admit queued jobs, first come first served, while the batch has room and the head can be batched."""
        while len(entries) < self.decode_concurrency:
            head = self._head()
            if head is None or not self._can_batch(head):
                return
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:  # `stop` emptied it
                return
            if not self._start(job):
                continue
            cache, keep = (None, 0) if self.caches is None else self.caches.borrow(self.model, job.prompt)
            self.cache_info = self._cache_info()
            self._insert(gen, entries, job, job.prompt[keep:], cache, job.prompt[:keep], 0, keep)
            if self.caches is not None and self.caches.max_bytes is not None:  # the budget covers the batch's too
                self.caches.trim_to(self.caches.max_bytes - gen.prompt_cache_nbytes)
                self.cache_info = self._cache_info()

    def _insert(self, gen, entries: dict, job: Job, rest: list[int], cache, covered: list[int], generated: int,
                cached: int) -> None:
        """Put `job` in the batch: `rest` still to run over `cache` (None: a fresh one), which covers `covered`;
        `generated` tokens of it were generated (and sent) before."""
        kw = job.kwargs
        temp = kw.get("temp", 0.0)
        sampler = None if not temp else make_sampler(temp, kw.get("top_p", 1.0), kw.get("min_p", 0.0),
                                                     top_k=kw.get("top_k", 0))
        eos = kw.get("eos_token_ids")
        eos = self.tokenizer.eos_token_ids if eos is None else eos
        (uid,) = gen.insert([rest], max_tokens=[kw["max_tokens"] - generated], caches=[cache], all_tokens=[covered],
                            samplers=[sampler], logits_processors=[kw.get("logits_processors") or []],
                            stop_sequences=[StopSequences([[t] for t in eos])])
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        for t in (covered + rest)[len(job.prompt):]:  # the text sent already
            detokenizer.add_token(t)
        _ = detokenizer.last_segment
        entries[uid] = Batched(job, detokenizer, generated, cached, len(rest), time.perf_counter())

    def _record(self, e: Batched, token: int, logprobs: mx.array, finish: str | None) -> Record:
        """The record of one batched step, as `relayed_cycles` gives one (EOS is never rendered); `logprobs`:
        the row the batch chose `token` from (mlx-lm's, processed and log-softmaxed)."""
        if finish != "stop":
            e.detokenizer.add_token(token)
        if finish:
            e.detokenizer.finalize()
        now = time.perf_counter()
        if not e.prompt_tps:
            e.prompt_tps, e.tic = e.prefill / max(now - e.tic, 1e-9), now
        e.generated += 1
        n = e.job.kwargs.get("logprobs")
        return Record(
            text=e.detokenizer.last_segment, tokens=[token], accepted=None, prompt_tokens=len(e.job.prompt),
            prompt_tps=e.prompt_tps, generation_tokens=e.generated, generation_tps=e.generated / max(now - e.tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish, verify_mode="off",
            token_logprobs=None if n is None else token_logprobs(logprobs[None], [token], n))


class StopText:
    """Cuts streamed text at the first stop string, holding back a tail that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = [s for s in stops if s], ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that can be sent, whether a stop string was met)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class ToolCalls:
    """Splits tool calls off the generated text the way mlx_lm.server does for the same tokenizer: text between
    its wrapper's `tool_call_start` and `tool_call_end` markers (matched on text by mlx-lm's TextStateMachine) is
    one call, parsed by the wrapper's `tool_parser` with the request's tools and formatted by mlx-lm's
    ToolCallFormatter (id, type "function", function name and JSON arguments string; an index when streaming);
    the rest is content. A call that does not parse (cut short by max_tokens) is dropped with mlx-lm's warning."""

    def __init__(self, tokenizer, tools: list, streaming: bool):
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        machine = TextStateMachine({"normal": [(start, "tool")], "tool": [(end, "normal")] if end else []})
        self.state, self.previous, self.tool_text, self.made = machine.make_state("normal"), "normal", "", False
        self.format = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)

    def _take(self, segments) -> tuple[str, list[dict]]:
        content, calls = "", []
        for state, text in segments:
            if state == "tool":
                self.tool_text += text
            else:
                if self.previous == "tool":  # a call's end marker was met
                    calls.append(self.tool_text)
                    self.tool_text, self.made = "", True
                content += text
            self.previous = state
        return content, self.format(calls)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content that can be sent, the calls completed by `text`)."""
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._take(segments)

    def finish(self) -> tuple[str, list[dict]]:
        """What the generation's end leaves: held-back text, and a call whose end marker never came."""
        self.state, held, state = TextStateMachine.flush(self.state)
        content, calls = self._take([(state, held)])
        if self.previous == "tool" and self.tool_text:
            calls += self.format([self.tool_text])
            self.tool_text, self.made = "", True
        return content, calls


# -- request validation -------------------------------------------------------------------------------------


def _field(body: dict, name: str, types, default=None, check=None, expect: str = ""):
    """body[name] if present and not null, of `types` (bools are never numbers), passing `check`."""
    value = body.get(name)
    if value is None:
        return default
    numeric = types in (int, float, (int, float))
    if isinstance(value, bool) and numeric or not isinstance(value, types):
        wanted = expect or (types.__name__ if isinstance(types, type) else "a number")
        raise ApiError(400, f"'{name}' must be {wanted}, got {json.dumps(value)}", param=name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {expect}, got {json.dumps(value)}", param=name)
    return value


def _message_text(i: int, message) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise ApiError(400, f"messages[{i}].role must be a string", param="messages")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}} "
                           "(this server takes text only)", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
    return role, content


def _request_tools(body: dict, tokenizer) -> list | None:
    """The request's `tools`, for the chat template and the tool parser; None when it has none, or says
    tool_choice "none" (the template then renders no tools and the answer's text stays content)."""
    tools = _field(body, "tools", list, None, expect="a list of {'type': 'function', 'function': ...} objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(400, f"'tool_choice' must be \"auto\" or \"none\", got {json.dumps(choice)}: this server "
                       "cannot force a tool call", param="tool_choice")
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if not named or tool.get("type") != "function":
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           "...}}", param="tools")
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ApiError(400, "this model's chat template does not support tools (mlx-lm knows no tool-call format "
                       "for it): leave 'tools' unset, or serve a model whose template takes them", param="tools")
    return tools


def _chat_message(i: int, message) -> dict:
    """A request message as chat templates take it: role and text content, and an assistant's `tool_calls` (their
    JSON arguments decoded, as mlx_lm.server does), a tool result's `tool_call_id` and `name` when given."""
    role, content = _message_text(i, message)
    out = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [_template_tool_call(i, call) for call in calls]
    out.update({key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)})
    return out


def _template_tool_call(i: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"messages[{i}].tool_calls entries must be {{'type': 'function', 'function': "
                       "{'name': ..., 'arguments': ...}}", param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"messages[{i}]: the arguments of the call to {function['name']!r} are not valid "
                           f"JSON ({e})", param="messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _logprobs(kind: str, body: dict) -> int | None:
    """How many top tokens each generated token's logprobs list (0: its own logprob only), None for none. Chat:
    OpenAI's `logprobs` (true or false) and `top_logprobs` (0..20, with logprobs true); completions: `logprobs` N
    (0..20; true, as mlx_lm.server takes it, is `top_logprobs` or 0)."""
    top = _field(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                 expect=f"an integer in 0..{MAX_TOP_LOGPROBS}")
    if kind == "chat":
        wanted = _field(body, "logprobs", bool, False, expect="true or false")
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    wanted = _field(body, "logprobs", (bool, int), None, expect=f"an integer in 0..{MAX_TOP_LOGPROBS}")
    if isinstance(wanted, bool):
        return (top or 0) if wanted else None
    if wanted is not None and not 0 <= wanted <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be an integer in 0..{MAX_TOP_LOGPROBS}, got {wanted}", param="logprobs")
    return wanted


class Logprobs:
    """A request's per-token logprobs (`Record.token_logprobs`) in OpenAI's shapes: chat `{"content": [{token,
    logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, completions `{tokens, token_logprobs,
    top_logprobs: [{token: logprob}], text_offset}`. A token is its own decoded text; the EOS that stops a
    generation adds no text and is not listed. `take` hands over the tokens gathered since the last call (a
    streamed chunk carries those of the records it relays); text_offset is where the generated text stood
    (as the tokenizer's streaming detokenizer had rendered it) when each token came."""

    def __init__(self, tokenizer, kind: str):
        self.tokenizer, self.kind, self.detokenizer, self.pending = tokenizer, kind, tokenizer.detokenizer, []

    def add(self, record) -> None:
        numbers = getattr(record, "token_logprobs", None)
        if numbers is None:
            return
        tokens = record.tokens[:-1] if record.finish_reason == "stop" else record.tokens
        for token, (logprob, top) in zip(tokens, numbers):
            self.pending.append((token, logprob, top, len(self.detokenizer.text)))
            self.detokenizer.add_token(token)

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def take(self) -> dict:
        entries, self.pending = self.pending, []
        if self.kind == "chat":
            def item(token, logprob):
                text = self._piece(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                                for t, lp, top, _ in entries]}
        return {"tokens": [self._piece(t) for t, *_ in entries], "token_logprobs": [lp for _, lp, *_ in entries],
                "top_logprobs": [{**{self._piece(i): v for i, v in top}, self._piece(t): lp}
                                 for t, lp, top, _ in entries],
                "text_offset": [offset for *_, offset in entries]}


def warm_start(model, drafter, defaults: dict) -> dict:
    """`stream_cycles`'s keyword arguments that spare every request the measurement of this machine's cycle
    costs: adaptive mode's cost model, or ddtree's tree budget when --tree-budget is unset, loaded from the cache
    or measured now, before the server accepts a request. Requests never measure: a stale verdict during serving
    drops the cached copy (logged; the next start measures anew) while this curve stays in use, adaptive mode
    rescaling it online within each request by the cycles and plain steps it times."""
    mode = defaults.get("verify_mode")
    if drafter is None or mode not in ("adaptive", "ddtree"):
        return {}
    target = model if isinstance(model, Target) else bind_drafter(drafter, model)  # a sharded target is bound
    block = resolve_block_size(drafter, defaults.get("block_size"), mode)
    if mode == "adaptive":
        return {"costs": load_or_measure_costs(target, drafter, block)}
    if defaults.get("tree_budget") is None:
        return {"tree_budget": default_budget(load_or_measure_costs(target, drafter, block, TREE_BUDGET_MAX + 1),
                                              block)}
    return {}


@dataclass
class Request:
    kind: str  # "chat" or "text"
    prompt: list[int]
    kwargs: dict
    stream: bool
    include_usage: bool
    stop: list[str]
    model: str = ""  # the served name the request used, echoed in the answer
    tools: list | None = None  # chat requests with tools: the answer's tool calls are parsed out of its text
    logprobs: int | None = None  # per-token logprobs with this many top tokens each; None: no logprobs


class App:
    """What the HTTP handlers share: the worker, the model's name and context, and the default settings."""

    def __init__(self, model, tokenizer, drafter, model_id: str, defaults: dict, settings: ServeSettings,
                 served_names: tuple[str, ...] = ()):
        """`defaults`: `stream_cycles`'s keyword arguments for what a request leaves unset; `served_names`:
        the names (beside `model_id`) clients may use in 'model' (--served-model-name). The cycle costs
        adaptive mode (or ddtree's default budget) needs are loaded or measured here (`warm_start`), before
        the worker starts. `model` may be rank 0's `distributed.ShardedTarget` (its measurements announced to the
        other processes): requests then run one at a time, speculatively (`sharded`)."""
        self.tokenizer, self.model_id, self.settings = tokenizer, model_id, settings
        self.sharded = sharded_info(model)
        self.model_names = list(dict.fromkeys([model_id, *served_names]))
        tic = time.perf_counter()
        self.defaults = {**defaults, **warm_start(model, drafter, defaults)}
        if self.defaults.keys() != defaults.keys():
            log.info("cycle costs ready in %.1f s (loaded or measured once, at startup)", time.perf_counter() - tic)
        self.request_timeout = settings.request_timeout
        target = model if isinstance(model, Target) else Target(model)
        self.vocab_size = target.vocab_size
        model_context = getattr(getattr(target.model, "args", None), "max_position_embeddings", None)
        self.context_length = settings.context_length or model_context
        if self.context_length is None:
            log.warning("the model does not say its context length: prompts are not checked against one "
                        "(set --context-length)")
        # a sharded target: mlx-lm's BatchGenerator would run the model on rank 0 alone, so never more than one
        concurrency = 1 if self.sharded else settings.decode_concurrency
        self.worker = Worker(model, tokenizer, drafter, settings.queue_size, settings.prompt_cache,
                             settings.prompt_cache_size, settings.prompt_cache_bytes, concurrency)
        self.created = int(time.time())

    def parse(self, kind: str, body) -> Request:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = self.served_name(_field(body, "model", str, expect="a string"))
        stream = _field(body, "stream", bool, False, expect="true or false")
        options = _field(body, "stream_options", dict, {}, expect="an object")
        include_usage = _field(options, "include_usage", bool, False, expect="true or false")
        if _field(body, "n", int, 1, expect="an integer") != 1:
            raise ApiError(400, "'n' must be 1: this server generates one choice per request", param="n")
        logprobs = _logprobs(kind, body)
        kwargs = dict(self.defaults)
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        limit = None
        for name in ("max_tokens", "max_completion_tokens"):
            limit = _field(body, name, int, limit, lambda v: v >= 1, expect="an integer >= 1")
        number = (int, float)
        temp = _field(body, "temperature", number, kwargs["temp"], expect="a number")
        top_p = _field(body, "top_p", number, kwargs["top_p"], expect="a number")
        top_k = _field(body, "top_k", int, kwargs["top_k"], expect="an integer")
        min_p = _field(body, "min_p", number, kwargs["min_p"], expect="a number")
        try:
            SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
        except ValueError as e:
            raise ApiError(400, str(e).replace("temperature", "'temperature'")) from None
        kwargs.update(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
        kwargs["seed"] = _field(body, "seed", int, kwargs["seed"], expect="an integer")
        kwargs["logits_processors"] = self._processors(body) or kwargs.get("logits_processors")
        stop = _field(body, "stop", (str, list), [], expect="a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
        tools = _request_tools(body, self.tokenizer) if kind == "chat" else None
        prompt = self._prompt(kind, body, tools)
        n, context = len(prompt), self.context_length
        if context is not None and n >= context:
            raise ApiError(400, f"the prompt is {n} tokens, and this model's context is {context} tokens: "
                           "shorten the prompt", param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded")
        if context is not None and limit is not None and n + limit > context:
            raise ApiError(400, f"the prompt ({n} tokens) plus max_tokens ({limit}) exceed this model's context "
                           f"({context} tokens): lower max_tokens to {context - n} or less",
                           param="max_tokens", code="context_length_exceeded")
        if limit is None:
            limit = kwargs["max_tokens"] if context is None else min(kwargs["max_tokens"], context - n)
        kwargs["max_tokens"] = limit
        return Request(kind, prompt, kwargs, stream, include_usage, stop, model, tools, logprobs)

    def _processors(self, body: dict) -> list:
        """mlx-lm's logits processors from the request's `repetition_penalty`, `repetition_context_size` and
        `logit_bias` ({"token id": bias}, OpenAI's shape), as mlx-lm's server reads them (0 = no penalty)."""
        penalty = _field(body, "repetition_penalty", (int, float), 0.0, lambda v: v >= 0, expect="a number >= 0")
        size = _field(body, "repetition_context_size", int, 20, lambda v: v >= 1, expect="an integer >= 1")
        bias = _field(body, "logit_bias", dict, None, expect="an object of token id to bias")
        if bias:
            ids = [int(k) if isinstance(k, str) and k.strip().isdigit() else -1 for k in bias]
            numbers = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()]
            if not all(numbers) or not all(0 <= i < self.vocab_size for i in ids):
                raise ApiError(400, "'logit_bias' must map token ids (as strings, each below the vocabulary size "
                               f"{self.vocab_size}) to numbers, e.g. {{\"42\": -100}}", param="logit_bias")
            bias = {i: float(v) for i, v in zip(ids, bias.values())}
        return make_logits_processors(logit_bias=bias, repetition_penalty=penalty, repetition_context_size=size)

    def served_name(self, model: str | None) -> str:
        """The name a request's 'model' picks, echoed in its answer: one of the served names (the model's id, the
        --served-model-name ones), or the id when unset or mlx_lm.server's "default_model"; others get a 404."""
        if model is None or model == "default_model":
            return self.model_id
        if model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise ApiError(404, f"the model {model!r} does not exist here: this server serves {served} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        return model

    def _prompt(self, kind: str, body: dict, tools: list | None = None):
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise ApiError(400, "'messages' must be a list of {'role', 'content'} objects", param="messages")
            if not messages:
                raise ApiError(400, "'messages' is empty: send at least one message", param="messages")
            messages = [_chat_message(i, m) for i, m in enumerate(messages)]
            if not self.tokenizer.has_chat_template:
                raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions")
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
            except Exception as e:  # the template's own checks (role order, ...) speak for themselves
                raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            if not all(0 <= t < self.vocab_size for t in prompt):
                raise ApiError(400, f"'prompt' token ids must be in 0..{self.vocab_size - 1}", param="prompt")
            return prompt
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string (or a list of token ids)", param="prompt")
        return encode_text(self.tokenizer, prompt)

    def close(self) -> bool:
        """End every job; True once no generation runs."""
        return self.worker.stop()


def sharded_info(model) -> dict | None:
    """What /health says of a target sharded over processes (None: one process)."""
    if not isinstance(model, distributed.ShardedTarget):
        return None
    return {"mode": model.mode, "processes": model.group.size(), "batching": False,
            "note": "one request at a time: batched decoding would run the model in one process"}


class Handler(BaseHTTPRequestHandler):
    server_version = "dflash2"
    app: App  # set on the subclass `make_server` builds

    def setup(self):
        super().setup()
        # a client that stops reading cannot hold its thread (and the server's shutdown) for long
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_SECONDS, 0))

    def log_message(self, format, *args):  # noqa: A002 -- the standard library's name
        log.info("%s %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ApiError) -> None:
        self._send_json(e.status, e.body(), e.headers)

    def _client_gone(self) -> bool:
        """The client closed its side (HTTP/1.0 clients send nothing more: readable means EOF or reset)."""
        try:
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:  # nothing to read: still there
            return False
        except OSError:
            return True

    def _events(self, job: Job):
        """The job's events while its client is there; raises ClientGone or a 504 ApiError otherwise."""
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone from None
                if time.monotonic() > job.deadline + GRACE_SECONDS:
                    raise ApiError(504, "the generation did not stop at its timeout", kind="server_error") from None
                continue
            if event[0] == "record" and self._client_gone():
                raise ClientGone
            yield event
            if event[0] != "record":
                return

    # -- routes --------------------------------------------------------------------------------------------
    def do_GET(self):
        app = self.app
        if self.path.rstrip("/") == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": app.created, "owned_by": "dflash2"}
                for name in app.model_names]})
        elif self.path == "/health":
            self._send_health()
        else:
            self._send_error(ApiError(404, f"no route GET {self.path}", code="not_found"))

    def _send_health(self) -> None:
        """The server's state: up (its worker alive), what it serves, requests waiting and running, memory."""
        app = self.app
        alive = app.worker.thread.is_alive()
        self._send_json(200 if alive else 503, {
            "status": "ok" if alive else "unavailable", "model": app.model_id,
            "served_model_names": app.model_names,
            "verify_mode": app.defaults.get("verify_mode"), "queued": app.worker.jobs.qsize(),
            "running": app.worker.running is not None, "active": len(app.worker.active),
            "batch": {"size": app.worker.batch_size, "max_size": app.worker.batch_size_max,
                      "batched_steps": app.worker.batched_steps, "decode_concurrency": app.worker.decode_concurrency},
            "prompt_cache": app.worker.cache_info, "sharded": app.sharded,
            "memory": {"active_gb": round(mx.get_active_memory() / 1e9, 4),
                       "peak_gb": round(mx.get_peak_memory() / 1e9, 4)}})

    def do_POST(self):
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "text"}.get(self.path.rstrip("/"))
        job = None
        try:
            if kind is None:
                raise ApiError(404, f"no route POST {self.path}", code="not_found")
            request = self.app.parse(kind, self._read_json())
            job = Job(request.prompt, request.kwargs, time.monotonic() + self.app.request_timeout)
            if not self.app.worker.submit(job):
                wait = self.app.worker.retry_after()
                raise ApiError(503, f"the server is busy: its queue ({self.app.worker.jobs.maxsize} requests) is "
                               f"full; retry in {wait} s", kind="server_error", code="queue_full",
                               headers={"Retry-After": wait})
            (self._stream if request.stream else self._complete)(request, job)
        except ApiError as e:
            self._send_error(e)
        except ClientGone:
            log.info("client went away; its generation was cancelled")
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away mid-response; its generation was cancelled")
        finally:
            if job is not None:
                job.cancelled.set()  # whatever happened here, the worker stops this job at its next cycle

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError(411, "a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    def _base(self, request: Request, rid: str, chunk: bool) -> dict:
        kind = "text_completion"
        if request.kind == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": request.model or self.app.model_id}

    def _choice(self, request: Request, text: str | None, finish: str | None, chunk: bool, first=False,
                calls: list | None = None, logprobs: Logprobs | None = None) -> dict:
        choice = self._choice_body(request, text, finish, chunk, first, calls)
        if logprobs is not None:
            choice["logprobs"] = logprobs.take()
        return choice

    def _choice_body(self, request: Request, text: str | None, finish: str | None, chunk: bool, first=False,
                     calls: list | None = None) -> dict:
        if request.kind == "text":
            return {"index": 0, "text": text or "", "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            return {"index": 0, "delta": delta, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        if request.tools is not None:  # as mlx_lm.server: no text is null content, calls under tool_calls
            message["content"] = text or None
            if calls:
                message["tool_calls"] = calls
        return {"index": 0, "message": message, "finish_reason": finish}

    @staticmethod
    def _tool_calls(request: Request, streaming: bool, tokenizer) -> ToolCalls | None:
        return ToolCalls(tokenizer, request.tools, streaming) if request.tools is not None else None

    @staticmethod
    def _finish(finish: str | None, tools: ToolCalls | None) -> str | None:
        """finish_reason "tool_calls" for a generation that stopped (EOS or a stop string) after a call."""
        return "tool_calls" if finish == "stop" and tools is not None and tools.made else finish

    def _run(self, request: Request, job: Job, on_text, logprobs: Logprobs | None = None):
        """Relay the job's text to `on_text` (cut at stop strings), its tokens' logprobs to `logprobs`; returns
        (finish reason, records, cached)."""
        stops, records, finish = StopText(request.stop), [], None
        for event in self._events(job):
            if event[0] == "error":
                e = event[1]
                raise ApiError(400 if isinstance(e, ValueError) else 500, f"generation failed: {e}",
                               kind="invalid_request_error" if isinstance(e, ValueError) else "server_error")
            if event[0] == "end":
                if event[1] == "timeout":
                    raise ApiError(504, f"the request ran past its timeout ({self.app.request_timeout:g} s) and "
                                   f"was stopped after {sum(len(r.tokens) for r in records)} tokens",
                                   kind="server_error", code="timeout")
                if event[1] == "cancelled" and finish is None:  # neither a stop string nor this client: shutdown
                    raise ApiError(503, "the server is shutting down", kind="server_error", code="shutdown")
                return finish, records, event[2]
            record: CycleResponse = event[1]
            if finish == "stop" and job.cancelled.is_set():
                continue  # generated past a stop string before the worker saw the cancel: not part of the answer
            records.append(record)
            if logprobs is not None:
                logprobs.add(record)
            text, stopped = stops.feed(record.text)
            if record.finish_reason and not stopped:
                text += stops.flush()
            on_text(text)
            if stopped:
                job.cancelled.set()
                finish = "stop"
            elif record.finish_reason:
                finish = record.finish_reason
        raise ClientGone  # not reached: _events ends with an "end" or "error" event

    def _usage_and_stats(self, records, cached: int, batch_size: int = 0) -> tuple[dict, dict]:
        completion = sum(len(r.tokens) for r in records)
        prompt = records[0].prompt_tokens if records else 0
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if not records:
            return usage, {"cached_tokens": cached}
        worker = self.app.worker
        result = summarize(records, worker.drafter, self.app.defaults.get("block_size"))
        stats = {"verify_mode": result.verify_mode, "tau": result.tau, "cycles": result.cycles,
                 "accepted": sum(result.accepted), "block_size": result.block_size,
                 "plain_tokens": result.plain_tokens, "draft_failures": result.draft_failures,
                 "cached_tokens": cached, "prompt_tps": result.prompt_tps, "generation_tps": result.generation_tps,
                 "batch_size": batch_size}
        return usage, stats

    def _logprobs(self, request: Request) -> Logprobs | None:
        return Logprobs(self.app.tokenizer, request.kind) if request.logprobs is not None else None

    def _complete(self, request: Request, job: Job) -> None:
        parts, calls = [], []
        tools = self._tool_calls(request, False, self.app.tokenizer)
        logprobs = self._logprobs(request)

        def on_text(text: str) -> None:
            if tools is not None:
                text, done = tools.feed(text)
                calls.extend(done)
            parts.append(text)

        finish, records, cached = self._run(request, job, on_text, logprobs)
        if tools is not None:
            text, done = tools.finish()
            parts.append(text)
            calls.extend(done)
        usage, stats = self._usage_and_stats(records, cached, job.batch_size)
        choice = self._choice(request, "".join(parts), self._finish(finish, tools), False, calls=calls,
                              logprobs=logprobs)
        body = {**self._base(request, f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid.uuid4()}", False),
                "choices": [choice], "usage": usage, "dflash": stats}
        headers = {"X-DFlash-Verify-Mode": stats.get("verify_mode"), "X-DFlash-Cycles": stats.get("cycles"),
                   "X-DFlash-Tau": "" if stats.get("tau") is None else f"{stats['tau']:.3f}"}
        self._send_json(200, body, headers)

    def _stream(self, request: Request, job: Job) -> None:
        rid = f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid.uuid4()}"
        started = False

        def send(body: dict) -> None:
            nonlocal started
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                started = True
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()

        first = [True]
        tools = self._tool_calls(request, True, self.app.tokenizer)
        logprobs = self._logprobs(request)

        def on_text(text: str) -> None:
            calls = []
            if tools is not None:
                text, calls = tools.feed(text)
            if text or calls or first[0]:
                send({**self._base(request, rid, True),
                      "choices": [self._choice(request, text, None, True, first[0], calls, logprobs)]})
                first[0] = False

        try:
            finish, records, cached = self._run(request, job, on_text, logprobs)
        except ApiError as e:
            if not started:
                raise
            send(e.body())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        usage, stats = self._usage_and_stats(records, cached, job.batch_size)
        text, calls = tools.finish() if tools is not None else (None, [])
        send({**self._base(request, rid, True),
              "choices": [self._choice(request, text, self._finish(finish, tools), True, first[0], calls,
                                       logprobs)],
              "dflash": stats})
        if request.include_usage:
            send({**self._base(request, rid, True), "choices": [], "usage": usage, "dflash": stats})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def make_server(app: App) -> ThreadingHTTPServer:
    """The HTTP server for `app`, bound to its settings' host and port (not yet serving: call serve_forever).
    Stop it with `shutdown()`, then `app.close()` (which ends every job), then `server_close()` (which joins
    the connection threads: none is left running Python, and freeing MLX arrays, while the interpreter exits)."""
    handler = type("DFlashHandler", (Handler,), {"app": app})
    server = ThreadingHTTPServer((app.settings.host, app.settings.port), handler)
    server.daemon_threads = False
    return server


# -- the command -------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and text completions, streaming or not)",
        description="Serve the target, speculatively with a DFlash drafter, over OpenAI's API: POST "
        "/v1/chat/completions and /v1/completions, GET /v1/models and /health. The generation flags are the "
        "defaults of requests that do not set them.",
    )
    common.add_model_args(p)
    common.add_sampling_args(p)
    d = ServeSettings()
    p.add_argument("--host", default=d.host, help="address to bind (anything but loopback exposes the model; "
                   "default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port, printed on stderr (default "
                   "%(default)s)")
    p.add_argument("--queue-size", type=int, default=d.queue_size,
                   help="requests waiting beyond the running one; more get 503 (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may take, queueing included; past it the generation is stopped "
                   "(default %(default)s)")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="longest prompt + max_tokens accepted (default: the model's max_position_embeddings)")
    p.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=d.prompt_cache,
                   help="reuse cached sequences (the slots of earlier requests) for the prefix a request shares with "
                   "one")
    p.add_argument("--prompt-cache-size", type=int, default=d.prompt_cache_size,
                   help="prompt-cache slots: distinct sequences kept, least recently used dropped first, as "
                   "mlx_lm.server's flag (default %(default)s)")
    p.add_argument("--prompt-cache-bytes", type=byte_size, default=d.prompt_cache_bytes,
                   help="the slots' byte budget, e.g. 4GB or 512MB, less what a running batch holds, as "
                   "mlx_lm.server's flag (default: no bound but --prompt-cache-size)")
    p.add_argument("--decode-concurrency", type=int, default=d.decode_concurrency,
                   help="most requests decoded together in one batch, as mlx_lm.server's flag; 1 serves one request "
                   "at a time, always speculatively (default %(default)s)")
    p.add_argument("--model-id", help="the name clients use in 'model' (default: --model, or the default target's)")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name clients may use in 'model', besides --model-id (repeatable or comma-separated, "
                   "as vLLM's); GET /v1/models lists them all, any other name gets a 404")
    common.add_sharding_args(p)
    p.set_defaults(run=run)


def byte_size(text: str) -> int:
    """A --prompt-cache-bytes value: bytes, or a number with M, MB, G or GB (mlx_lm.server's reading)."""
    try:
        return parse_size(text)
    except (KeyError, ArithmeticError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with M, MB, G or GB "
                                         "(e.g. 512MB, 4GB)") from None


def served_names(flags: list[str]) -> tuple[str, ...]:
    """The names of --served-model-name flags, each a name or a comma-separated list; empty names are refused."""
    names = tuple(name.strip() for flag in flags for name in flag.split(","))
    if any(not name for name in names):
        raise ValueError(f"--served-model-name takes names, separated by commas; got {flags!r}")
    return names


def build_server(args, loaded: tuple | None = None):
    """(App, HTTP server) for parsed `serve` arguments; the server is bound but not yet serving. `loaded`:
    (model, tokenizer, drafter) loaded already (rank 0's share of a sharded target)."""
    settings = ServeSettings(args.host, args.port, args.queue_size, args.request_timeout, args.context_length,
                             args.prompt_cache, args.prompt_cache_size, args.prompt_cache_bytes,
                             args.decode_concurrency)
    names = served_names(args.served_model_name)  # before the model loads: a bad flag fails at once
    model, tokenizer, drafter = loaded or common.load_pair(args)
    app = App(model, tokenizer, drafter, args.model_id or args.model or DEFAULT_TARGET_NAME,
              common.generation_kwargs(args), settings, names)
    try:
        return app, make_server(app)
    except BaseException:
        app.close()
        raise


class Terminated(BaseException):
    """SIGTERM: the server stops as on Ctrl-C, and the command ends with 0. A BaseException, as KeyboardInterrupt is:
    the signal may land while the server's own thread handles a connection, where socketserver reports an Exception
    and serves on."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated


def run(args) -> int:
    """Serve until SIGINT (exit 130) or SIGTERM (exit 0). A sharded target (--pipeline, --tensor-parallel, every
    process started by mlx.launch): rank 0 serves, the other ranks follow its forwards (they never bind the port)
    and end when it stops."""
    loaded = None
    if args.pipeline or args.tensor_parallel:
        served_names(args.served_model_name)  # before the model loads: a bad flag fails at once
        loaded = common.load_sharded(args)
        if not loaded[0].leader:
            # Ctrl-C reaches every process of the launch: rank 0 stops, then tells this one (SIGTERM ends it now)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            distributed.follow(loaded[0])
            return 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    app = server = None
    idle = True
    try:
        app, server = build_server(args, loaded)
        host, port = server.server_address[:2]
        mode = args.verify_mode if args.verify_mode == "off" else f"{args.verify_mode} with {args.draft_model}"
        also = f", also as {', '.join(app.model_names[1:])}" if len(app.model_names) > 1 else ""
        print(f"[dflash2] serving {app.model_id} ({mode}{also}) on http://{host}:{port}", file=sys.stderr, flush=True)
        if app.sharded:
            print(f"[dflash2] the target is sharded {app.sharded['mode']}-parallel over {app.sharded['processes']} "
                  "processes: requests run one at a time (no batched decoding, which would run the model in one "
                  "process)",
                  file=sys.stderr, flush=True)
        server.serve_forever()
    except Terminated:
        return 0
    finally:
        if app is not None:
            idle = app.close()
            server.server_close()
        if loaded is not None:
            _release(loaded[0], idle)
    return 0


def _release(target, idle: bool) -> None:
    """Rank 0 of a sharded target: tell the other ranks to stop following, once no generation runs (one still
    running holds the collectives: the others then end when this process does, their ring broken)."""
    if not idle:
        log.warning("a generation did not stop; the other processes end with this one")
        return
    try:
        distributed.stop(target)
    except RuntimeError as e:  # the others are gone already (the error that ends this process may say why)
        log.warning("could not tell the other processes to stop: %s", e)
