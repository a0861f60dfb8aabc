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
from collections.abc import Generator, Iterator
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .adaptive import AdaptiveBlocks, BlockPolicy, FixedBlocks
from .drafter import DFlashDraftModel
from .lookup import CopySpec, LookupConfig, Match, branch_tree, graft, leading_matches, one_hot_proposal, verifies_trees
from .prompt_cache import PromptCache
from .sampling import (
    LogitsProcessor,
    Processing,
    Proposal,
    Sampler,
    SamplingParams,
    accept,
    draft_acceptance,
    log_softmax,
    processing,
    sample,
)
from .target import Capture, Target
from .tree import (
    V1_TOP_K,
    accept_tree,
    build_tree,
    check_cache,
    check_target,
    draft_log_probs,
    keep_path_first,
    process_tree_rows,
    tree_attention,
)

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
    # the branch its accepted drafts came from where the cycle verified a lookup (`lookup.py`): "lookup" or
    # "drafter"; None where it verified the drafter's path alone
    branch: str | None = None


def plain_steps(
    target: Target,
    prompt: mx.array,
    params: SamplingParams,
    prefill_step_size: int = 2048,
    prompt_cache: PromptCache | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
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
    copyspec: LookupConfig | None = None,
) -> Iterator[Step]:
    """`blocks` picks each cycle's block size: B >= 2 drafts B-1 tokens, B = 1 runs plain steps.
    `prompt_cache`: start from the prefix it shares with `prompt`, and leave this generation's caches in it.
    `copyspec`: look continuations up in the context (`lookup.py`); a cycle with one verifies it beside the
    drafter's path (one tree pass; one branch where the target cannot verify a tree), or alone where `blocks`
    runs no drafter."""
    state = prompt_cache if prompt_cache is not None else PromptCache()
    procs = processing(logits_processors, prompt)
    metal = "accept_greedy" in drafter.metal_kernels
    with target.capture() as tap, state.filling():
        cache, draft_cache, seen, rest = state.start(target, drafter, prompt)
        spec = None if copyspec is None else CopySpec(copyspec, prompt.tolist(), verifies_trees(target, cache))
        commit = _committer(state, spec)
        logits, context = tap.prefill(rest, cache, prefill_step_size)
        context = context if seen is None else mx.concatenate([seen, context])
        anchor, row = _choose(logits, params, procs)
        yield commit(Step([anchor.item()], logprobs=log_softmax(row)[None]), [context])
        produced, tic, clear_at = 1, time.perf_counter(), 1
        while True:
            clear_at = _free_buffers(produced, clear_at)
            B = blocks.next_block(_left(max_tokens, produced))
            match = _lookup(spec, blocks, _left(max_tokens, produced))
            if B == 1 and match is None:  # plain steps until drafting or a lookup pays; the cycle then starts
                anchor, context, produced, B, clear_at = yield from _plain_run(  # from the run's last token
                    tap,
                    cache,
                    drafter,
                    draft_cache,
                    commit,
                    spec,
                    blocks,
                    params,
                    procs,
                    walk,
                    max_tokens,
                    anchor,
                    context,
                    produced,
                    clear_at,
                )
                B = B if max_tokens is None or B == 1 else max(2, min(B, max_tokens - produced + 1))
                match, tic = _lookup(spec, blocks, _left(max_tokens, produced)), time.perf_counter()
                if B == 1 and match is None:  # the lookup that ended the run broke with the run's last token
                    continue
            if B == 1 or match is not None and not spec.trees and spec.lookup_wins(match):
                # The lookup alone, no drafter pass: the rows' features wait for the drafter's next pass.
                tokens, a, rows, features = _verify_lookup(tap, cache, anchor, match, spec, params, procs, metal)
                anchor, context, produced = (
                    mx.array(tokens[-1], anchor.dtype),
                    mx.concatenate([context, features]),
                    produced + a + 1,
                )
                yield commit(
                    Step(tokens, a, False, len(match.tokens) + 1, logprobs=log_softmax(rows), branch="lookup"),
                    [context],
                )
                tic = time.perf_counter()
                continue
            # Draft: one drafter pass over [anchor, mask * ...] (a block of `blocks.drafted_block(B)`), B-1 drafts kept:
            # adaptive mode picks B again from the rows' confidences (a host read), fixed blocks keep it.
            proposal = drafter.propose(
                drafter.input_block(anchor, blocks.drafted_block(B)), context[None], draft_cache, params, walk
            )
            B = blocks.verified_block(B, proposal.confidence, _left(max_tokens, produced))
            if (
                B == 1
            ):  # no draft worth verifying: the lookup alone, or a plain step; its first token scores the first draft
                if match is None:
                    logits, features = tap.forward(anchor.reshape(1), cache)
                    anchor, row = _choose(logits[-1], params, procs)
                    first = draft_acceptance(proposal, anchor[None], row[None], params)[1, 0]
                    mx.eval(anchor, first)
                    tokens, a, rows = [anchor.item()], 0, row[None]
                else:
                    tokens, a, rows, features = _verify_lookup(tap, cache, anchor, match, spec, params, procs, metal)
                    anchor = mx.array(tokens[-1], anchor.dtype)
                    first = draft_acceptance(proposal, mx.array(tokens[:1], anchor.dtype), rows[:1], params)[1, 0]
                produced += a + 1
                blocks.observe_unverified(first.item(), time.perf_counter() - tic)
                context = features  # the drafter's pass took the context before
                yield commit(
                    Step(
                        tokens,
                        None if match is None else a,
                        False,
                        1 if match is None else len(match.tokens) + 1,
                        logprobs=log_softmax(rows),
                        branch=None if match is None else "lookup",
                    ),
                    [context],
                )
                tic = time.perf_counter()
                continue
            proposal = proposal.first(B - 1)
            if match is None or not spec.trees:  # the drafter's path alone: one target pass over [anchor, drafts]
                tokens, a, finite, drafts, rows, context = _verify_line(
                    tap, cache, anchor, proposal, params, procs, metal
                )
                branch, match = None, None
            else:  # both branches in one tree pass, the shared prefix fed once; the longer accepted one is kept
                drafts = mx.concatenate([proposal.finite[None].astype(proposal.tokens.dtype), proposal.tokens]).tolist()
                finite, drafts = bool(drafts[0]), drafts[1:] if drafts[0] else []  # non-finite: the lookup alone
                tree = branch_tree(anchor.item(), drafts, match.tokens)
                path, tokens, rows, context = _verify_tree(target, tap, cache, tree, params, procs)
                a, branch = len(path) - 1, "lookup" if path[-1] > len(drafts) else "drafter"
            anchor = mx.array(tokens[-1], dtype=anchor.dtype)
            produced += a + 1
            blocks.observe_cycle(B, leading_matches(drafts, tokens[:-1]), time.perf_counter() - tic)
            if spec is not None:
                spec.observe(match, tokens, drafts)
            yield commit(Step(tokens, a, not finite, B, logprobs=log_softmax(rows), branch=branch), [context])
            tic = time.perf_counter()


def _plain_run(
    tap: Capture,
    cache: list,
    drafter: DFlashDraftModel,
    draft_cache: list,
    commit,
    spec: CopySpec | None,
    blocks: AdaptiveBlocks,
    params: SamplingParams,
    procs: Processing | None,
    walk: str,
    max_tokens: int | None,
    anchor: mx.array,
    context: mx.array,
    produced: int,
    clear_at: int,
) -> Generator[Step, None, tuple[mx.array, mx.array, int, int, int]]:
    """Plain steps from `anchor` (a run chosen by adaptive mode), until `blocks` picks a block to draft again or
    a lookup (`spec`) is worth verifying.

    Pipelined as `plain_steps` is, also from one run to the next: a step is always in flight. Each run starts
    with a shadow probe: the drafter's next block from the rows it has not taken in (which it keeps), scored by
    the tokens the run then commits: evidence at a drafter pass's cost, no verify. A probe proposes a whole
    block, the size the estimates describe, even where fewer of its drafts can be scored (a run cut short by
    max_tokens).

    Yields each plain step's `Step` (through `commit`), the last one the token the next cycle starts from; returns
    (`yield from`) (that token, the features of the rows the drafter has yet to take in, the tokens produced, the
    block size picked (1: a lookup ended the run), the token count at which to free buffers next).
    """
    pending = [context]  # features of fed rows the drafter has yet to take in; the last: in flight
    ahead = _plain_step(tap, cache, anchor, params, procs, pending)
    timed_from, timed, B, copying = None, 0, 1, False
    while B == 1 and not copying:
        run = blocks.plain_run(None if max_tokens is None else max_tokens - produced)
        shadow = drafter.propose(
            drafter.input_block(anchor, blocks.block_max), mx.concatenate(pending[:-1])[None], draft_cache, params, walk
        )
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
            yield commit(step, pending)
            if timed_from is None:  # steady steps are timed from the first one read (it waited for a cycle)
                timed_from = time.perf_counter()
            else:
                timed += 1
            copying = _lookup(spec, blocks, _left(max_tokens, produced + i + 1)) is not None
            if (
                copying
                or scoring
                and i < run - 1
                and blocks.drafting_wins(None if max_tokens is None else max_tokens - produced - i)
            ):
                run = i + 1  # a lookup is worth verifying, or the probe says drafting pays now: the run ends here
                break
        produced += run
        if timed:  # the window holds this run's probe
            blocks.observe_plain(timed, time.perf_counter() - timed_from, probes=1)
        timed_from, timed = time.perf_counter(), 0
        clear_at = _free_buffers(produced, clear_at)
        B = blocks.next_block(None if max_tokens is None else max_tokens - produced + 1)
    # Drafting again: the step in flight commits its token first, and the cycle drafts from the next.
    anchor, row = ahead
    yield commit(Step([anchor.item()], block_size=1, logprobs=log_softmax(row)[None]), pending)
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
    copyspec: LookupConfig | None = None,
) -> Iterator[Step]:
    """`dflash_steps` with a tree: up to `budget` draft nodes, at most block_size - 1 deep, and a lookup's
    continuation (`copyspec`) grafted on. Two reads per cycle: the lattice (the tree is built on the host) and the
    target's choice at every node."""
    check_target(target)
    state = prompt_cache if prompt_cache is not None else PromptCache()
    procs = processing(logits_processors, prompt)
    with target.capture() as tap, state.filling():
        cache, draft_cache, seen, rest = state.start(target, drafter, prompt)
        check_cache(cache)
        spec = None if copyspec is None else CopySpec(copyspec, prompt.tolist(), trees=True)
        commit = _committer(state, spec)
        logits, context = tap.prefill(rest, cache, prefill_step_size)
        context = context if seen is None else mx.concatenate([seen, context])
        anchor, row = _choose(logits, params, procs)
        anchor = anchor.item()
        yield commit(Step([anchor], logprobs=log_softmax(row)[None]), [context])
        produced, blocks, clear_at = 1, FixedBlocks(block_size), 1
        while True:
            clear_at = _free_buffers(produced, clear_at)
            B = blocks.next_block(_left(max_tokens, produced))
            # Draft: one drafter pass over [anchor, mask * (B-1)], its rows read as a lattice, then a tree.
            block = drafter.input_block(anchor, B)
            hidden, draft_logits = drafter.draft_rows(block, context[None], draft_cache)
            lattice = drafter.tree_lattice(hidden, draft_logits, block[0, 0], V1_TOP_K)
            finite = mx.all(mx.isfinite(draft_logits))
            logq = draft_log_probs(lattice)
            mx.eval(lattice.candidates, logq, finite)
            finite = finite.item()  # non-finite draft logits draft nothing: the cycle commits the target's token
            tree = build_tree(anchor, np.array(lattice.candidates), np.array(logq), budget if finite else 0)
            drafted, match = tree.size, _lookup(spec, blocks, _left(max_tokens, produced))
            if match is not None:
                tree, _ = graft(tree, match.tokens)
            # Verify: one target pass over the tree, each node at its depth seeing its ancestors only.
            path, tokens, rows, context = _verify_tree(target, tap, cache, tree, params, procs)
            if spec is not None:
                spec.observe(match, tokens, None)
            anchor = tokens[-1]
            produced += len(path)
            branch = None if match is None else "lookup" if max(path) >= drafted else "drafter"
            yield commit(
                Step(tokens, len(path) - 1, not finite, B, logprobs=log_softmax(rows), branch=branch), [context]
            )


def _committer(state: PromptCache, spec: CopySpec | None):
    """`state.commit`, the committed tokens indexed by `spec`'s lookup (and scoring the match it watches) first
    (where there is one)."""
    if spec is None:
        return state.commit

    def commit(step: Step, pending: list) -> Step:
        spec.commit(step.tokens)
        return state.commit(step, pending)

    return commit


def _left(max_tokens: int | None, produced: int) -> int | None:
    """The largest block a cycle may verify with `produced` of `max_tokens` committed (None: no limit)."""
    return None if max_tokens is None else max_tokens - produced + 1


def _lookup(spec: CopySpec | None, blocks: BlockPolicy, left: int | None) -> Match | None:
    """The lookup a cycle verifies, with at most `left` - 1 drafts (its bonus the last token), as many as `blocks`
    finds worth verifying; None where there is no lookup, no match, or none is worth it (the match is then watched:
    the tokens committed next score it, `CopySpec.watch`)."""
    if spec is None or left is not None and left < 2:
        return None
    match = spec.propose(None if left is None else left - 1)
    if match is None:
        return None
    n = blocks.lookup_drafts(spec.acceptance(match), len(match.tokens))
    if not n:
        spec.watch(match)
        return None
    return match._replace(tokens=match.tokens[:n])


def _verify_line(
    tap: Capture,
    cache: list,
    anchor: mx.array,
    proposal: Proposal,
    params: SamplingParams,
    procs: Processing | None,
    metal: bool,
):
    """One target pass over [anchor, drafts], accepted by `sampling.accept`; the cache keeps the committed rows.

    Returns:
        (the committed tokens, the drafts accepted, whether the drafts were finite, the drafts, the rows the
        tokens were chosen from [a+1, V], the features of the anchor and the accepted drafts).
    """
    verified = tap.verify(mx.concatenate([anchor.reshape(1), proposal.tokens.astype(anchor.dtype)]), cache)
    # Processors see each row's drafts before it, as plain decoding would have after accepting them.
    rows = verified.logits if procs is None else procs.rows(verified.logits, proposal.tokens)
    # Non-finite draft logits accept nothing: one plain-decoding token.
    accepted, bonus = accept(proposal, rows, params, metal)
    # The cycle's device -> host transfer (adaptive mode's confidences aside).
    head = mx.stack([accepted, bonus.astype(accepted.dtype), proposal.finite.astype(accepted.dtype)])
    result = mx.concatenate([head, proposal.tokens.astype(accepted.dtype)]).tolist()
    a, drafts = result[0], result[3:]
    tokens = drafts[:a] + [result[1]]
    if procs is not None:
        procs.commit(tokens)
    tap.rollback(cache, verified, a + 1)
    return tokens, a, bool(result[2]), drafts, rows[: a + 1], verified.features[: a + 1]


def _verify_lookup(
    tap: Capture,
    cache: list,
    anchor: mx.array,
    match: Match,
    spec: CopySpec,
    params: SamplingParams,
    procs: Processing | None,
    metal: bool,
):
    """A lookup's drafts alone, verified as a one-hot proposal and counted by `spec`: (the committed tokens, the
    drafts accepted, their rows, their features)."""
    tokens, a, _, _, rows, features = _verify_line(
        tap, cache, anchor, one_hot_proposal(match.tokens), params, procs, metal
    )
    spec.observe(match, tokens, None)
    return tokens, a, rows, features


def _verify_tree(target: Target, tap: Capture, cache: list, tree, params: SamplingParams, procs: Processing | None):
    """One target pass over a token tree, each node seeing its ancestors only, and its walk (`accept_tree`); the
    cache keeps the accepted path's rows. Returns (the path's node indices from the anchor, the committed tokens,
    the rows they were chosen from, the features of the path's rows)."""
    with tree_attention(target, cache, tree):
        verified = tap.verify(mx.array(tree.tokens), cache)
    rows = verified.logits if procs is None else process_tree_rows(tree, verified.logits, procs)
    path, bonus = accept_tree(tree, rows, params)
    tokens = [tree.tokens[i] for i in path[1:]] + [bonus]
    if procs is not None:
        procs.commit(tokens)
    keep_path_first(cache, tree.size, path)
    tap.rollback(cache, verified, len(path))
    kept = mx.array(path)
    return path, tokens, rows[kept], verified.features[kept]


def _free_buffers(produced: int, clear_at: int) -> int:
    """Free MLX's cached buffers once `produced` tokens reach `clear_at`; returns the next count to clear at."""
    if produced < clear_at:
        return clear_at
    mx.clear_cache()
    return produced + CLEAR_EVERY


def _choose(
    logits: mx.array, params: SamplingParams, procs: Processing | None, sampler: Sampler | None = None
) -> tuple[mx.array, mx.array]:
    """(the next token, the row [V] it is drawn from) from `logits` [V], processed first if there are processors
    (the token then committed to them); drawn by `sampler` from the row's log-probabilities if one is given."""
    row = logits if procs is None else procs.row(logits)
    token = sample(row, params) if sampler is None else sampler(log_softmax(row)[None]).reshape(())
    if procs is not None:
        procs.commit(token)
    return token, row


def _plain_step(
    tap: Capture, cache: list, token: mx.array, params: SamplingParams, procs: Processing | None, keep_features: list
) -> tuple[mx.array, mx.array]:
    """Feed `token` (a plain step inside a speculative generation) and schedule it: returns (the next token, the
    row it is drawn from: processed, with processors), both lazy, and appends the fed row's features to
    `keep_features` (for the drafter's next context)."""
    logits, features = tap.forward(token.reshape(1), cache)
    next_token, row = _choose(logits[-1], params, procs)
    keep_features.append(features)
    mx.async_eval(next_token, features)
    return next_token, row
