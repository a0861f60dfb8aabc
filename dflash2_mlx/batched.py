"""Speculation inside the batch: concurrent requests draft and verify together (`BatchedDecoder`).

Each step verifies one block per request in one target forward over the whole batch ([R, n], the blocks padded on
the right to the longest), accepts each request's drafts by the rule its own sampling settings make exact
(`sampling.accept`), and rolls each request's rows of the batch cache back to what it committed
(`roll_back_rows`). A request with block 1 takes a plain step in the same forward. The target's cache is mlx-lm's
left-padded `BatchKVCache`, as its `BatchGenerator` keeps it; rows join (prefilled alone, then merged) and leave
between steps. Which block each request verifies is the caller's (`step(blocks)`), or the measured batched cost
curve's choice by expected tokens per second over the batch (`batched_costs.plan`). docs/batched.md: the design.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .adaptive import AcceptanceEstimates
from .batched_costs import BatchedCostModel, batch_points, batched_cost_key, block_points, cycles_pay, grid, plan
from .costs import MEASURE_CONTEXT_TOKENS, cache_path, read_cache, write_cache
from .decode import Step
from .drafter import DFlashDraftModel
from .lookup import CopySpec, LookupConfig, leading_matches, one_hot_proposal
from .sampling import Proposal, SamplingParams, accept, log_softmax, sample
from .target import Target

logger = logging.getLogger(__name__)


def batch_refusal(target: Target) -> str | None:
    """Why a batched cycle cannot run on `target` (None: it can): every layer's cache must be a plain KV cache,
    whose rows a rollback can cut per request; sliding-window and recurrent layers are not rolled back per row."""
    kinds = {type(c).__name__ for c in make_prompt_cache(target.model)}
    if target.recurrent:
        return (
            f"the target ({target.model_type}) has recurrent layers, whose state cannot yet be rolled back per "
            "request inside a batch: concurrent requests decode by plain batched steps"
        )
    if kinds != {"KVCache"}:
        return (
            f"the target ({target.model_type}) keeps {', '.join(sorted(kinds - {'KVCache'}))} layers, which cannot "
            "yet be rolled back per request inside a batch: concurrent requests decode by plain batched steps"
        )
    return None


def roll_back_rows(cache: list[BatchKVCache], kept: list[int], fed: int) -> None:
    """Keep the first `kept[i]` of the `fed` rows batch row i just fed to `cache`, and forget the rest.

    The rows past the most kept are trimmed from every batch row; a row that keeps fewer is shifted right by the
    difference, its forgotten rows rolled into its left padding (mlx-lm's `BatchKVCache.finalize`, which moves a
    right-padded prompt the same way), so that every row's kept rows end where the next forward writes."""
    if len(kept) != cache[0].offset.size or not all(0 <= k <= fed for k in kept):
        raise ValueError(f"cannot keep {kept} rows of a {fed}-row forward over {cache[0].offset.size} requests")
    top = max(kept)
    shifts = [top - k for k in kept]
    for c in cache:
        if fed > top:
            c.trim(fed - top)
        if any(shifts):
            c.prepare(right_padding=shifts)
            c.finalize()


@dataclass
class _Request:
    """One request in the batch: what its next step starts from and what its drafts are judged by."""

    uid: int
    anchor: int  # the last committed token: the next block's first
    pending: list  # target features of committed rows its drafter has yet to take in
    params: SamplingParams
    drafter: DFlashDraftModel | None
    draft_cache: list | None
    spec: CopySpec | None
    estimates: AcceptanceEstimates
    max_tokens: int | None
    produced: int = 1
    accepted: int = 0  # drafts accepted over its batched cycles
    cycles: int = 0  # its batched cycles (steps in which it verified drafts)
    history: list = field(default_factory=list)  # prompt and committed tokens (for `extract`)


class BatchedDecoder:
    """Requests decoded together, each verifying its own block in one target forward per step.

    Use as a context manager (it holds the target's capture while open). `add` prefills a request alone and merges
    it into the batch; `step` runs one forward for every request and returns each one's `Step`; `remove` and
    `extract` take a request out between steps. Decoding never stops on its own: the caller cuts at EOS and
    max_tokens (a request's `max_tokens` only keeps its blocks within what it may still commit).

    Args:
        target: the target (`Target`, with the drafter's layer ids).
        drafter: the drafter of requests that name none (None: copy drafts and plain steps only).
        block_max: the largest block a request verifies.
        costs: the measured batched costs (`batched_costs.BatchedCostModel`): `step()` without blocks picks each
            request's block by expected tokens per second over the batch; None: every request verifies
            `block_max` (or what its lookup proposes) at every step.
    """

    def __init__(
        self,
        target: Target,
        drafter: DFlashDraftModel | None,
        block_max: int,
        costs: BatchedCostModel | None = None,
    ):
        reason = batch_refusal(target)
        if reason is not None:
            raise ValueError(reason)
        if block_max < 1:
            raise ValueError(f"block_max must be at least 1, got {block_max}")
        if costs is not None and costs.block_max < block_max:
            raise ValueError(f"the batched costs cover blocks up to {costs.block_max}, not {block_max}: measure again")
        self.target, self.drafter, self.block_max, self.costs = target, drafter, block_max, costs
        self.requests: list[_Request] = []
        self.cache: list[BatchKVCache] | None = None
        self.batched_cycles = 0  # steps that verified drafts for at least one request
        self.plain_steps = 0  # steps that verified none
        self.last_plan: tuple[float, float] | None = None  # (expected tokens/s of the step chosen, of a plain step)
        self._uids = 0
        self._stack = contextlib.ExitStack()
        self.tap = None

    def __enter__(self) -> BatchedDecoder:
        self.tap = self._stack.enter_context(self.target.capture())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self.tap = None

    def __len__(self) -> int:
        return len(self.requests)

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        drafter: DFlashDraftModel | None = None,
        copyspec: LookupConfig | None = None,
        prefill_step_size: int = 2048,
        cache: list[KVCache] | None = None,
    ) -> tuple[int, Step]:
        """Prefill `prompt` alone and merge it into the batch; returns (its uid, the step of its first token).

        Args:
            prompt: token ids.
            params: its sampling settings.
            max_tokens: the most tokens it commits (its blocks stay within them; None: no limit).
            drafter: its drafter (default: the decoder's; requests sharing one draft in one pass).
            copyspec: look its continuations up in its context (copy drafts, `lookup.py`); None: none.
            prefill_step_size: the prefill's chunk.
            cache: the target's cache of the prompt's first tokens (as many as its offset, fewer than the
                prompt's), e.g. a prompt-cache slot's; only the rest is prefilled, and its drafter's context is
                the rest's features alone (None: a fresh cache).
        """
        if self.tap is None:
            raise RuntimeError("open the decoder first: `with BatchedDecoder(...) as decoder:`")
        if not prompt:
            raise ValueError("the prompt is empty: nothing to condition the target on")
        drafter = drafter if drafter is not None else self.drafter
        covered = 0 if cache is None else cache[0].offset
        if cache is None:
            cache = [KVCache() for _ in make_prompt_cache(self.target.model)]
        elif not 0 <= covered < len(prompt) or any(type(c) is not KVCache or c.offset != covered for c in cache):
            raise ValueError(
                f"a cache given with a prompt of {len(prompt)} tokens must be KV caches of one length below it"
            )
        logits, features = self.tap.prefill(mx.array(prompt[covered:], mx.uint32), cache, prefill_step_size)
        token = sample(logits, params)
        mx.eval(token, features, [c.state for c in cache])
        anchor = token.item()
        merged = [BatchKVCache.merge([c]) for c in cache]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, other in zip(self.cache, merged):
                mine.extend(other)
        positions = max(self.block_max - 1, 1)
        prior = None if drafter is None else drafter.acceptance_prior
        spec = None if copyspec is None else CopySpec(copyspec, list(prompt), trees=False)
        if spec is not None:
            spec.commit([anchor])
        uid, self._uids = self._uids, self._uids + 1
        self.requests.append(
            _Request(
                uid,
                anchor,
                [features],
                params,
                drafter,
                None if drafter is None else drafter.make_cache(),
                spec,
                AcceptanceEstimates(positions, None if prior is None else list(prior)),
                max_tokens,
                history=[*prompt, anchor],
            )
        )
        return uid, Step([anchor], logprobs=log_softmax(logits)[None])

    def remove(self, uid: int) -> None:
        """Take request `uid` out of the batch (its rows forgotten)."""
        i = self._index(uid)
        del self.requests[i]
        if not self.requests:
            self.cache = None
            return
        keep = [j for j in range(len(self.requests) + 1) if j != i]
        for c in self.cache:
            c.filter(keep)

    def extract(self, uid: int) -> tuple[list[KVCache], list[int]]:
        """Request `uid`'s target cache (covering every committed token but the last) and its tokens (prompt and
        committed), then `remove` it: what a prompt-cache slot or a lone generation goes on from."""
        i = self._index(uid)
        caches, tokens = [c.extract(i) for c in self.cache], list(self.requests[i].history)
        self.remove(uid)
        return caches, tokens

    def stats(self, uid: int) -> dict:
        """Request `uid`'s batched cycles and drafts accepted so far."""
        r = self.requests[self._index(uid)]
        return {"cycles": r.cycles, "accepted": r.accepted}

    def _index(self, uid: int) -> int:
        for i, r in enumerate(self.requests):
            if r.uid == uid:
                return i
        raise KeyError(f"no request {uid} in the batch")

    def choose_blocks(self) -> dict[int, int]:
        """Each request's block for the next step: `block_max` for every request (no costs), else the measured
        batched curve's choice by expected tokens per second over the batch (`batched_costs.plan`), a request whose
        lookup proposes a continuation priced by its lookups' acceptance and no drafter pass."""
        lefts = [_left(r) for r in self.requests]
        if self.costs is None:
            return {r.uid: max(1, min(self.block_max, left)) for r, left in zip(self.requests, lefts)}
        acceptances, drafting, lookups = [], [], []
        for i, r in enumerate(self.requests):
            match = None if r.spec is None else r.spec.propose(min(self.block_max, lefts[i]) - 1)
            if match is not None and len(match.tokens):  # the step verifies the lookup's drafts (`_propose`)
                acceptances.append(r.spec.acceptance(match))
                lefts[i] = min(lefts[i], len(match.tokens) + 1)
            else:
                acceptances.append(r.estimates.estimates())
            drafting.append(match is not None or r.drafter is not None)
            lookups.append(match is not None)
        blocks, rate, plain = plan(self.costs, acceptances, lefts, drafting, self.block_max, lookups)
        self.last_plan = (rate, plain)
        return {r.uid: B for r, B in zip(self.requests, blocks)}

    def step(self, blocks: dict[int, int] | None = None) -> dict[int, Step]:
        """One target forward for every request: each verifies its block ([anchor, drafts]; 1: a plain step).

        Args:
            blocks: uid -> the block it verifies (default `choose_blocks()`); a request whose lookup proposes a
                continuation verifies that instead of its drafter's drafts (at most as many).

        Returns:
            uid -> the request's `Step` (its committed tokens, drafts accepted, block verified, their rows).
        """
        if not self.requests:
            raise RuntimeError("no request in the batch: add one first")
        blocks = self.choose_blocks() if blocks is None else blocks
        proposals, lookups = self._propose([max(1, min(blocks[r.uid], _left(r))) for r in self.requests])
        n = 1 + max(0 if p is None else p.tokens.size for p in proposals)
        rows = []
        for r, p in zip(self.requests, proposals):
            drafts = [] if p is None else [p.tokens.astype(mx.uint32)]
            pad = n - 1 - (0 if p is None else p.tokens.size)
            rows.append(mx.concatenate([mx.array([r.anchor], mx.uint32), *drafts, mx.zeros((pad,), mx.uint32)]))
        logits = self.target.model(mx.stack(rows), cache=self.cache)
        features = self.tap._features()
        heads = []
        for i, (r, p) in enumerate(zip(self.requests, proposals)):
            if p is None:
                heads.append(mx.stack([mx.array(0), sample(logits[i, 0], r.params).astype(mx.int32), mx.array(1)]))
            else:
                a, bonus = accept(p, logits[i, : p.tokens.size + 1], r.params)
                heads.append(mx.stack([a.astype(mx.int32), bonus.astype(mx.int32), p.finite.astype(mx.int32)]))
        drafts = [[] if p is None else p.tokens.astype(mx.int32) for p in proposals]
        read = mx.concatenate([mx.concatenate([h, *([d] if len(d) else [])]) for h, d in zip(heads, drafts)])
        values = read.tolist()  # the step's one device -> host transfer
        steps, kept, at = {}, [], 0
        for i, (r, p, match) in enumerate(zip(self.requests, proposals, lookups)):
            d = 0 if p is None else p.tokens.size
            a, bonus, finite = values[at : at + 3]
            mine, at = values[at + 3 : at + 3 + d], at + 3 + d
            tokens = mine[:a] + [bonus]
            kept.append(a + 1)
            r.pending.append(features[i, : a + 1])
            r.anchor, r.produced = bonus, r.produced + a + 1
            r.history += tokens
            if p is not None:
                r.cycles, r.accepted = r.cycles + 1, r.accepted + a
                if match is None:
                    r.estimates.observe_block(leading_matches(mine, tokens[:-1]), d)
            if r.spec is not None:
                r.spec.observe(match, tokens, None)
                r.spec.commit(tokens)
            branch = None if p is None else "lookup" if match is not None else None
            steps[r.uid] = Step(
                tokens,
                None if p is None else a,
                not finite,
                d + 1,
                logprobs=log_softmax(logits[i, : a + 1]),
                branch=branch,
            )
        roll_back_rows(self.cache, kept, n)
        if n > 1:
            self.batched_cycles += 1
        else:
            self.plain_steps += 1
        return steps

    def _propose(self, blocks: list[int]) -> tuple[list[Proposal | None], list]:
        """Each request's drafts for its block (None for a plain step) and the lookup match they came from: its
        lookup's continuation where it proposes one (at most B - 1 tokens), else its drafter's, the requests
        sharing a drafter and a block drafted in one pass (which takes in each one's pending context)."""
        proposals, lookups, passes = [None] * len(blocks), [None] * len(blocks), {}
        for i, (r, B) in enumerate(zip(self.requests, blocks)):
            if B < 2:
                continue
            match = None if r.spec is None else r.spec.propose(B - 1)
            if match is not None:
                proposals[i], lookups[i] = one_hot_proposal(match.tokens), match
            elif r.drafter is not None:
                passes.setdefault((id(r.drafter), B), []).append(i)
        for (_, B), picked in passes.items():
            requests = [self.requests[i] for i in picked]
            contexts = [mx.concatenate(r.pending)[None] for r in requests]
            for r in requests:
                r.pending = []
            drafter = requests[0].drafter
            block = mx.concatenate([drafter.input_block(mx.array(r.anchor, mx.uint32), B) for r in requests])
            if len(requests) == 1:
                drafted = [drafter.propose(block, contexts[0], requests[0].draft_cache, requests[0].params)]
            else:
                caches, params = [r.draft_cache for r in requests], [r.params for r in requests]
                drafted = drafter.propose_batch(block, contexts, caches, params)
            for i, proposal in zip(picked, drafted):
                proposals[i] = proposal
        return proposals, lookups


def _left(r: _Request) -> int:
    """The largest block request r may verify (its max_tokens counted; a large number without one)."""
    return 1 << 30 if r.max_tokens is None else max(1, r.max_tokens - r.produced + 1)


def measure_batched_costs(
    target,
    drafter,
    block_max: int,
    batch_max: int = 8,
    context_tokens: int = MEASURE_CONTEXT_TOKENS,
    repeats: int = 3,
    points: tuple[list[int], list[int]] | None = None,
) -> BatchedCostModel:
    """Time the target's forward over n tokens for each of k requests, with its rollback, and the drafter's pass
    (for one request, and over k requests' blocks of `block_max` at once).

    Each timed forward starts from the same batch cache (k copies of one prefilled context); its rollback keeps
    n rows of every other request and one of the rest, so rows are shifted as in a real cycle.

    Args:
        target: the bound target (`Target`).
        drafter: the drafter.
        block_max: the largest block.
        batch_max: the largest batch timed.
        context_tokens: each request's context before the timed forwards.
        repeats: each point's time is the best of this many (after a warm-up round).
        points: the batch sizes and forward sizes timed (default `batch_points`, `block_points`); the rest of
            the grid is interpolated.
    """
    vocab = target.vocab_size
    tokens = mx.array([(7 + 31 * i) % vocab for i in range(context_tokens + block_max)], mx.uint32)
    single = [KVCache() for _ in make_prompt_cache(target.model)]
    ks, ns = points or (batch_points(batch_max), block_points(block_max))
    seconds = {}
    with target.capture() as tap:
        _, context = tap.prefill(tokens[:context_tokens], single)
        mx.eval(context, [c.state for c in single])

        def forward(k, n):
            cache = [BatchKVCache.merge([c] * k) for c in single]
            mx.eval([c.state for c in cache])
            fed = mx.broadcast_to(tokens[context_tokens : context_tokens + n][None], (k, n))
            tic = time.perf_counter()
            mx.eval(target.model(fed, cache=cache), tap._features())
            roll_back_rows(cache, [n if i % 2 == 0 else 1 for i in range(k)], n)
            mx.eval([c.state for c in cache])
            return time.perf_counter() - tic

        def draft(B, k=1):
            block = drafter.input_block(tokens[context_tokens], B)
            caches = [drafter.make_cache() for _ in range(k)]
            tic = time.perf_counter()
            if k == 1:
                mx.eval(drafter.propose(block, context[None], caches[0], SamplingParams()).tokens)
            else:
                blocks, contexts = mx.concatenate([block] * k), [context[None]] * k
                mx.eval([p.tokens for p in drafter.propose_batch(blocks, contexts, caches, [SamplingParams()] * k)])
            return time.perf_counter() - tic

        draft_sizes = sorted({2, max(block_max, 2)})
        for round_ in range(repeats + 1):  # round 0 warms up; every point once per round (docs/adaptive.md)
            for k, n in itertools.product(ks, ns):
                s = forward(k, n)
                seconds[k, n] = s if round_ <= 1 else min(seconds[k, n], s)
            for B in draft_sizes:
                s = draft(B)
                seconds["draft", B] = s if round_ <= 1 else min(seconds["draft", B], s)
            for k in ks:
                s = draft(max(block_max, 2), k)
                seconds["drafts", k] = s if round_ <= 1 else min(seconds["drafts", k], s)
    drafts = list(itertools.accumulate((seconds["draft", B] for B in draft_sizes), max))
    draft_s = [float(s) for s in np.interp(np.arange(2, max(block_max, 2) + 1), draft_sizes, drafts)]
    one = seconds["drafts", 1]
    together = list(itertools.accumulate((max(1.0, seconds["drafts", k] / one) for k in ks), max))
    draft_batch = [float(x) for x in np.interp(np.arange(1, batch_max + 1), ks, together)]
    return BatchedCostModel(grid(ks, ns, seconds, batch_max, block_max), draft_s, draft_batch)


def could_pay(costs: BatchedCostModel, block_max: int) -> bool:
    """Whether a batched cycle would beat a plain batched step for some batch of 2 or more if every draft were
    accepted. Where it would not, no drafter pays there, and a coarse curve is all the choice needs."""
    return cycles_pay(costs, [1.0] * max(block_max - 1, 1), block_max, costs.batch_max)


def load_or_measure_batched_costs(target, drafter, block_max: int, batch_max: int = 8) -> BatchedCostModel:
    """The cached batched cost model of this target, drafter and machine, measured and cached if missing (in the
    file the single-request costs are kept in: $DFLASH2_COSTS, else the package's cache folder). A coarse pass
    comes first (batches of 1, 2 and `batch_max`; forwards of 1, 2 and `block_max` tokens; one timed round): where
    not even drafts that are all accepted would pay (`could_pay`), as on a CPU whose forward grows with its tokens,
    that curve is kept; elsewhere the whole grid is timed."""
    key, path = batched_cost_key(target, drafter, block_max, batch_max), cache_path()
    known = read_cache(path)
    if key in known:
        return BatchedCostModel(**known[key])
    logger.info("measuring this machine's batched step costs for %s (once; cached in %s)", target.model_type, path)
    coarse = ([1, 2, batch_max] if batch_max > 2 else [1, 2], sorted({1, 2, block_max}))
    costs = measure_batched_costs(target, drafter, block_max, batch_max, repeats=1, points=coarse)
    if could_pay(costs, block_max):
        costs = measure_batched_costs(target, drafter, block_max, batch_max)
    write_cache(path, {**known, key: asdict(costs)})
    return costs
