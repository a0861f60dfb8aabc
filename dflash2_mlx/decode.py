"""The decode loops. `dflash_steps` is the whole draft-verify cycle, `tree_steps` the same cycle verifying a
token tree (`tree.py`); `plain_steps` is the baseline.

Both yield a `Step` per decode step and never stop on their own: the caller (`generate.stream_generate`)
cuts at EOS and `max_tokens`. Passing `max_tokens` lets the last cycle shrink its block instead of
verifying drafts that could never be committed. `logits_processors` (mlx-lm's) process every row a token is
chosen from, verify rows included (`sampling.Processing`); without them the loops run exactly as before.

Every `Step` carries the log-probabilities its tokens were chosen from (`Step.logprobs`, the processed rows
log-softmaxed as mlx-lm's `generate_step` computes them): lazy MLX arrays, computed only if a caller reads
them, so they add no host read to the loops (one per plain step or cycle; adaptive cycles add one for the
drafts' confidences, `AdaptiveBlocks.verified_block`).
"""

from __future__ import annotations

import itertools
import time
from typing import Generator, Iterator, NamedTuple

import mlx.core as mx
import numpy as np

from .adaptive import AdaptiveBlocks, BlockPolicy, FixedBlocks
from .drafter import DFlashDraftModel
from .prompt_cache import PromptCache
from .sampling import (LogitsProcessor, Processing, Sampler, SamplingParams, accept, draft_acceptance, log_softmax,
                       processing, sample)
from .target import Capture, Target
from .tree import (V1_TOP_K, accept_tree, build_tree, check_cache, check_target, draft_log_probs, keep_path_first,
                   process_tree_rows, tree_attention)


# MLX's cached buffers are freed after the first token and then every CLEAR_EVERY tokens, as mlx-lm's loop does:
# buffers left by earlier work (another generation, a drafter pass) made our plain loop 5% slower than
# mlx-lm's in `dflash2 bench` (0.948x; 1.005x with this).
CLEAR_EVERY = 256


class Step(NamedTuple):
    tokens: list[int]  # committed by this step
    accepted: int | None = None  # drafts accepted; None for the prefill token and plain decoding
    draft_failed: bool = False  # the drafter gave non-finite logits: this cycle was a plain step
    block_size: int | None = None  # the cycle's block size; 1 for a plain step of a speculative generation
    # the step of an adaptive plain run whose token matched its shadow probe's last draft: the probe's P(drafts
    # 1..i accepted), i = 1.. (its drafts scored by the run's tokens, `sampling.draft_acceptance`)
    shadow: list[float] | None = None
    # [len(tokens), V]: row i the log-probabilities tokens[i] was chosen from (the processed target row,
    # log-softmaxed; mlx-lm's `logprobs`), lazy: nothing is computed unless a caller evaluates it
    logprobs: mx.array | None = None


def plain_steps(
    target: Target, prompt: mx.array, params: SamplingParams, prefill_step_size: int = 2048,
    prompt_cache: PromptCache | None = None, logits_processors: list[LogitsProcessor] | None = None,
    sampler: Sampler | None = None,
) -> Iterator[Step]:
    """One target forward per token; the next token is computed while the caller reads this one.
    `sampler`: a sampler callable used instead of `params` (mlx-lm's convention: it takes the row's
    log-probabilities [1, V] and returns the token [1]), exactly as mlx-lm's `generate_step` calls it."""
    state = prompt_cache if prompt_cache is not None else PromptCache()
    procs = processing(logits_processors, prompt)
    with state.filling():
        cache, _, _, rest = state.start(target, None, prompt)
        logits = target.prefill(rest, cache, prefill_step_size)
        (token, row), clear_at = _choose(logits, params, procs, sampler), 1
        for produced in itertools.count(1):
            logits = target(token.reshape(1), cache)
            next_token, next_row = _choose(logits[-1], params, procs, sampler)
            mx.async_eval(next_token)
            yield state.commit(Step([token.item()], logprobs=log_softmax(row)[None]), [])
            clear_at = _free_buffers(produced, clear_at)
            token, row = next_token, next_row


def dflash_steps(
    target: Target,
    drafter: DFlashDraftModel,
    prompt: mx.array,
    params: SamplingParams,
    blocks: BlockPolicy,
    max_tokens: int | None = None,
    prefill_step_size: int = 2048,
    walk: str = "greedy",
    prompt_cache: PromptCache | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
) -> Iterator[Step]:
    """`blocks` picks each cycle's block size: B >= 2 drafts B-1 tokens, B = 1 runs plain steps.
    `prompt_cache`: start from the prefix it shares with `prompt`, and leave this generation's caches in it."""
    state = prompt_cache if prompt_cache is not None else PromptCache()
    procs = processing(logits_processors, prompt)
    with target.capture() as tap, state.filling():
        cache, draft_cache, seen, rest = state.start(target, drafter, prompt)
        logits, context = tap.prefill(rest, cache, prefill_step_size)
        context = context if seen is None else mx.concatenate([seen, context])
        anchor, row = _choose(logits, params, procs)
        yield state.commit(Step([anchor.item()], logprobs=log_softmax(row)[None]), [context])
        produced, tic, clear_at = 1, time.perf_counter(), 1
        while True:
            clear_at = _free_buffers(produced, clear_at)
            B = blocks.next_block(None if max_tokens is None else max_tokens - produced + 1)
            if B == 1:  # plain steps until drafting pays again; the cycle then drafts from the run's last token
                anchor, context, produced, B, clear_at = yield from _plain_run(
                    tap, cache, drafter, draft_cache, state, blocks, params, procs, walk, max_tokens,
                    anchor, context, produced, clear_at)
                B = B if max_tokens is None else max(2, min(B, max_tokens - produced + 1))
                tic = time.perf_counter()
            # Draft: one drafter pass over [anchor, mask * ...] (a block of `blocks.drafted_block(B)`), B-1 drafts kept:
            # adaptive mode picks B again from the rows' confidences (a host read), fixed blocks keep it.
            proposal = drafter.propose(drafter.input_block(anchor, blocks.drafted_block(B)), context[None], draft_cache,
                                       params, walk)
            B = blocks.verified_block(B, proposal.confidence, None if max_tokens is None else max_tokens - produced + 1)
            if B == 1:  # no draft worth verifying: a plain step from the anchor, whose token scores the first draft
                logits, context = tap.forward(anchor.reshape(1), cache)
                anchor, row = _choose(logits[-1], params, procs)
                first = draft_acceptance(proposal, anchor[None], row[None], params)[1, 0]
                mx.eval(anchor, first)
                produced += 1
                blocks.observe_unverified(first.item(), time.perf_counter() - tic)
                yield state.commit(Step([anchor.item()], block_size=1, logprobs=log_softmax(row)[None]), [context])
                tic = time.perf_counter()
                continue
            proposal = proposal.first(B - 1)
            # Verify: one target pass over [anchor, drafts], features captured on the way.
            verified = tap.verify(mx.concatenate([anchor.reshape(1), proposal.tokens]), cache)
            # Processors see each row's drafts before it, as plain decoding would have after accepting them.
            rows = verified.logits if procs is None else procs.rows(verified.logits, proposal.tokens)
            # Non-finite draft logits (e.g. an fp16 drafter overflowing) accept nothing: one plain-decoding token.
            accepted, bonus = accept(proposal, rows, params, "accept_greedy" in drafter.metal_kernels)
            # The cycle's device -> host transfer (adaptive mode's confidences aside).
            head = mx.stack([accepted, bonus.astype(accepted.dtype), proposal.finite.astype(accepted.dtype)])
            result = mx.concatenate([head, proposal.tokens.astype(accepted.dtype)]).tolist()
            a, bonus_id = result[0], result[1]
            if procs is not None:
                procs.commit(result[3 : 3 + a] + [bonus_id])
            tap.rollback(cache, verified, a + 1)
            context = verified.features[: a + 1]  # features of the anchor and the accepted drafts only
            anchor = mx.array(bonus_id, dtype=anchor.dtype)
            produced += a + 1
            blocks.observe_cycle(B, a, time.perf_counter() - tic)
            yield state.commit(Step(result[3 : 3 + a] + [bonus_id], a, not result[2], B,
                                    logprobs=log_softmax(rows[: a + 1])), [context])
            tic = time.perf_counter()


def _plain_run(tap: Capture, cache: list, drafter: DFlashDraftModel, draft_cache: list, state: PromptCache,
               blocks: AdaptiveBlocks, params: SamplingParams, procs: Processing | None, walk: str,
               max_tokens: int | None, anchor: mx.array, context: mx.array, produced: int,
               clear_at: int) -> Generator[Step, None, tuple[mx.array, mx.array, int, int, int]]:
    """Plain steps from `anchor` (a run chosen by adaptive mode), until `blocks` picks a block to draft again.

    Pipelined as `plain_steps` is, also from one run to the next: a step is always in flight. Each run starts
    with a shadow probe: the drafter's next block from the rows it has not taken in (which it keeps), scored by
    the tokens the run then commits: evidence at a drafter pass's cost, no verify. A probe proposes a whole
    block, the size the estimates describe, even where fewer of its drafts can be scored (a run cut short by
    max_tokens).

    Yields each plain step's `Step`, the last one the token the next cycle drafts from; returns (`yield from`)
    (that token, the features of the rows the drafter has yet to take in, the tokens produced, the block size
    picked, the token count at which to free buffers next).
    """
    pending = [context]  # features of fed rows the drafter has yet to take in; the last: in flight
    ahead = _plain_step(tap, cache, anchor, params, procs, pending)
    timed_from, timed, B = None, 0, 1
    while B == 1:
        run = blocks.plain_run(None if max_tokens is None else max_tokens - produced)
        shadow = drafter.propose(drafter.input_block(anchor, blocks.block_max),
                                 mx.concatenate(pending[:-1])[None], draft_cache, params, walk)
        mx.async_eval([a for a in shadow if a is not None])
        del pending[:-1]
        drawn, logits = [], []
        scored = min(run, shadow.tokens.shape[0])  # the run's tokens the probe's drafts are matched with
        for i in range(run):
            anchor, row = ahead
            drawn.append(anchor)
            logits.append(row)
            scoring = i == scored - 1  # every draft matched: the probe's score, read with this token
            if scoring:  # queued before the next step, so that reading it waits for this step only
                score = draft_acceptance(shadow, mx.stack(drawn), mx.stack(logits), params)
                mx.async_eval(score)
            ahead = _plain_step(tap, cache, anchor, params, procs, pending)  # before this one is read
            step = Step([anchor.item()], block_size=1, logprobs=log_softmax(row)[None])
            if scoring:
                chain, single = score.tolist()
                blocks.observe_shadow(chain, single, shadow.confidence.tolist())
                step = step._replace(shadow=chain)
            yield state.commit(step, pending)
            if timed_from is None:  # steady steps are timed from the first one read (it waited for a cycle)
                timed_from = time.perf_counter()
            else:
                timed += 1
            if scoring and i < run - 1 and blocks.drafting_wins(
                    None if max_tokens is None else max_tokens - produced - i):
                run = i + 1  # the probe says drafting pays now: the run ends here
                break
        produced += run
        if timed:  # the window holds this run's probe
            blocks.observe_plain(timed, time.perf_counter() - timed_from, probes=1)
        timed_from, timed = time.perf_counter(), 0
        clear_at = _free_buffers(produced, clear_at)
        B = blocks.next_block(None if max_tokens is None else max_tokens - produced + 1)
    # Drafting again: the step in flight commits its token first, and the cycle drafts from the next.
    anchor, row = ahead
    yield state.commit(Step([anchor.item()], block_size=1, logprobs=log_softmax(row)[None]), pending)
    return anchor, mx.concatenate(pending), produced + 1, B, clear_at


def tree_steps(
    target: Target,
    drafter: DFlashDraftModel,
    prompt: mx.array,
    params: SamplingParams,
    block_size: int,
    budget: int,
    max_tokens: int | None = None,
    prefill_step_size: int = 2048,
    prompt_cache: PromptCache | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
) -> Iterator[Step]:
    """`dflash_steps` with a tree: up to `budget` draft nodes, at most block_size - 1 deep. Two reads per
    cycle: the lattice (the tree is built on the host) and the target's choice at every node."""
    check_target(target)
    state = prompt_cache if prompt_cache is not None else PromptCache()
    procs = processing(logits_processors, prompt)
    with target.capture() as tap, state.filling():
        cache, draft_cache, seen, rest = state.start(target, drafter, prompt)
        check_cache(cache)
        logits, context = tap.prefill(rest, cache, prefill_step_size)
        context = context if seen is None else mx.concatenate([seen, context])
        anchor, row = _choose(logits, params, procs)
        anchor = anchor.item()
        yield state.commit(Step([anchor], logprobs=log_softmax(row)[None]), [context])
        produced, blocks, clear_at = 1, FixedBlocks(block_size), 1
        while True:
            clear_at = _free_buffers(produced, clear_at)
            B = blocks.next_block(None if max_tokens is None else max_tokens - produced + 1)
            # Draft: one drafter pass over [anchor, mask * (B-1)], its rows read as a lattice, then a tree.
            block = drafter.input_block(anchor, B)
            hidden, draft_logits = drafter.draft_rows(block, context[None], draft_cache)
            lattice = drafter.tree_lattice(hidden, draft_logits, block[0, 0], V1_TOP_K)
            finite = mx.all(mx.isfinite(draft_logits))
            logq = draft_log_probs(lattice)
            mx.eval(lattice.candidates, logq, finite)
            finite = finite.item()  # non-finite draft logits draft nothing: the cycle commits the target's token
            tree = build_tree(anchor, np.array(lattice.candidates), np.array(logq), budget if finite else 0)
            # Verify: one target pass over the tree, each node at its depth seeing its ancestors only.
            with tree_attention(target, cache, tree):
                verified = tap.verify(mx.array(tree.tokens), cache)
            rows = verified.logits if procs is None else process_tree_rows(tree, verified.logits, procs)
            path, anchor = accept_tree(tree, rows, params)
            if procs is not None:
                procs.commit([tree.tokens[i] for i in path[1:]] + [anchor])
            keep_path_first(cache, tree.size, path)
            tap.rollback(cache, verified, len(path))
            context = verified.features[mx.array(path)]
            produced += len(path)
            yield state.commit(Step([tree.tokens[i] for i in path[1:]] + [anchor], len(path) - 1, not finite, B,
                                    logprobs=log_softmax(rows[mx.array(path)])), [context])


def _free_buffers(produced: int, clear_at: int) -> int:
    """Free MLX's cached buffers once `produced` tokens reach `clear_at`; returns the next count to clear at."""
    if produced < clear_at:
        return clear_at
    mx.clear_cache()
    return produced + CLEAR_EVERY


def _choose(logits: mx.array, params: SamplingParams, procs: Processing | None,
            sampler: Sampler | None = None) -> tuple[mx.array, mx.array]:
    """(the next token, the row [V] it is drawn from) from `logits` [V], processed first if there are processors
    (the token then committed to them); drawn by `sampler` from the row's log-probabilities if one is given."""
    row = logits if procs is None else procs.row(logits)
    token = sample(row, params) if sampler is None else sampler(log_softmax(row)[None]).reshape(())
    if procs is not None:
        procs.commit(token)
    return token, row


def _plain_step(tap: Capture, cache: list, token: mx.array, params: SamplingParams, procs: Processing | None,
                keep_features: list) -> tuple[mx.array, mx.array]:
    """Feed `token` (a plain step inside a speculative generation) and schedule it: returns (the next token, the
    row it is drawn from: processed, with processors), both lazy, and appends the fed row's features to
    `keep_features` (for the drafter's next context)."""
    logits, features = tap.forward(token.reshape(1), cache)
    next_token, row = _choose(logits[-1], params, procs)
    keep_features.append(features)
    mx.async_eval(next_token, features)
    return next_token, row
