"""T > 0: speculative sampling follows the target's distribution exactly (a statistical test), and the
sampling transform (temperature, top-k, top-p) is the one both sides share."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_dflash2_drafter, make_drafter, make_target

import dflash2_mlx.decode as decode
from dflash2_mlx import stream_generate
from dflash2_mlx.sampling import SamplingParams, probabilities, sample

V = 4  # vocabulary: 4^3 = 64 possible 3-token continuations
PROMPT = [3, 1, 2]
N = 1500
ALPHA = 1e-3  # significance level of every goodness-of-fit test below


def exact_distribution(model, params: SamplingParams) -> dict[tuple, float]:
    """P(t0, t1, t2 | PROMPT) under `params`, from full forwards of the target (no cache)."""
    def next_probs(prefixes):
        logits = model(mx.array([PROMPT + list(p) for p in prefixes]))[:, -1]
        return np.array(probabilities(logits, params))

    p0 = next_probs([()])[0]
    p1 = next_probs([(a,) for a in range(V)])
    pairs = list(itertools.product(range(V), repeat=2))
    p2 = next_probs(pairs)
    return {
        (a, b, c): p0[a] * p1[a][b] * p2[pairs.index((a, b))][c]
        for a, b, c in itertools.product(range(V), repeat=3)
    }


def chi_square(samples: Counter, expected: dict[tuple, float], n: int) -> tuple[float, float]:
    """Pearson's statistic, cells with expected count < 5 pooled; returns (statistic, critical value
    at ALPHA by the Wilson-Hilferty approximation)."""
    big = {k: p * n for k, p in expected.items() if p * n >= 5}
    observed = [samples.get(k, 0) for k in big]
    rest_expected = n - sum(big.values())
    rest_observed = n - sum(observed)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, big.values()))
    cells = len(big)
    if rest_expected > 0:
        stat += (rest_observed - rest_expected) ** 2 / rest_expected
        cells += 1
    df = cells - 1
    z = 3.0902  # standard normal quantile at 1 - ALPHA
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def sample_sequences(model, tokenizer, drafter, params, verify_mode, seed) -> Counter:
    mx.random.seed(seed)
    counts = Counter()
    for _ in range(N):
        tokens = []
        for r in stream_generate(
            model, tokenizer, PROMPT, drafter, max_tokens=3, temp=params.temperature,
            top_p=params.top_p, top_k=params.top_k, block_size=3, verify_mode=verify_mode,
            eos_token_ids=[],
        ):
            tokens += r.tokens
        counts[tuple(tokens)] += 1
    return counts


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.fixture(scope="module")
def pair():
    model = make_target("llama", vocab=V, seed=21)
    # A drafter with sharp, wrong opinions: drafts are often rejected, so the residual matters.
    drafter = make_drafter(model, block_size=4, seed=5, output_multiplier=4.0)
    return model, drafter


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "t0.8-topk3", "t1.3-topp0.8"])
def test_speculative_sampling_follows_the_target(pair, tokenizer, params):
    model, drafter = pair
    expected = exact_distribution(model, params)
    counts = sample_sequences(model, tokenizer, drafter, params, "dflash", seed=1)
    stat, critical = chi_square(counts, expected, N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: not the target's distribution"
    support = {k for k, p in expected.items() if p > 0}
    assert set(counts) <= support, "sampled a sequence the filtered target can never produce"


def test_plain_sampling_follows_the_target(pair, tokenizer):
    model, _ = pair
    params = SETTINGS[0]
    counts = sample_sequences(model, tokenizer, None, params, "off", seed=2)
    stat, critical = chi_square(counts, exact_distribution(model, params), N)
    assert stat < critical


def _accept_always(drafts, draft_probs, target_logits, params):
    return mx.array(drafts.shape[0]), sample(target_logits[-1], params)


def _resample_from_target(drafts, draft_probs, target_logits, params):
    """Right acceptance test, wrong correction: resampling from p instead of max(p - q, 0)."""
    p = probabilities(target_logits, params)
    rows = mx.arange(drafts.shape[0])
    keep = mx.random.uniform(shape=drafts.shape) * draft_probs[rows, drafts] < p[rows, drafts]
    accepted = mx.sum(mx.cumprod(keep.astype(mx.int32)))
    return accepted, mx.random.categorical(mx.log(p))[accepted]


@pytest.mark.parametrize("broken", [_accept_always, _resample_from_target])
def test_the_test_catches_a_broken_acceptance_rule(pair, tokenizer, broken, monkeypatch):
    model, drafter = pair
    params = SETTINGS[0]
    monkeypatch.setattr(decode, "accept_sampled", broken)
    counts = sample_sequences(model, tokenizer, drafter, params, "dflash", seed=1)
    stat, critical = chi_square(counts, exact_distribution(model, params), N)
    assert stat > critical, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"


def test_top_k_and_top_p_filter():
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = np.array(probabilities(logits, SamplingParams(1.0, top_k=2)))[0]
    assert (p[2:] == 0).all() and p[:2].sum() == pytest.approx(1)
    full = np.exp([2.0, 1.0, 0.5, 0.0, -1.0])
    full /= full.sum()
    p = np.array(probabilities(logits, SamplingParams(1.0, top_p=0.8)))[0]
    keep = np.cumsum(full) - full < 0.8  # smallest prefix of the sorted mass reaching 0.8
    np.testing.assert_allclose(p, np.where(keep, full, 0) / full[keep].sum(), rtol=1e-5)
    p = np.array(probabilities(logits, SamplingParams(0.5)))[0]
    np.testing.assert_allclose(p, np.exp([4, 2, 1, 0, -2]) / np.exp([4, 2, 1, 0, -2]).sum(), rtol=1e-5)


def test_greedy_sample_is_argmax():
    logits = mx.array([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]])
    assert sample(logits, SamplingParams()).tolist() == [1, 0]


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


# -- DFlash 2: the selector's sparse q (top-3 of 4 tokens) is the draft distribution ---------------------


@pytest.fixture(scope="module")
def pair2():
    model = make_target("llama", vocab=V, seed=21)
    drafter = make_dflash2_drafter(model, block_size=4, seed=5, output_multiplier=4.0, selector_top_k=3)
    return model, drafter


def test_dflash2_sampling_follows_the_target(pair2, tokenizer):
    model, drafter = pair2
    params = SETTINGS[0]
    counts = sample_sequences(model, tokenizer, drafter, params, "dflash", seed=3)
    stat, critical = chi_square(counts, exact_distribution(model, params), N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: not the target's distribution"


def test_dflash2_test_catches_a_wrong_q(pair2, tokenizer, monkeypatch):
    """Sampling along the selector's path but reporting a uniform q over its candidates breaks it."""
    import dflash2_mlx.drafter as drafter_module
    from dflash2_mlx.selector import walk_sampled

    model, drafter = pair2
    params = SETTINGS[0]

    def wrong_q(lattice, params, vocab):
        idx, q = walk_sampled(lattice, params, vocab)
        return idx, mx.softmax(mx.where(q > 0, 0.0, -mx.inf), axis=-1)  # uniform over the candidates

    monkeypatch.setattr(drafter_module, "walk_sampled", wrong_q)
    counts = sample_sequences(model, tokenizer, drafter, params, "dflash", seed=3)
    stat, critical = chi_square(counts, exact_distribution(model, params), N)
    assert stat > critical, f"a wrong q passed: chi2 {stat:.1f} < {critical:.1f}"
