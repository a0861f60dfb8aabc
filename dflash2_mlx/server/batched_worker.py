"""Speculation inside the server's batch: concurrent requests draft and verify together (`BatchedWorker`).

The worker of `scheduler.py`, with one more way to decode a batch: `batched.BatchedDecoder`, in which every request
verifies its own block (its drafter's drafts or a copy draft) in one target forward per step, each step's blocks
chosen by the measured batched cost curve (`batched_costs.plan`). A batch runs there when that curve says a
batched cycle can pay (`cycles_pay`, at the drafter's prior acceptance) and its requests ask for nothing the
decoder cannot honour yet (logits processors, logprobs, a sampler of their own, a seed); otherwise in mlx-lm's
`BatchGenerator`, by plain steps, as before. docs/batched.md: the design.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from .. import batched_costs
from ..adaptive import AcceptanceEstimates
from ..batched import BatchedDecoder, batch_refusal, load_or_measure_batched_costs
from ..batched_costs import BatchedCostModel
from ..decode import Step
from ..generate import resolve_block_size
from ..loading import bind_drafter
from ..lookup import copyspec_config
from ..prompt_cache import PromptCache
from ..sampling import SamplingParams
from ..target import Target
from .protocol import GenerationArguments
from .scheduler import RESUME_GRACE_STEPS, Batched, Job, Record, Worker

BATCH_MAX = 8  # the largest batch the batched cost curve times (larger ones are scaled from it)
PAYS = "a batched cycle pays on this machine's measured curve: each step's blocks are chosen by it"
NOT_PAYING = "not paying on this machine's measured curve: concurrent requests decode by plain batched steps"
FORCED = "--batched-speculation on: each step's blocks are chosen by this machine's measured curve"
BATCHED_SPECULATION = ("auto", "on", "off")  # `ServeSettings.batched_speculation`


def cycles_pay(costs: BatchedCostModel, prior, block_max: int, concurrency: int) -> bool:
    """Whether a batched cycle beats a plain batched step for some batch of 2..`concurrency` requests, each
    drafting with the acceptance `prior` (the drafter card's; None: no counts) and far from its max_tokens."""
    estimates = AcceptanceEstimates(max(block_max - 1, 1), None if prior is None else list(prior)).estimates()
    return batched_costs.cycles_pay(costs, estimates, block_max, concurrency)


def batched_warm_start(
    model, drafter, defaults: GenerationArguments, concurrency: int, policy: str = "auto"
) -> tuple[BatchedCostModel | None, int, str]:
    """The batched cost curve the server's batches decide by, loaded from the cache or measured now, before the
    server accepts a request: (the curve, None where batched cycles never run; the largest block; why).

    Args:
        model: the target (a sharded one's `Target`: its batches never run, so nothing is measured).
        drafter: the drafter (None: nothing to draft).
        defaults: the server's generation arguments (its verify mode and block size).
        concurrency: the most requests decoded together.
        policy: "auto" (batches speculate where the curve says a batched cycle can pay), "on" (wherever they can:
            a setting that rules them out is an error) or "off" (never).

    Raises:
        ValueError: `policy` is "on" where batches cannot speculate (the reason said).
    """
    if policy == "off":
        return None, 0, "--batched-speculation off: concurrent requests decode by plain batched steps"
    reason = _no_batch(model, drafter, defaults, concurrency)
    if reason is not None and policy == "on":
        raise ValueError(f"--batched-speculation on cannot run here ({reason}); use auto or off")
    if reason is not None:
        return None, 0, reason
    target = bind_drafter(drafter, model)
    block = resolve_block_size(drafter, defaults.block_size, defaults.verify_mode)
    costs = load_or_measure_batched_costs(target, drafter, block, min(BATCH_MAX, concurrency))
    if policy == "on":
        return costs, block, FORCED
    if not cycles_pay(costs, drafter.acceptance_prior, block, concurrency):
        return None, block, NOT_PAYING
    return costs, block, PAYS


def _no_batch(model, drafter, defaults: GenerationArguments, concurrency: int) -> str | None:
    """Why the server's batches cannot speculate (None: they can)."""
    if drafter is None:
        return "no drafter: concurrent requests decode by plain batched steps"
    if defaults.verify_mode == "off":
        return "--verify-mode off: concurrent requests decode by plain batched steps"
    if concurrency < 2 or isinstance(model, Target):
        return "requests decode one at a time: no batch"
    return batch_refusal(bind_drafter(drafter, model))


@dataclass
class Drafting(Batched):
    """A job decoding in the speculative batch: `Batched`'s, and what its records say ran ("dflash": it drafts
    where the plan says it pays; "off": it asked for plain decoding, or its prompt passed --max-context)."""

    mode: str = "dflash"


class BatchedWorker(Worker):
    """`scheduler.Worker`, whose batches speculate where the measured batched curve says it pays.

    A batch starts in `batched.BatchedDecoder` when the curve pays and both the request handed over and the
    queue's head can be decoded there (`speculates`); a later head that cannot waits for that batch to drain, as
    a seeded one waits for mlx-lm's. Requests join (from the prompt cache's longest prefix), leave, are stopped
    and go back to the speculative path alone as in mlx-lm's batch.

    Args:
        model, tokenizer, drafter, queue_size, prompt_cache: as `Worker` takes them.
        costs: the batched cost curve (`batched_warm_start`; None: every batch is mlx-lm's).
        block_max: the largest block a batched request verifies.
        reason: what /health says of batched cycles (why they run, or why not).
        **kwargs: `Worker`'s other settings.
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter,
        queue_size: int,
        prompt_cache: bool,
        *,
        costs: BatchedCostModel | None = None,
        block_max: int = 0,
        reason: str = "",
        **kwargs,
    ):
        self.batched_costs, self.block_max, self.batched_reason = costs, block_max, reason
        self.target = None if costs is None else bind_drafter(drafter, model)
        self.batched_cycles = 0  # decoder steps that verified drafts for at least one request
        self.batched_accepted = 0  # drafts accepted in them
        super().__init__(model, tokenizer, drafter, queue_size, prompt_cache, **kwargs)

    def speculates(self, job: Job) -> bool:
        """Whether `job` can decode in a speculative batch: one the batch can take, asking for nothing the decoder
        does not do yet (logits processors, logprobs, a sampler of its own)."""
        g = job.generation
        return (
            self.target is not None
            and self._can_batch(job)
            and g.sampler is None
            and not g.logits_processors
            and g.logprobs is None
        )

    def _batch(self, handover):
        head = self._head()
        if not self.speculates(handover[0]) or head is not None and not self.speculates(head):
            return super()._batch(handover)
        entries: dict[int, Batched] = {}
        alone = 0
        with BatchedDecoder(self.target, None, self.block_max, self.batched_costs) as decoder:
            job, cache, covered, rest, generated, cached = handover
            self._join(decoder, entries, job, covered + rest, cache if covered else None, generated, cached)
            while True:
                self._admit(
                    entries,
                    self.speculates,
                    lambda job, cache, keep: self._join(decoder, entries, job, job.prompt, cache, 0, keep),
                    lambda: sum(c.nbytes for c in decoder.cache or ()),
                )
                if not entries:
                    return None
                cycles = decoder.batched_cycles
                tic = time.perf_counter()
                steps = decoder.step()
                committed = sum(len(step.tokens) for step in steps.values())
                self._count_step(entries, list(steps), committed, time.perf_counter() - tic)
                accepted = 0
                for uid, step in steps.items():
                    accepted += step.accepted or 0
                    self._relay(decoder, entries, uid, step)
                if decoder.batched_cycles > cycles:
                    self.batched_cycles += 1
                    self.batched_accepted += accepted
                for uid, e in list(entries.items()):
                    reason = self._stopped(e.job)
                    if reason is not None:
                        self._leave(decoder, entries, uid, reason)
                head = self._head()
                if len(entries) != 1 or head is not None and self.speculates(head):
                    alone = 0
                    continue
                alone += 1
                if alone > RESUME_GRACE_STEPS:
                    back = self._alone(entries, lambda e: e.mode != "off", decoder.extract)
                    if back is not None:
                        return back

    def _join(
        self, decoder: BatchedDecoder, entries: dict, job: Job, tokens: list[int], cache, generated: int, cached: int
    ) -> None:
        """Put `job` in the decoder: `tokens` (its prompt and the `generated` tokens sent before) over `cache`
        (None: a fresh one), and relay the token its prefill gives."""
        g = job.generation
        plain = g.verify_mode == "off" or g.max_context is not None and len(job.prompt) >= g.max_context
        tic = time.perf_counter()
        uid, first = decoder.add(
            tokens,
            SamplingParams(temperature=g.temp, top_p=g.top_p, top_k=g.top_k, min_p=g.min_p),
            max_tokens=g.max_tokens - generated,
            drafter=None if plain else self.drafter,
            copyspec=None if plain else copyspec_config(g.copyspec_mode),
            prefill_step_size=g.prefill_step_size or 2048,
            cache=cache,
        )
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        for t in tokens[len(job.prompt) :]:  # the text sent already
            detokenizer.add_token(t)
        _ = detokenizer.last_segment
        prefilled = len(tokens) - (0 if cache is None else cache[0].offset)
        now = time.perf_counter()
        e = Drafting(job, detokenizer, generated, cached, prefilled, now, prefilled / max(now - tic, 1e-9))
        e.mode = "off" if plain else "dflash"
        entries[uid] = e
        self._relay(decoder, entries, uid, first)

    def _relay(self, decoder: BatchedDecoder, entries: dict, uid: int, step: Step) -> None:
        """Send request `uid`'s step as a record (cut at EOS and max_tokens, as `stream_cycles` cuts a cycle);
        a request that ends leaves the batch."""
        e = entries[uid]
        g = e.job.generation
        eos = set(self.tokenizer.eos_token_ids if g.eos_token_ids is None else g.eos_token_ids)
        tokens = step.tokens[: g.max_tokens - e.generated]
        stop = next((j for j, t in enumerate(tokens) if t in eos), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        for t in tokens if stop is None else tokens[:-1]:
            e.detokenizer.add_token(t)
        e.generated += len(tokens)
        finish = "stop" if stop is not None else "length" if e.generated >= g.max_tokens else None
        if finish:
            e.detokenizer.finalize()
        now = time.perf_counter()
        record = Record(
            text=e.detokenizer.last_segment,
            tokens=tokens,
            accepted=step.accepted,
            prompt_tokens=len(e.job.prompt),
            prompt_tps=e.prompt_tps,
            generation_tokens=e.generated,
            generation_tps=e.generated / max(now - e.tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            verify_mode=e.mode,
            draft_failed=step.draft_failed,
            block_size=step.block_size if e.mode != "off" else None,
            branch=step.branch,
        )
        self._send(e.job, record)
        if finish:
            self._leave(decoder, entries, uid, "finished")

    def _leave(self, decoder: BatchedDecoder, entries: dict, uid: int, reason: str) -> None:
        """End request `uid` for `reason`, its sequence kept as a prompt-cache slot."""
        e = entries.pop(uid)
        cache, tokens = decoder.extract(uid)
        self._keep(PromptCache.of_target(self.model, tokens, cache))
        self._end(e.job, reason, e.cached)
