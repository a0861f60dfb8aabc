"""The decode loops. `dflash_steps` is the whole draft-verify cycle; `plain_steps` is the baseline.

Both yield a `Step` per decode step and never stop on their own: the caller (`generate.stream_generate`)
cuts at EOS and `max_tokens`. Passing `max_tokens` lets the last cycle shrink its block instead of
drafting tokens that could never be committed.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import mlx.core as mx

from .drafter import DFlashDraftModel
from .sampling import SamplingParams, accept, sample
from .target import Target


class Step(NamedTuple):
    tokens: list[int]  # committed by this step
    accepted: int | None = None  # drafts accepted; None for the prefill token and plain decoding
    draft_failed: bool = False  # the drafter gave non-finite logits: this cycle was a plain step


def plain_steps(
    target: Target, prompt: mx.array, params: SamplingParams, prefill_step_size: int = 2048
) -> Iterator[Step]:
    """One target forward per token; the next token is computed while the caller reads this one."""
    cache = target.make_cache()
    logits, _ = target.prefill(prompt, cache, prefill_step_size)
    token = sample(logits, params)
    while True:
        logits, _ = target(token.reshape(1), cache)
        next_token = sample(logits[-1], params)
        mx.async_eval(next_token)
        yield Step([token.item()])
        token = next_token


def dflash_steps(
    target: Target,
    drafter: DFlashDraftModel,
    prompt: mx.array,
    params: SamplingParams,
    block_size: int,
    max_tokens: int | None = None,
    prefill_step_size: int = 2048,
    walk: str = "greedy",
) -> Iterator[Step]:
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    mask_id = drafter.config.mask_token_id
    with target.capturing():
        logits, context = target.prefill(prompt, cache, prefill_step_size)
        anchor = sample(logits, params)
        yield Step([anchor.item()])
        produced = 1
        while True:
            B = block_size if max_tokens is None else max(2, min(block_size, max_tokens - produced + 1))
            # Draft: one drafter pass proposes B-1 tokens from [anchor, mask * (B-1)].
            block = mx.concatenate([anchor.reshape(1), mx.full((B - 1,), mask_id, anchor.dtype)])
            proposal = drafter.propose(block[None], context[None], draft_cache, params, walk)
            # Verify: one target pass over [anchor, drafts], features captured on the way.
            verify_logits, features = target(mx.concatenate([anchor.reshape(1), proposal.tokens]), cache, record=True)
            # Non-finite draft logits (e.g. an fp16 drafter overflowing) accept nothing: one plain-decoding token.
            accepted, bonus = accept(proposal, verify_logits, params)
            # The only device -> host transfer of the cycle.
            head = mx.stack([accepted, bonus.astype(accepted.dtype), proposal.finite.astype(accepted.dtype)])
            result = mx.concatenate([head, proposal.tokens.astype(accepted.dtype)]).tolist()
            a, bonus_id = result[0], result[1]
            target.rollback(cache, B - 1 - a)
            context = features[: a + 1]  # features of the anchor and the accepted drafts only
            anchor = mx.array(bonus_id, dtype=anchor.dtype)
            produced += a + 1
            yield Step(result[3 : 3 + a] + [bonus_id], a, not result[2])
