"""Greedy DFlash decoding is token-identical to plain decoding of the same target."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import ARCHS, make_drafter, make_oracle, make_target, prompts, run, slow_except

from dflash2_mlx import generate, stream_cycles
from dflash2_mlx.decode import plain_steps
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target

BLOCK_SIZES = list(range(2, 17))
# The random drafter's cycles all end at their first draft, whatever B: a few sizes cover that path (one
# cycle per token makes it most of the test's time); the oracle's varied acceptance runs at every size.
RANDOM_DRAFTER_BLOCK_SIZES = [2, 3, 4, 8, 13, 16]


def assert_cycles_just_cover(accepted: list[int], B: int, max_tokens: int) -> None:
    """Each cycle commits its accepted drafts (0..B-1) and one target token after the prefill's token: the
    cycles reach max_tokens, and all but the last fall short of it (no cycle runs past the end)."""
    assert all(0 <= a <= B - 1 for a in accepted), accepted
    committed = [1 + sum(a + 1 for a in accepted[:k]) for k in range(len(accepted) + 1)]
    assert committed[-1] >= max_tokens and (len(accepted) == 0 or committed[-2] < max_tokens), accepted


@pytest.mark.parametrize("arch", slow_except(ARCHS, "llama"))
def test_greedy_identical_to_plain(arch, tokenizer):
    """Every block size 2..16, each on one of three prompts (of different lengths and max_tokens) in turn, a
    spoiled oracle (acceptance lengths from 0 to B-1) and, at a few of the sizes, a random drafter (almost
    every draft rejected)."""
    model = make_target(arch, seed=ARCHS.index(arch))
    random_drafter = make_drafter(model, block_size=16, seed=7)
    lengths_seen, random_accepted = set(), []
    for i, prompt in enumerate(prompts(3, seed=ARCHS.index(arch))):
        max_tokens = 20 + 7 * i
        plain, _, _ = run(model, tokenizer, prompt, max_tokens=max_tokens, eos_token_ids=[])
        assert len(plain) == max_tokens
        for B in BLOCK_SIZES[i::3]:
            if B in RANDOM_DRAFTER_BLOCK_SIZES:
                spec, accepted, _ = run(
                    model, tokenizer, prompt, random_drafter, block_size=B, max_tokens=max_tokens, eos_token_ids=[]
                )
                assert spec == plain, f"{arch} prompt {i} B={B} (random drafter)"
                assert_cycles_just_cover(accepted, B, max_tokens)
                random_accepted += accepted
            oracle = make_oracle(model, prompt, block_size=16, spoil_seed=100 * i + B)
            spec, accepted, _ = run(
                model, tokenizer, prompt, oracle, block_size=B, max_tokens=max_tokens, eos_token_ids=[]
            )
            assert spec == plain, f"{arch} prompt {i} B={B} (oracle)"
            assert_cycles_just_cover(accepted, B, max_tokens)
            assert oracle.calls == len(accepted)  # one drafter pass per cycle
            lengths_seen |= set(accepted)
    # a random drafter over 256 tokens is (almost) always wrong: tau within 5% of 1 (measured: 0 accepted)
    assert sum(random_accepted) <= 0.05 * len(random_accepted), (sum(random_accepted), len(random_accepted))
    # rejection at once, full acceptance of a 16-block, and every short run in between occurred
    assert set(range(8)) | {15} <= lengths_seen


def test_plain_mode_matches_mlx_lm(tokenizer):
    """Our baseline ('off') is mlx-lm's own greedy generation."""
    from mlx_lm.generate import generate_step

    model = make_target("qwen3")
    prompt = prompts(1, seed=11)[0]
    ours, _, _ = run(model, tokenizer, prompt, max_tokens=30, eos_token_ids=[])
    theirs = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model), range(30))]
    assert ours == theirs


@pytest.mark.parametrize("B", [4, 8, 16])
def test_oracle_reaches_full_acceptance(B, tokenizer):
    model = make_target("llama", seed=3)
    prompt = prompts(1, seed=B)[0]
    oracle = make_oracle(model, prompt, block_size=B)
    max_tokens = 1 + 5 * B  # the prefill token, then five full cycles
    spec, accepted, finish = run(model, tokenizer, prompt, oracle, max_tokens=max_tokens, eos_token_ids=[])
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=max_tokens, eos_token_ids=[])
    assert spec == plain
    assert accepted == [B - 1] * 5
    assert finish == "length"
    assert oracle.calls == 5


def test_eos_inside_an_accepted_run(tokenizer):
    """EOS committed in the middle of a fully accepted block ends generation right there."""
    model = make_target("qwen3", seed=5)
    prompt = prompts(1, seed=5)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=40, eos_token_ids=[])
    for stop_at in (3, 10, 17):  # positions inside the 1st, 2nd and 3rd block of 8
        eos = plain[stop_at]
        first = plain.index(eos)
        expected = plain[: first + 1]
        oracle = make_oracle(model, prompt, block_size=8)
        records = list(stream_cycles(model, tokenizer, prompt, oracle, max_tokens=40, eos_token_ids=[eos]))
        spec = [t for r in records for t in r.tokens]
        assert spec == expected
        assert records[-1].finish_reason == "stop"
        assert all(r.finish_reason is None for r in records[:-1])
        base, _, finish = run(model, tokenizer, prompt, max_tokens=40, eos_token_ids=[eos])
        assert base == expected and finish == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 13, 30])
def test_max_tokens_exact_inside_a_block(max_tokens, tokenizer):
    model = make_target("llama_swa", seed=2)
    prompt = prompts(1, seed=2)[0]
    oracle = make_oracle(model, prompt, block_size=8)
    records = list(stream_cycles(model, tokenizer, prompt, oracle, max_tokens=max_tokens, eos_token_ids=[]))
    spec = [t for r in records for t in r.tokens]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=max_tokens, eos_token_ids=[])
    assert len(spec) == max_tokens and spec == plain
    assert records[-1].finish_reason == "length" and records[-1].generation_tokens == max_tokens


@pytest.mark.slow
def test_sliding_window_target_past_its_window(tokenizer):
    """A long run on a target whose sliding layers (window 8) use rotating caches: rollback must stay
    exact after the ring buffer has wrapped many times."""
    model = make_target("llama_swa", seed=9)
    prompt = prompts(1, seed=9)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=120, eos_token_ids=[])
    for B in (3, 8, 13):
        oracle = make_oracle(model, prompt, block_size=16, spoil_seed=B)
        spec, _, _ = run(model, tokenizer, prompt, oracle, block_size=B, max_tokens=120, eos_token_ids=[])
        assert spec == plain


def test_stream_records(tokenizer):
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    records = list(
        stream_cycles(model, tokenizer, "w1 w2 w3", drafter, verify_mode="dflash", max_tokens=12, eos_token_ids=[])
    )
    assert records[0].accepted is None and len(records[0].tokens) == 1
    assert all(r.accepted is not None and len(r.tokens) == r.accepted + 1 for r in records[1:-1])
    assert [r.generation_tokens for r in records] == sorted(r.generation_tokens for r in records)
    assert records[-1].generation_tokens == 12
    text = "".join(r.text for r in records)
    assert text == tokenizer.decode([t for r in records for t in r.tokens])
    for r in records:
        assert r.prompt_tokens == 3 and r.prompt_tps > 0 and r.peak_memory > 0


def test_result_summary(tokenizer):
    model = make_target("qwen3")
    prompt = prompts(1, seed=4)[0]
    oracle = make_oracle(model, prompt, block_size=4, spoil_seed=1)
    r = generate(model, tokenizer, prompt, oracle, verify_mode="dflash", max_tokens=25, eos_token_ids=[])
    assert r.cycles == len(r.accepted) > 0
    assert r.tau == pytest.approx((sum(r.accepted) + r.cycles) / r.cycles)
    assert r.generation_tokens == len(r.tokens) == 25
    assert r.block_size == 4 and r.verify_mode == "dflash"


def test_bad_arguments(tokenizer):
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=8)
    with pytest.raises(ValueError, match="outside 2..8"):
        run(model, tokenizer, [7, 8], drafter, block_size=9)
    with pytest.raises(ValueError, match="outside 2..8"):
        run(model, tokenizer, [7, 8], drafter, block_size=1)
    with pytest.raises(ValueError, match="needs a drafter"):
        run(model, tokenizer, [7, 8], None, verify_mode="dflash")
    with pytest.raises(ValueError, match="verify mode must be one of"):
        run(model, tokenizer, [7, 8], drafter, verify_mode="tree")
    with pytest.raises(ValueError, match="prompt is empty"):
        run(model, tokenizer, [], drafter)
    with pytest.raises(ValueError, match="prompt token id 300 is outside the target's vocabulary"):
        run(model, tokenizer, [7, 300], drafter)
    with pytest.raises(ValueError, match="top_p"):
        run(model, tokenizer, [7], drafter, temp=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        run(model, tokenizer, [7], drafter, temp=1.0, min_p=-0.5)


def test_generation_leaves_the_target_untouched(tokenizer):
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    classes = [type(layer) for layer in model.layers]
    stream = stream_cycles(model, tokenizer, [9, 10], drafter, max_tokens=50, eos_token_ids=[])
    next(stream)
    next(stream)
    assert type(model.layers[1]) is not classes[1]  # tapped while generating
    stream.close()  # a consumer that stops early
    assert [type(layer) for layer in model.layers] == classes
    assert all("_dflash_tap" not in layer.__dict__ for layer in model.layers)


def test_plain_steps_is_one_forward_per_token():
    model = make_target("qwen3")
    target = Target(model)
    calls = []
    original = target.model.__class__.__call__

    class Counting(type(model)):
        def __call__(self, *a, **k):
            calls.append(a[0].shape)
            return original(self, *a, **k)

    model.__class__ = Counting
    try:
        steps = plain_steps(target, mx.array([5, 6, 7]), SamplingParams())
        for _ in range(4):
            next(steps)
    finally:
        model.__class__ = Counting.__bases__[0]
    assert calls[0] == (1, 3) and all(s == (1, 1) for s in calls[1:])


def test_interleaved_generations_on_one_model(tokenizer):
    """A second speculative generation started on a model while another is mid-way is refused with a clear
    error at its first step; the first goes on undisturbed and stays identical to plain decoding."""
    model = make_target("qwen3", seed=2)
    prompt = prompts(1, seed=5)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=24, eos_token_ids=[])
    first = stream_cycles(
        model,
        tokenizer,
        prompt,
        make_oracle(model, prompt, block_size=4, spoil_seed=1),
        block_size=4,
        max_tokens=24,
        eos_token_ids=[],
    )
    second = stream_cycles(
        model,
        tokenizer,
        prompt,
        make_drafter(model, block_size=4, seed=3),
        block_size=4,
        max_tokens=24,
        eos_token_ids=[],
    )
    tokens = list(next(first).tokens) + list(next(first).tokens)
    with pytest.raises(RuntimeError, match="already being captured by another speculative generation"):
        next(second)
    tokens += [t for r in first for t in r.tokens]
    assert tokens == plain
    # the model is free again: a new generation runs and is still lossless
    assert (
        run(
            model,
            tokenizer,
            prompt,
            make_drafter(model, block_size=4, seed=3),
            block_size=4,
            max_tokens=24,
            eos_token_ids=[],
        )[0]
        == plain
    )


@pytest.mark.parametrize("mode", ["off", "dflash", "ddtree"])
def test_the_loops_free_cached_buffers_as_mlx_lm_does(mode, tokenizer, monkeypatch):
    """After the first token and then about every CLEAR_EVERY tokens (mlx-lm's cadence: buffers another
    generation left cost our plain loop 5% against mlx-lm's in the bench); the tokens are unchanged."""
    import dflash2_mlx.decode as decode

    model = make_target("llama", seed=3)
    prompt = prompts(1, seed=11)[0]
    drafter = None if mode == "off" else make_oracle(model, prompt, block_size=4, spoil_seed=2)
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=40, eos_token_ids=[])
    monkeypatch.setattr(decode, "CLEAR_EVERY", 16)
    cleared, real = [], mx.clear_cache
    record = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(len(record)) or real())
    for r in stream_cycles(
        model, tokenizer, prompt, drafter, verify_mode=mode, block_size=4, max_tokens=40, eos_token_ids=[]
    ):
        record += r.tokens
    assert record == plain
    assert cleared[0] == 1  # right after the prefill's token
    # then each time another 16 tokens are out (a cycle may commit up to 4 at once)
    assert len(cleared) == 3 and all(16 <= b - a < 16 + 4 for a, b in zip(cleared, cleared[1:])), cleared
