"""Prefix reuse: a generation that starts from a `PromptCache` gives what a fresh generation of the same prompt
gives (tokens, acceptances and the drafter's own proposals), for every way a next prompt can relate to the cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import make_dflash2_drafter, make_drafter, make_hybrid, make_target

from dflash2_mlx import PromptCache, PromptCaches, generate, stream_cycles


def recording(drafter):
    """Make `drafter` record its proposals (they depend on its context cache, so a wrong one shows)."""
    proposals, propose = [], drafter.propose

    def record(*args, **kwargs):
        p = propose(*args, **kwargs)
        proposals.append(p.tokens.tolist())
        return p

    drafter.propose = record
    return proposals


def run(model, tokenizer, prompt, drafter, proposals, cache=None, **kw):
    proposals.clear()
    kw = {"verify_mode": "dflash", "block_size": 4, "max_tokens": 18, "eos_token_ids": [], **kw}
    r = generate(model, tokenizer, prompt, drafter, prompt_cache=cache, **kw)
    return r.tokens, r.accepted, list(proposals)


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_sequence(model, tokenizer, drafter, trimmable: bool, **kw):
    """Five prompts through one cache: an extension of the conversation, an early divergence, a prefix of the
    last prompt, an unrelated prompt; each run must equal a fresh run of the same prompt."""
    rng = random.Random(0)

    def words(n):
        return [rng.randrange(6, 250) for _ in range(n)]

    proposals, cache = recording(drafter), PromptCache()
    p1 = words(9)
    first = run(model, tokenizer, p1, drafter, proposals, cache, **kw)
    assert cache.reused == 0
    assert first == run(model, tokenizer, p1, drafter, proposals, **kw)
    p2 = p1 + first[0] + words(4)  # the next chat turn: everything generated, then a new message
    p3 = p2[:5] + [p2[5] % 200 + 7] + words(6)  # differs from the sixth token on
    p4 = p3[:8]  # a prefix of what the cache holds: the cache must give back one row for the logits
    p5 = [p4[0] % 200 + 7] + words(7)
    previous = p1 + first[0]
    for prompt in (p2, p3, p4, p5):
        reused = run(model, tokenizer, prompt, drafter, proposals, cache, **kw)
        shared = min(common_prefix(prompt, previous), len(prompt) - 1)
        if prompt is p2:  # the cache covers the conversation, except perhaps the last token it committed
            assert len(p1) + len(first[0]) - 1 <= cache.reused <= shared
        elif prompt is p5:
            assert cache.reused == 0
        else:
            assert cache.reused == (shared if trimmable else 0), (prompt is p3, cache.reused, shared)
        fresh = run(model, tokenizer, prompt, drafter, proposals, **kw)
        assert reused == fresh, f"prompt {[p2, p3, p4, p5].index(prompt) + 2}"
        previous = prompt + reused[0]


@pytest.mark.parametrize("arch", ["qwen3", "llama_swa"])
@pytest.mark.parametrize("version", ["v1", "dflash2"])
def test_reuse_equals_fresh(arch, version, tokenizer):
    model = make_target(arch, seed=3)
    drafter = (make_dflash2_drafter if version == "dflash2" else make_drafter)(model, block_size=8, seed=5)
    # llama_swa's sliding window (8) wraps within these prompts: its cache is reused only where nothing is trimmed
    check_sequence(model, tokenizer, drafter, trimmable=arch == "qwen3")


@pytest.mark.slow
def test_reuse_equals_fresh_when_sampling(tokenizer):
    """T > 0 with a seed: the same draws in the same order, so the same tokens as a fresh run."""
    model = make_target("qwen3", seed=4)
    check_sequence(model, tokenizer, make_dflash2_drafter(model, block_size=8), True, temp=0.8, seed=11)


def test_hybrid_reuses_only_a_whole_cache(tokenizer):
    """GatedDeltaNet state cannot be trimmed: an extension reuses everything, a divergence starts fresh."""
    model = make_hybrid("qwen3_5", seed=2)
    check_sequence(model, tokenizer, make_dflash2_drafter(model, block_size=8), trimmable=False)


@pytest.mark.parametrize("mode", ["adaptive", "ddtree", "off"])
def test_other_modes_reuse_too(mode, tokenizer):
    """Tokens equal a fresh run's in every mode; in ddtree mode (deterministic, unlike adaptive mode's timed
    block sizes) so do the acceptances and the logits of every draft row the drafter computed."""
    model = make_target("qwen3", seed=6)
    drafter = make_dflash2_drafter(model, block_size=8)
    proposals, rows, draft_rows = recording(drafter), [], drafter.draft_rows

    def record_rows(*args):
        hidden, logits = draft_rows(*args)
        rows.append(np.array(logits))
        return hidden, logits

    drafter.draft_rows = record_rows
    cache, kw = PromptCache(), {"verify_mode": mode, "block_size": None}
    p1 = list(range(10, 30))
    first = run(model, tokenizer, p1, drafter, proposals, cache, **kw)
    p2 = p1 + first[0] + [40, 41, 42]
    rows.clear()
    reused, reused_rows = run(model, tokenizer, p2, drafter, proposals, cache, **kw), list(rows)
    assert cache.reused >= len(p1) + len(first[0]) - 1
    rows.clear()
    fresh = run(model, tokenizer, p2, drafter, proposals, **kw)
    assert reused[0] == fresh[0]
    if mode == "ddtree":
        assert reused[1] == fresh[1] and len(reused_rows) == len(rows) == len(fresh[1]) > 0
        assert all(a.shape == b.shape and np.allclose(a, b, atol=1e-4) for a, b in zip(reused_rows, rows))


def test_a_generation_closed_early_leaves_a_usable_cache(tokenizer):
    """A consumer that stops reading (a client gone) closes the generation between cycles."""
    model = make_target("qwen3", seed=7)
    drafter = make_dflash2_drafter(model, block_size=8)
    proposals, cache = recording(drafter), PromptCache()
    p1 = list(range(50, 62))
    records = stream_cycles(
        model,
        tokenizer,
        p1,
        drafter,
        prompt_cache=cache,
        verify_mode="dflash",
        block_size=4,
        max_tokens=40,
        eos_token_ids=[],
    )
    delivered = [t for _, r in zip(range(3), records) for t in r.tokens]
    records.close()
    p2 = p1 + delivered + [7, 8, 9]
    reused = run(model, tokenizer, p2, drafter, proposals, cache)
    assert cache.reused >= len(p1) + len(delivered) - 1
    assert reused == run(model, tokenizer, p2, drafter, proposals)


def test_a_failed_generation_drops_the_cache(tokenizer):
    model = make_target("qwen3", seed=8)
    drafter = make_dflash2_drafter(model, block_size=8)
    cache = PromptCache()
    generate(model, tokenizer, list(range(20, 30)), drafter, prompt_cache=cache, verify_mode="dflash", max_tokens=8)
    assert cache.tokens
    propose = drafter.propose

    def fail(*args, **kwargs):
        raise RuntimeError("drafter failed")

    drafter.propose = fail
    with pytest.raises(RuntimeError, match="drafter failed"):
        generate(model, tokenizer, list(range(20, 40)), drafter, prompt_cache=cache, verify_mode="dflash", max_tokens=8)
    drafter.propose = propose
    assert cache.tokens == [] and cache.target_cache is None
    generate(model, tokenizer, list(range(20, 40)), drafter, prompt_cache=cache, verify_mode="dflash", max_tokens=8)
    assert cache.reused == 0


def test_second_chat_turn_on_the_default_pair(smollm2):
    """SmolLM2 and its bundled DFlash 2 drafter: a second turn from the cache equals a fresh one, drafts and all."""
    from dflash2_mlx import load_drafter
    from dflash2_mlx.assets import default_drafter
    from dflash2_mlx.loading import bind_drafter

    model, tokenizer = smollm2
    drafter = load_drafter(str(default_drafter("dflash2")))
    bind_drafter(drafter, model)
    proposals, cache = recording(drafter), PromptCache()
    turn1 = [{"role": "user", "content": "Name three colours."}]
    ids1 = tokenizer.apply_chat_template(turn1, add_generation_prompt=True)
    first = generate(
        model, tokenizer, ids1, drafter, prompt_cache=cache, verify_mode="dflash", block_size=8, max_tokens=24
    )
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And three more?"}]
    ids2 = tokenizer.apply_chat_template(turn2, add_generation_prompt=True)
    reused = run(model, tokenizer, ids2, drafter, proposals, cache, block_size=8, max_tokens=24, eos_token_ids=None)
    assert cache.reused >= len(ids1) + len(first.tokens) - 2  # the reply as retokenized may differ at its end
    fresh = run(model, tokenizer, ids2, drafter, proposals, block_size=8, max_tokens=24, eos_token_ids=None)
    assert reused == fresh and sum(fresh[1]) > 0  # the drafter accepted something: its context mattered


def test_prompt_caches_keep_recent_slots_within_their_bounds(tokenizer):
    """Slots: three conversations through a pool of two keep the last two; a prompt extending a slot takes that
    slot itself, one sharing part of it a copy (the slot keeps its sequence); a byte budget drops the least
    recently used; every reuse gives what a fresh run gives."""
    model = make_target("qwen3", seed=9)
    drafter = make_dflash2_drafter(model, block_size=8)
    proposals, pool = recording(drafter), PromptCaches(max_size=2)
    prompts = [[20 + i] + list(range(30 + i, 40 + i)) for i in range(3)]
    firsts = []
    for p in prompts:
        slot = pool.take(model, drafter, p)
        assert slot.target_cache is None  # nothing shared: a new slot
        firsts.append(run(model, tokenizer, p, drafter, proposals, slot))
        pool.put(slot)
    held = sorted(s.tokens[0] for s in pool.slots.values())
    assert held == [21, 22] and len(pool) == 2  # the first conversation's slot went
    # the third conversation's next turn: its slot, whole
    turn = prompts[2] + firsts[2][0] + [7, 8]
    slot = pool.take(model, drafter, turn)
    assert slot.tokens[: len(prompts[2])] == prompts[2] and len(pool) == 1
    assert run(model, tokenizer, turn, drafter, proposals, slot) == run(model, tokenizer, turn, drafter, proposals)
    assert slot.reused >= len(prompts[2]) + len(firsts[2][0]) - 1
    pool.put(slot)
    # a prompt diverging inside the second conversation's prompt: a copy, the slot itself unchanged
    second = next(s for s in pool.slots.values() if s.tokens[0] == 21)
    before = list(second.tokens)
    branch = prompts[1][:6] + [9, 9, 9]
    slot = pool.take(model, drafter, branch)
    assert slot is not second and second in pool.slots.values()
    assert run(model, tokenizer, branch, drafter, proposals, slot) == run(model, tokenizer, branch, drafter, proposals)
    assert slot.reused == 6 and second.tokens == before
    # the branch back in: three slots over a budget of two; then a byte budget that holds the newest only
    pool.put(slot)
    assert len(pool) == 2 and slot in pool.slots.values() and second in pool.slots.values()
    sizes = {
        id(s): sum(a.nbytes for c in s.target_cache + s.draft_cache for a in (c.keys, c.values))
        + sum(p.nbytes for p in s.pending)
        for s in pool.slots.values()
    }
    pool.max_bytes = sizes[id(slot)]
    pool.put(slot)
    assert list(pool.slots.values()) == [slot] and pool.nbytes == sizes[id(slot)]


def test_prompt_caches_refuse_bad_bounds():
    with pytest.raises(ValueError, match="at least 1 slot"):
        PromptCaches(max_size=0)
    with pytest.raises(ValueError, match="byte budget must be >= 0"):
        PromptCaches(max_bytes=-1)
