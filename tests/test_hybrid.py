"""Hybrid recurrent targets (GatedDeltaNet layers): exact rollback, lossless decoding, mlx-lm untouched."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    SETTINGS,
    N,
    V,
    chi_square,
    exact_distribution,
    make_dflash2_drafter,
    make_drafter,
    make_hybrid,
    make_oracle,
    sample_sequences,
)
from mlx_lm.models import qwen3_5, qwen3_next

from dflash2_mlx import generate, stream_cycles
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(6, 250) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_plain(arch, tokenizer):
    """Full rejection (random drafter), every partial acceptance (spoiled oracle) and full acceptance
    (oracle), over block sizes, each on one of two prompts in turn."""
    model = make_hybrid(arch, seed=ARCHS.index(arch))
    random_drafter = make_dflash2_drafter(model, block_size=16)
    seen = set()
    for i, prompt in enumerate(prompts(2, seed=ARCHS.index(arch))):
        plain = generate(model, tokenizer, prompt, None, verify_mode="off", max_tokens=25, eos_token_ids=[]).tokens
        for B in (2, 3, 5, 8, 16)[i::2]:
            for drafter in (
                random_drafter,
                make_oracle(model, prompt, 16, spoil_seed=B + i),
                make_oracle(model, prompt, 16),
            ):
                r = generate(
                    model,
                    tokenizer,
                    prompt,
                    drafter,
                    verify_mode="dflash",
                    block_size=B,
                    max_tokens=25,
                    eos_token_ids=[],
                )
                assert r.tokens == plain, f"{arch} prompt {i} B={B} {type(drafter).__name__}"
                seen |= set(r.accepted)
    assert {0, 15} <= seen and len(seen) >= 8  # full rejection, full acceptance and many in between


def recurrent_states(cache):
    return [np.array(c[j]) for c in cache if not hasattr(c, "keys") for j in (0, 1)]


@pytest.mark.parametrize("arch", ARCHS)
def test_states_after_rollback_equal_a_fresh_prefill(arch):
    model = make_hybrid(arch, seed=4)
    target = Target(model)
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(6, 250, size=12)]
    cache = target.make_cache()
    with target.capture() as tap:
        tap.prefill(mx.array(history), cache)
        for keep in (1, 8, 3, 0, 5, 2, 8):  # 8 = everything accepted, nothing to undo; 0 = all of it
            block = [int(t) for t in rng.integers(6, 250, size=8)]
            tap.rollback(cache, tap.verify(mx.array(block), cache), keep)
            history += block[:keep]
            fresh = target.make_cache()
            target.prefill(mx.array(history), fresh)
            for got, want in zip(recurrent_states(cache), recurrent_states(fresh)):
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
            assert all(c.offset == len(history) for c in cache if hasattr(c, "keys"))


def test_recording_is_one_verify_pass(tokenizer):
    """What a layer keeps for rollback covers the rows of one verify pass, not the history."""
    model = make_hybrid("qwen3_5")
    target = Target(model)
    cache = target.make_cache()
    with target.capture() as tap:
        tap.prefill(mx.array(list(range(10, 60))), cache)
        assert all(r.recurrence is None for r in tap.recorders.values())  # prefill is not recorded
        verified = tap.verify(mx.array([5, 6, 7, 8, 9]), cache)
        seen = next(iter(verified.recurrences.values()))
        assert seen.recurrence[0][0].shape[1] == 5 and seen.conv_input.shape[1] == 5 + 3  # K - 1 = 3 previous rows
        assert all(r.recurrence is None for r in tap.recorders.values())  # the record left with the pass
        tap.rollback(cache, verified, 3)


@pytest.mark.slow
def test_speculative_sampling_follows_a_hybrid_target(tokenizer):
    model = make_hybrid("qwen3_5", vocab=V, seed=21)
    drafter = make_drafter(model, block_size=4, seed=5, output_multiplier=4.0)
    params = SETTINGS["t0.7-topp0.9"]
    counts = sample_sequences(bind_drafter(drafter, model), drafter, params, seed=4)
    stat, critical = chi_square(counts, exact_distribution(model, params), N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    assert set(map(len, counts)) == {3}
    # the test can tell distributions apart: the same samples are rejected against the target at T=0.5
    stat, critical = chi_square(counts, exact_distribution(model, SamplingParams(temperature=0.5)), N)
    assert stat > critical, f"chi2 {stat:.1f} <= {critical:.1f}: this test could not see a wrong temperature"


def _classes_untouched(model):
    assert qwen3_5.GatedDeltaNet.__call__.__globals__["gated_delta_update"].__module__.endswith("gated_delta")
    for layer in model.layers:
        for module in (layer, getattr(layer, "linear_attn", None)):
            if module is not None:
                assert type(module).__module__.startswith("mlx_lm.models"), type(module)
                assert "_dflash_call" not in module.__dict__ and "_dflash_tap" not in module.__dict__
        if hasattr(layer, "linear_attn"):
            assert type(layer.linear_attn.conv1d).__module__.startswith("mlx.nn")


def test_mlx_lm_is_unchanged_after_generations(tokenizer):
    original_call = qwen3_5.GatedDeltaNet.__call__
    next_call = qwen3_next.Qwen3NextGatedDeltaNet.__call__
    model = make_hybrid("qwen3_5")
    drafter = make_drafter(model, block_size=4)
    for _ in range(2):  # two generations in one process
        generate(model, tokenizer, [4, 5], drafter, max_tokens=9, eos_token_ids=[])
        _classes_untouched(model)

    class Boom(Exception):
        pass

    calls = 0
    propose = drafter.propose

    def failing_propose(*a, **k):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Boom()
        return propose(*a, **k)

    drafter.propose = failing_propose
    with pytest.raises(Boom):
        generate(model, tokenizer, [4, 5], drafter, verify_mode="dflash", max_tokens=30, eos_token_ids=[])
    _classes_untouched(model)
    assert qwen3_5.GatedDeltaNet.__call__ is original_call and qwen3_next.Qwen3NextGatedDeltaNet.__call__ is next_call
    # a plain generation afterwards is still plain mlx-lm
    plain = generate(model, tokenizer, [4, 5], None, verify_mode="off", max_tokens=6, eos_token_ids=[])
    assert len(plain.tokens) == 6


def test_early_stop_restores_the_model(tokenizer):
    model = make_hybrid("qwen3_next")
    drafter = make_drafter(model, block_size=4)
    stream = stream_cycles(model, tokenizer, [7, 8, 9], drafter, max_tokens=40, eos_token_ids=[])
    next(stream), next(stream)
    assert "_dflash_call" in model.layers[0].linear_attn.__dict__  # recording while generating
    stream.close()
    _classes_untouched(model)
