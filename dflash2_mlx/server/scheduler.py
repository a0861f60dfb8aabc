"""The server's scheduler: one worker thread owns the model and runs every generation (`Worker`).

A lone request decodes speculatively (`relayed_cycles`); concurrent ones together in mlx-lm's `BatchGenerator`,
each starting from the cached sequence sharing the longest prefix with it (`PromptCaches`). A job is cancelled,
at the next cycle or batch step, when its handler sets `Job.cancelled` (its client left, a stop string was met)
or its deadline passes; the generation is always closed, which releases the model's capture.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..generate import CycleResponse, stream_cycles
from ..prompt_cache import PromptCache, PromptCaches
from .protocol import GenerationArguments

log = logging.getLogger("dflash2.serve")

# the worker's running totals (`Worker.counts`), each with what it counts
COUNTS = {
    "requests_finished": "requests whose generation ended at EOS, max_tokens or a stop string",
    "requests_cancelled": "requests cancelled: the client left, or the server stopped",
    "requests_timeout": "requests stopped at --request-timeout",
    "requests_error": "requests whose generation failed",
    "prompt_tokens": "prompt tokens of the requests ended",
    "generation_tokens": "tokens generated",
    "cycles": "speculative cycles (each verifies one block of drafts)",
    "accepted_tokens": "draft tokens accepted by verification",
    "lookup_cycles": "cycles whose accepted drafts came from a lookup in the context (copy drafts, --copyspec-mode)",
    "lookup_tokens": "draft tokens accepted from lookups in the context (copy drafts; part of accepted_tokens)",
    "prompt_cache_hits": "requests that started from a cached prefix",
    "cached_tokens": "prompt tokens taken from the prompt cache instead of prefilled",
}

RESUME_MIN_TOKENS = 16  # a request left alone in the batch goes on speculatively if it has this many tokens to go
RESUME_GRACE_STEPS = 2  # ... once it has been alone, nothing queued, for this many batch steps: a client's next
# request (sent as its last answer ends) joins the batch then, sparing the request the move out and back


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
    return [
        (c, sorted(zip(i, v), key=lambda p: -p[1])) for c, i, v in zip(chosen.tolist(), top.tolist(), values.tolist())
    ]


def relayed_cycles(
    model, tokenizer, prompt, drafter=None, *, generation: GenerationArguments, prompt_cache: PromptCache | None = None
):
    """The worker's generation: `stream_cycles`' records as `Record`s.

    Args:
        model, tokenizer, prompt, drafter, prompt_cache: as `stream_cycles` takes them.
        generation: `stream_cycles`' other keyword arguments; its `logprobs` N (None: none) reads each token's
            log-probability and the N best of its row, one host read per cycle, only for requests that ask.
    """
    records = stream_cycles(model, tokenizer, prompt, drafter, prompt_cache=prompt_cache, **generation.cycle_kwargs())
    n = generation.logprobs
    try:
        for r in records:
            numbers = None
            if n is not None and r.logprobs is not None and r.tokens:
                numbers = token_logprobs(r.logprobs, r.tokens, n)
            yield Record(
                **{**{f.name: getattr(r, f.name) for f in fields(r)}, "logprobs": None}, token_logprobs=numbers
            )
    finally:
        records.close()


@dataclass
class Job:
    """One request's generation, from its handler to the worker and its events back.

    `generation` may be given as a mapping of `stream_cycles`' keyword arguments (and `logprobs`), which
    becomes `GenerationArguments`: a caller driving the worker without the HTTP front.
    """

    prompt: list[int]  # token ids (MLX arrays are made in the worker's thread, which evaluates them)
    generation: GenerationArguments
    deadline: float  # time.monotonic()
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0  # time.monotonic() when the worker took it
    batch_size: int = 0  # the most requests it was decoded together with (0: it ran alone)

    def __post_init__(self):
        if isinstance(self.generation, Mapping):
            self.generation = GenerationArguments.from_kwargs(self.generation)


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
    RESUME_MIN_TOKENS to go leaves it and goes on speculatively (prefilling what no prompt-cache slot with the
    drafter's context holds). Admission is first come first served: the queue's head is admitted while fewer
    than `decode_concurrency` decode; a head the batch cannot take (a seeded request, whose draws a shared batch
    cannot reproduce, or any request on a target whose caches cannot be batched) waits for the batch to drain,
    later requests behind it.

    Events a job gets: ("record", Record) ..., then ("end", reason, cached prompt tokens) with
    reason "finished", "cancelled" or "timeout", or ("error", exc).

    Args:
        model, tokenizer, drafter: what generates (`stream_cycles`' own; drafter None: plain decoding only).
        queue_size: jobs waiting beyond the running ones; `submit` refuses more.
        prompt_cache: whether to keep finished sequences (`PromptCaches`) for later requests' shared prefixes.
        prompt_cache_size: the most sequences kept.
        prompt_cache_bytes: their byte budget (None: the count alone bounds them).
        decode_concurrency: the most jobs decoded together (1: one at a time, always speculatively).
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter,
        queue_size: int,
        prompt_cache: bool,
        *,
        prompt_cache_size: int = 10,
        prompt_cache_bytes: int | None = None,
        decode_concurrency: int = 32,
    ):
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
        self.batched_tokens = 0  # tokens those steps committed
        self.batched_seconds = 0.0  # and the time they took
        self.durations: deque = deque(maxlen=16)  # seconds of recent jobs, for Retry-After
        self.counts = dict.fromkeys(COUNTS, 0)  # running totals since the start (`COUNTS`), for /metrics
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
        """Queue `job`; False when the queue is full or the worker stopped."""
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
            self.counts["requests_cancelled"] += 1
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
                    self.counts["requests_error"] += 1
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
            self.counts[f"requests_{reason}"] += 1
            job.events.put(("end", reason, 0))
            return False
        job.started = time.monotonic()
        self.active = [*self.active, job]
        return True

    def _send(self, job: Job, record: Record) -> None:
        """Relay a record to its job's handler, counting its tokens."""
        counts = self.counts
        counts["generation_tokens"] += len(record.tokens)
        if record.accepted is not None:
            counts["cycles"] += 1
            counts["accepted_tokens"] += record.accepted
            if record.branch == "lookup":
                counts["lookup_cycles"] += 1
                counts["lookup_tokens"] += record.accepted
        job.events.put(("record", record))

    def _end(self, job: Job, reason: str, cached: int) -> None:
        counts = self.counts
        counts[f"requests_{reason}"] += 1
        counts["prompt_tokens"] += len(job.prompt)
        counts["prompt_cache_hits"] += cached > 0
        counts["cached_tokens"] += cached
        job.events.put(("end", reason, cached))
        self.durations.append(time.monotonic() - job.started)
        self.active = [j for j in self.active if j is not job]

    def _cache_info(self) -> dict:
        caches = self.caches
        if caches is None:
            return {"slots": 0, "bytes": 0, "max_slots": 0, "max_bytes": 0}
        return {
            "slots": len(caches),
            "bytes": caches.nbytes,
            "max_slots": caches.max_size,
            "max_bytes": caches.max_bytes,
        }

    def _keep(self, slot: PromptCache) -> None:
        if self.caches is not None:
            self.caches.put(slot)
            self.cache_info = self._cache_info()

    def _can_batch(self, job: Job) -> bool:
        return self.batchable and job.generation.seed is None

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
        generation, prompt, done = job.generation, job.prompt, 0
        if resumed is not None:
            prompt, done = tokens, resumed.generated
            generation = replace(generation, max_tokens=generation.max_tokens - done)
        plain = (
            generation.verify_mode == "off"
            or self.drafter is None
            or generation.max_context is not None
            and len(prompt) >= generation.max_context
        )
        slot = (
            PromptCache()
            if self.caches is None
            else self.caches.take(self.model, None if plain else self.drafter, prompt)
        )
        records = relayed_cycles(
            self.model, self.tokenizer, prompt, self.drafter, prompt_cache=slot, generation=generation
        )
        reason, generated, handover = "finished", done, False
        try:
            for r in records:
                generated += len(r.tokens)
                self._send(job, r if resumed is None else self._continued(r, resumed, generated))
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
        gen = BatchGenerator(
            self.model,
            completion_batch_size=self.decode_concurrency,
            prefill_batch_size=min(8, self.decode_concurrency),
            prefill_step_size=handover[0].generation.prefill_step_size or 2048,
        )
        entries: dict[int, Batched] = {}
        alone = 0  # steps since the batch last held more than one request or had a request queued
        try:
            job, cache, covered, rest, generated, cached = handover
            self._insert(gen, entries, job, rest, cache, covered, generated, cached)
            while True:
                self._admit(
                    entries,
                    self._can_batch,
                    lambda job, cache, keep: self._insert(
                        gen, entries, job, job.prompt[keep:], cache, job.prompt[:keep], 0, keep
                    ),
                    lambda: gen.prompt_cache_nbytes,
                )
                if not entries:
                    return
                tic = time.perf_counter()
                _, responses = gen.next()
                uids = [r.uid for r in responses]
                self._count_step(entries, uids, len(uids), time.perf_counter() - tic)
                for r in responses:
                    e = entries[r.uid]
                    self._send(e.job, self._record(e, r.token, r.logprobs, r.finish_reason))
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
                    back = self._alone(
                        entries,
                        lambda e: (
                            self.drafter is not None and e.job.generation.verify_mode != "off" and bool(e.prompt_tps)
                        ),
                        lambda uid: gen.remove([uid], return_prompt_caches=True)[uid],
                    )
                    if back is not None:
                        return back
        finally:
            gen.close()

    def _count_step(self, entries: dict, uids: list[int], tokens: int, seconds: float) -> None:
        """Count a batch step that served the requests `uids`, committing `tokens` in `seconds`."""
        if len(uids) > 1:
            self.batched_steps += 1
            self.batched_tokens += tokens
            self.batched_seconds += seconds
            self.batch_size_max = max(self.batch_size_max, len(uids))
        self.batch_size = len(entries)
        for uid in uids:
            entries[uid].job.batch_size = max(entries[uid].job.batch_size, len(uids))

    def _alone(self, entries: dict, drafts: Callable, extract: Callable) -> tuple[Batched, list[int]] | None:
        """Take the batch's one request out of it, to go on speculatively, when that can pay: it drafts
        (`drafts(entry)`: a drafter, a first token generated) and has at least RESUME_MIN_TOKENS to go. Its batch
        cache (`extract(uid)`: its cache and tokens, out of the batch) is kept as a slot (the speculative
        generation prefills what no slot with the drafter's context holds)."""
        ((uid, e),) = entries.items()
        if not drafts(e) or e.job.generation.max_tokens - e.generated < RESUME_MIN_TOKENS:
            return None
        cache, tokens = extract(uid)
        del entries[uid]
        tokens = list(tokens)
        self._keep(PromptCache.of_target(self.model, tokens, cache))
        if tokens[: len(e.job.prompt)] != e.job.prompt or len(tokens) != len(e.job.prompt) + e.generated:
            raise RuntimeError(
                f"a batched sequence holds {len(tokens)} tokens, not its prompt and its {e.generated} generated tokens"
            )
        self.batch_size = 0
        return e, tokens

    def _admit(self, entries: dict, can_join: Callable, join: Callable, held_bytes: Callable) -> None:
        """Admit queued jobs, first come first served, while the batch has room and the head can join it.

        Args:
            entries: the batch's requests.
            can_join: whether a job can join the batch.
            join: puts a job in the batch (job, its prompt-cache slot's cache or None, the tokens it covers).
            held_bytes: the bytes the batch's caches hold (the prompt-cache budget covers them too).
        """
        while len(entries) < self.decode_concurrency:
            head = self._head()
            if head is None or not can_join(head):
                return
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:  # `stop` emptied it
                return
            if not self._start(job):
                continue
            cache, keep = (None, 0) if self.caches is None else self.caches.borrow(self.model, job.prompt)
            self.cache_info = self._cache_info()
            join(job, cache, keep)
            if self.caches is not None and self.caches.max_bytes is not None:  # the budget covers the batch's too
                self.caches.trim_to(self.caches.max_bytes - held_bytes())
                self.cache_info = self._cache_info()

    def _insert(
        self, gen, entries: dict, job: Job, rest: list[int], cache, covered: list[int], generated: int, cached: int
    ) -> None:
        """Put `job` in the batch: `rest` still to run over `cache` (None: a fresh one), which covers `covered`;
        `generated` tokens of it were generated (and sent) before."""
        g = job.generation
        sampler = (
            g.sampler
            if g.sampler is not None
            else None
            if not g.temp
            else make_sampler(g.temp, g.top_p, g.min_p, top_k=g.top_k)
        )
        eos = self.tokenizer.eos_token_ids if g.eos_token_ids is None else g.eos_token_ids
        (uid,) = gen.insert(
            [rest],
            max_tokens=[g.max_tokens - generated],
            caches=[cache],
            all_tokens=[covered],
            samplers=[sampler],
            logits_processors=[list(g.logits_processors or [])],
            stop_sequences=[StopSequences([[t] for t in eos])],
        )
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        for t in (covered + rest)[len(job.prompt) :]:  # the text sent already
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
        n = e.job.generation.logprobs
        return Record(
            text=e.detokenizer.last_segment,
            tokens=[token],
            accepted=None,
            prompt_tokens=len(e.job.prompt),
            prompt_tps=e.prompt_tps,
            generation_tokens=e.generated,
            generation_tps=e.generated / max(now - e.tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            verify_mode="off",
            token_logprobs=None if n is None else token_logprobs(logprobs[None], [token], n),
        )
