"""The decode loops. `dflash_steps` is the whole draft-verify cycle; `plain_steps` is the baseline.

Both yield (committed tokens, accepted draft count) per step and never stop on their own: the caller
(`generate.stream_generate`) cuts at EOS and `max_tokens`. Passing `max_tokens` lets the last cycle
shrink its block instead of drafting tokens that could never be committed.
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx

from .drafter import DFlashDraftModel
from .sampling import SamplingParams, accept_greedy, accept_sampled, probabilities, sample
from .target import Target

Step = tuple[list[int], int | None]


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
        yield [token.item()], None
        token = next_token


def dflash_steps(
    target: Target,
    drafter: DFlashDraftModel,
    prompt: mx.array,
    params: SamplingParams,
    block_size: int,
    max_tokens: int | None = None,
    prefill_step_size: int = 2048,
) -> Iterator[Step]:
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    mask_id = drafter.config.mask_token_id
    with target.capturing():
        logits, context = target.prefill(prompt, cache, prefill_step_size)
        anchor = sample(logits, params)
        yield [anchor.item()], None
        produced = 1
        while True:
            B = block_size if max_tokens is None else max(2, min(block_size, max_tokens - produced + 1))
            # Draft: one drafter pass proposes B-1 tokens from [anchor, mask * (B-1)].
            block = mx.concatenate([anchor.reshape(1), mx.full((B - 1,), mask_id, anchor.dtype)])
            draft_logits = drafter(block[None], context[None], draft_cache)[0]
            if params.greedy:
                drafts, draft_probs = mx.argmax(draft_logits, axis=-1), None
            else:
                draft_probs = probabilities(draft_logits, params)
                drafts = mx.random.categorical(mx.log(draft_probs))
            # Verify: one target pass over [anchor, drafts], features captured on the way.
            verify_logits, features = target(mx.concatenate([anchor.reshape(1), drafts]), cache)
            if params.greedy:
                accepted, bonus = accept_greedy(drafts, verify_logits)
            else:
                accepted, bonus = accept_sampled(drafts, draft_probs, verify_logits, params)
            # The only device -> host transfer of the cycle.
            result = mx.concatenate([accepted.reshape(1), bonus.reshape(1), drafts]).tolist()
            a, bonus_id = result[0], result[1]
            target.rollback(cache, B - 1 - a)
            context = features[: a + 1]  # features of the anchor and the accepted drafts only
            anchor = mx.array(bonus_id, dtype=anchor.dtype)
            produced += a + 1
            yield result[2 : 2 + a] + [bonus_id], a
