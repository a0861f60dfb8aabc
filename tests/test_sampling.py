"""T > 0: speculative sampling follows, exactly, the distribution mlx-lm's own sampler draws from the target
(statistical tests through the decode loop), `sample` is mlx-lm's sampler, and the acceptance step takes
the drafter's sparse proposal."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    N_BROKEN,
    SETTINGS,
    N,
    V,
    assert_follows_mlx_lm,
    chi_square,
    exact_distribution,
    make_dflash2_drafter,
    make_drafter,
    make_target,
    mlx_lm_probabilities,
    sample_sequences,
)
from mlx_lm.sample_utils import make_sampler

import dflash2_mlx.sampling as sampling
from dflash2_mlx.adaptive import AdaptiveBlocks, AdaptiveConfig
from dflash2_mlx.costs import CostModel
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import Proposal, SamplingParams, accept, probabilities, sample
from dflash2_mlx.target import Target


def temperature_first(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """The wrong order (what dflash2 did before): mlx-lm's filters applied to the tempered distribution."""
    return mlx_lm_probabilities(logits / params.temperature, replace(params, temperature=1.0))


# one draft cheap to verify, each one after it worth its cost only where the drafter is sure of it
COSTS_STEEP = CostModel([1.0, 1.1, 1.6, 2.1], [0.1] * 3)


def adaptive_blocks():
    """Adaptive mode that mixes both paths inside 3 tokens: a plain step after a shadow probe, then its own choice
    (costs that make drafting look cheap, so it keeps drafting while drafts are accepted)."""
    return AdaptiveBlocks(
        CostModel([1.0, 1.5, 1.5], [0.1, 0.1]), AdaptiveConfig(3, prior=[0.0, 0.0], prior_weight=1.0, plain_run=1)
    )


def full_blocks():
    """Adaptive mode drafting from the first token, with blocks of 4 (cheap drafting): a B = 3 cycle, then B = 2
    where one token is left, each verifying the first drafts of a block of 4."""
    return AdaptiveBlocks(CostModel([1.0] * 4, [0.1] * 3), AdaptiveConfig(4))


@pytest.fixture(scope="module")
def pair():
    model = make_target("llama", vocab=V, seed=21)
    # A drafter with sharp, wrong opinions: drafts are often rejected, so the residual matters.
    drafter = make_drafter(model, block_size=4, seed=5, output_multiplier=4.0)
    return model, drafter, bind_drafter(drafter, model)


@pytest.mark.slow
def test_speculative_sampling_follows_mlx_lm(pair):
    """Through the loop: blocks of 3, rows past a rejection, the bonus after full acceptance. (The rule's law at
    every sampler setting: `test_acceptance_law_is_the_targets` below.)"""
    model, drafter, target = pair
    params = SETTINGS["t0.7-topp0.9"]
    assert_follows_mlx_lm(model, sample_sequences(target, drafter, params, seed=1), params)


@pytest.mark.slow
def test_adaptive_sampling_follows_mlx_lm(pair):
    """Adaptive mode switches between plain steps and cycles mid-sequence, on what was accepted so far."""
    model, drafter, target = pair
    params = SETTINGS["t0.7-topp0.9"]
    assert_follows_mlx_lm(model, sample_sequences(target, drafter, params, seed=5, blocks=adaptive_blocks), params)


@pytest.mark.slow
def test_adaptive_sampling_follows_mlx_lm_where_confidence_cuts_the_blocks(pair):
    """Each cycle verifies as many drafts as their rows' confidences pay for (costs rising steeply with the
    block, so the choice varies from cycle to cycle): made on the rows' distributions, never on what was drawn
    from them, the choice leaves the committed tokens mlx-lm's distribution."""
    model, drafter, target = pair
    params, verified = SETTINGS["t0.7-topp0.9"], []

    class Recorded(AdaptiveBlocks):
        def verified_block(self, B, confidence, left):
            verified.append(super().verified_block(B, confidence, left))
            return verified[-1]

    def blocks():
        return Recorded(COSTS_STEEP, AdaptiveConfig(4))

    assert_follows_mlx_lm(model, sample_sequences(target, drafter, params, seed=7, blocks=blocks), params)
    assert min(verified.count(2), verified.count(3)) > N // 10, Counter(verified)  # both, often


@pytest.mark.slow
def test_adaptive_sampling_follows_mlx_lm_where_drafts_go_unverified(pair):
    """A drafter of milder opinions (its rows' confidences near 0.6), a first draft that costs half a step to
    verify and a second that costs a tenth: cycles verify none of their drafts (a plain step after the drafter
    pass, `AdaptiveBlocks.verified_block`) or both, as the confidences and the drafts left say. The committed
    tokens stay mlx-lm's distribution."""
    model, _, _ = pair
    drafter = make_drafter(model, block_size=4, seed=5, output_multiplier=0.18)
    params, verified = SETTINGS["t0.7-topp0.9"], []

    class Recorded(AdaptiveBlocks):
        def verified_block(self, B, confidence, left):
            verified.append(super().verified_block(B, confidence, left))
            return verified[-1]

    costs = CostModel([1.0, 1.5, 1.6, 2.1], [0.1] * 3)

    def blocks():
        return Recorded(costs, AdaptiveConfig(4, prior=[0.95] * 3))  # a card that says: draft

    counts = sample_sequences(bind_drafter(drafter, model), drafter, params, seed=9, blocks=blocks)
    assert_follows_mlx_lm(model, counts, params)
    assert min(verified.count(1), len(verified) - verified.count(1)) > N // 10, Counter(verified)  # both, often


@pytest.mark.slow
def test_plain_sampling_follows_mlx_lm(pair):
    model, _, _ = pair
    params = SETTINGS["t0.7-topp0.9"]
    assert_follows_mlx_lm(model, sample_sequences(Target(model), None, params, seed=2), params)


@pytest.mark.parametrize("name", ["t0.7-topp0.9", "t0.7-minp0.2"])
def test_the_tests_tell_the_sampler_order_apart(pair, name):
    """Draws from the old order (temperature, then the filters) would fail the tests above: their chi-square
    statistic, noise aside, already exceeds the critical value by half. (The exact tests below see it at once:
    their reference is mlx-lm's order.)"""
    model, _, _ = pair
    params = SETTINGS[name]
    wrong = exact_distribution(model, params, temperature_first)
    stat, critical = chi_square({k: p * N for k, p in wrong.items()}, exact_distribution(model, params), N)
    assert stat > 1.5 * critical, f"{name}: chi2 {stat:.1f} vs {critical:.1f}"


def _accept_always(proposal, target_logits, params):
    return mx.array(proposal.tokens.shape[0]), sample(target_logits[-1], params)


def _resample_from_target(proposal, target_logits, params):
    """Right acceptance test, wrong correction: resampling from p instead of max(p - q, 0)."""
    p = probabilities(target_logits, params)
    drafts = proposal.tokens
    q_d = mx.sum(mx.where(proposal.candidates == drafts[:, None], proposal.probs, 0), axis=-1)
    p_d = mx.take_along_axis(p[:-1], drafts[:, None], axis=-1)[:, 0]
    keep = mx.random.uniform(shape=q_d.shape) * q_d < p_d
    accepted = mx.sum(mx.cumprod(keep.astype(mx.int32)))
    return accepted, mx.random.categorical(mx.log(p))[accepted]


@pytest.mark.slow
@pytest.mark.parametrize("broken", [_accept_always, _resample_from_target])
def test_the_test_catches_a_broken_acceptance_rule(pair, broken, monkeypatch):
    model, drafter, target = pair
    params = SETTINGS["t1"]
    monkeypatch.setattr(sampling, "accept_sampled", broken)
    counts = sample_sequences(target, drafter, params, seed=1, n=N_BROKEN)
    stat, critical = chi_square(counts, exact_distribution(model, params), N_BROKEN)
    assert stat > critical, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"


# -- the sampler itself is mlx-lm's ------------------------------------------------------------------------

UNIT_SETTINGS = [
    SamplingParams(0.7, top_p=0.9),
    SamplingParams(0.8, top_k=3),
    SamplingParams(0.7, min_p=0.1),
    SamplingParams(1.3, top_p=0.8, top_k=5, min_p=0.05),
    SamplingParams(1.0, top_p=0.5, min_p=0.5, top_k=2),
    SamplingParams(1.0),
]


def tied_logits(rows: int, vocab: int, seed: int) -> mx.array:
    """Logits on a grid of halves, so rows hold many exact ties for the filters' thresholds to meet."""
    return mx.round(mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 2) / 2


@pytest.mark.parametrize("params", UNIT_SETTINGS, ids=str)
def test_sample_draws_what_mlx_lms_sampler_draws(params):
    logits = tied_logits(64, 50, seed=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    theirs = make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    for seed in range(3):
        mx.random.seed(seed)
        ours = sample(logits, params).tolist()
        mx.random.seed(seed)
        assert ours == theirs(logprobs).tolist()


@pytest.mark.parametrize("params", UNIT_SETTINGS, ids=str)
def test_probabilities_are_mlx_lms(params):
    logits = tied_logits(64, 50, seed=1)
    np.testing.assert_allclose(np.array(probabilities(logits, params)), mlx_lm_probabilities(logits, params), atol=1e-6)


@pytest.mark.parametrize("params", UNIT_SETTINGS[:5], ids=str)
def test_the_reference_is_mlx_lms_sampler(params):
    """`mlx_lm_probabilities` (the tests' expected values) is what make_sampler draws: 200,000 draws."""
    logits = tied_logits(3, 12, seed=2)
    expected = mlx_lm_probabilities(logits, params)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(5)
    draws = make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)(
        mx.tile(logprobs, (200_000 // 3, 1))
    ).reshape(-1, 3)
    n = draws.shape[0]
    for row in range(3):
        counts = Counter(np.array(draws[:, row]).tolist())
        stat, critical = chi_square(counts, dict(enumerate(expected[row])), n)
        assert stat < critical, f"row {row}: chi2 {stat:.1f} >= {critical:.1f}"
        assert set(counts) <= set(np.flatnonzero(expected[row]).tolist())


def test_filters_act_before_temperature():
    """From the formulas (NumPy): the filters read the untempered probabilities, temperature comes last."""
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    full = np.exp(x) / np.exp(x).sum()  # [0.563, 0.207, 0.126, 0.076, 0.028]

    def tempered(keep):
        return np.where(keep, np.exp(x / 0.5), 0) / np.exp(x / 0.5)[keep].sum()

    logits = mx.array(x[None], dtype=mx.float32)
    # top-p 0.8: the smallest most-likely set reaching 0.8 of the untempered mass, 3 tokens
    # (tempering first would leave one: 0.83 at T = 0.5)
    keep = np.cumsum(full) - full < 0.8
    np.testing.assert_allclose(
        np.array(probabilities(logits, SamplingParams(0.5, top_p=0.8)))[0], tempered(keep), rtol=1e-5
    )
    # min-p 0.2: p >= 0.2 * max p untempered, 3 tokens (tempered ratios would keep one)
    keep = full >= 0.2 * full.max()
    np.testing.assert_allclose(
        np.array(probabilities(logits, SamplingParams(0.5, min_p=0.2)))[0], tempered(keep), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.array(probabilities(logits, SamplingParams(0.5)))[0], tempered(np.ones(5, bool)), rtol=1e-5
    )


def test_filter_ties():
    """mlx-lm's tie semantics: top-p keeps every token tied with the last one it needs; top-k keeps exactly k."""
    logits = mx.array([[1.0, 0.0, 1.0, 1.0, -1.0]])
    p = np.array(probabilities(logits, SamplingParams(1.0, top_p=0.25)))[0]
    np.testing.assert_allclose(p, [1 / 3, 0, 1 / 3, 1 / 3, 0], rtol=1e-5)  # 0.25 needs one (0.29); its ties stay
    p = np.array(probabilities(logits, SamplingParams(1.0, top_k=2)))[0]
    assert np.count_nonzero(p) == 2 and set(np.flatnonzero(p)) <= {0, 2, 3}
    np.testing.assert_allclose(p[p > 0], [0.5, 0.5], rtol=1e-5)
    p = np.array(probabilities(logits, SamplingParams(1.0, top_k=5)))[0]  # top_k >= vocabulary: no filter
    assert np.count_nonzero(p) == 5


def test_greedy_sample_is_argmax():
    logits = mx.array([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]])
    assert sample(logits, SamplingParams()).tolist() == [1, 0]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_params(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


# -- the acceptance step's exact law ------------------------------------------------------------------------


def accept_law(
    candidates: mx.array,
    probs: mx.array,
    target_logits: mx.array,
    params: SamplingParams,
    finite: bool = True,
    drafts: dict[int, float] | None = None,
) -> dict[tuple[int, ...], float]:
    """The exact law of what one cycle commits (the accepted draft, then the bonus) for a one-draft proposal
    drawn from the sparse q (candidates [1, k], probs [1, k]; or `drafts`, token -> weight) against the
    verify rows target_logits [2, V], computed from `accept` itself with its two random draws under the
    test's control: every draft x with its weight q(x); the uniform draw swept over [0, 1] (the outcome
    is constant between the points where it changes, found by bisection to 2^-30); the categorical draw
    read as the distribution `accept` hands to mx.random.categorical."""
    handed, u_now = [], [0.0]

    def categorical(logits, **kw):
        handed.append(np.array(logits.astype(mx.float32), dtype=np.float64))
        return mx.zeros(logits.shape[:-1], dtype=mx.uint32)

    def outcome(x: int, u: float) -> tuple[int, np.ndarray]:
        u_now[0] = u
        handed.clear()
        proposal = Proposal(mx.array([x]), candidates, probs, mx.array(finite))
        accepted, _ = accept(proposal, target_logits, params)
        a = int(accepted.item())
        assert len(handed) == 1, "accept drew its bonus other than by one mx.random.categorical"
        logits = handed[0] if handed[0].ndim == 1 else handed[0][a]
        e = np.exp(logits - logits.max())
        return a, e / e.sum()

    def pieces(x: int, grid: int = 16) -> list[tuple[float, float]]:
        us = (np.arange(grid) + 0.5) / grid
        accepted = [outcome(x, u)[0] for u in us]
        cuts = [0.0]
        for u0, u1, a0, a1 in zip(us, us[1:], accepted, accepted[1:]):
            if a0 != a1:
                for _ in range(30):
                    mid = (u0 + u1) / 2
                    u0, u1 = (mid, u1) if outcome(x, mid)[0] == a0 else (u0, mid)
                cuts.append((u0 + u1) / 2)
        return list(zip(cuts, cuts[1:] + [1.0]))

    if drafts is None:
        drafts = {int(x): float(w) for x, w in zip(np.array(candidates[0]), np.array(probs[0])) if w > 0}
    law = Counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.random, "uniform", lambda shape=(), **kw: mx.full(shape, u_now[0], dtype=mx.float32))
        mp.setattr(mx.random, "categorical", categorical)
        for x, weight in drafts.items():
            for lo, hi in pieces(x):
                a, bonus = outcome(x, (lo + hi) / 2)
                for y in np.flatnonzero(bonus):
                    law[(x,) * a + (int(y),)] += weight * (hi - lo) * bonus[y]
    return law


def law_errors(law: dict, target_logits: mx.array, params: SamplingParams) -> tuple[float, float]:
    """(largest error of the first committed token's law against mlx-lm's distribution of row 0, largest
    error of the token after an accepted draft against row 1's)."""
    p = mlx_lm_probabilities(target_logits, params)
    first = np.zeros(p.shape[-1])
    after = {}
    for seq, w in law.items():
        first[seq[0]] += w
        if len(seq) == 2:
            after.setdefault(seq[0], np.zeros(p.shape[-1]))[seq[1]] += w
    err_after = max((np.abs(row / row.sum() - p[1]).max() for row in after.values() if row.sum() > 1e-6), default=0.0)
    return float(np.abs(first - p[0]).max()), float(err_after)


def accepted_mass(law: dict) -> float:
    return sum(w for seq, w in law.items() if len(seq) == 2)


SPARSE_V = 8
SPARSE_TARGET = mx.array(np.random.default_rng(0).normal(size=(2, SPARSE_V)) * 1.5, dtype=mx.float32)
# A draft vocabulary of 3 ids, in no particular order, with a q far from the target's p.
SPARSE_IDS = mx.array([[6, 1, 3]])
SPARSE_Q = mx.array([[0.7, 0.1, 0.2]])
DENSE_IDS = mx.arange(SPARSE_V)[None]
DENSE_Q = mx.softmax(mx.array(np.random.default_rng(1).normal(size=(1, SPARSE_V)) * 2, dtype=mx.float32), axis=-1)
ALL_SETTINGS = {**{str(s): s for s in UNIT_SETTINGS}, **{str(s): s for s in SETTINGS.values()}}


@pytest.mark.parametrize("q", ["dense", "sparse"])
@pytest.mark.parametrize("name", ALL_SETTINGS)
def test_acceptance_law_is_the_targets(name, q):
    """Exactly: the first committed token follows mlx-lm's distribution of row 0 (the tokens q never proposes
    and, filtered out, candidates the target never draws included), the token after an accepted draft row 1's,
    and drafts are kept as often as any lossless rule can keep them: sum_x min(p(x), q(x))."""
    params = ALL_SETTINGS[name]
    ids, probs = (DENSE_IDS, DENSE_Q) if q == "dense" else (SPARSE_IDS, SPARSE_Q)
    law = accept_law(ids, probs, SPARSE_TARGET, params)
    assert abs(sum(law.values()) - 1) < 1e-6
    first, after = law_errors(law, SPARSE_TARGET, params)
    assert first < 2e-6 and after < 2e-6, (first, after)
    p0 = mlx_lm_probabilities(SPARSE_TARGET[:1], params)[0]
    q_full = np.zeros(SPARSE_V)
    q_full[np.array(ids[0])] = np.array(probs[0])
    assert accepted_mass(law) == pytest.approx(np.minimum(p0, q_full).sum(), abs=2e-6)
    assert 0 < accepted_mass(law) < 1  # both the kept and the resampled branch are in the law


@pytest.mark.parametrize("broken", [_accept_always, _resample_from_target])
def test_the_exact_law_catches_a_broken_acceptance_rule(broken, monkeypatch):
    params = SETTINGS["t1"]
    monkeypatch.setattr(sampling, "accept_sampled", broken)
    first, _ = law_errors(accept_law(DENSE_IDS, DENSE_Q, SPARSE_TARGET, params), SPARSE_TARGET, params)
    assert first > 0.05, f"a broken rule passed: first-token error {first:.2g}"


def test_the_exact_law_catches_a_dense_reading_of_q(monkeypatch):
    """q read as if its candidates were ids 0..k-1 breaks the law."""
    params = SamplingParams(0.7, top_p=0.9)
    dense_ids = mx.broadcast_to(mx.arange(3), SPARSE_IDS.shape)
    real = sampling.accept_sampled
    monkeypatch.setattr(
        sampling,
        "accept_sampled",
        lambda prop, logits, params: real(prop._replace(candidates=dense_ids), logits, params),
    )
    first, _ = law_errors(accept_law(SPARSE_IDS, SPARSE_Q, SPARSE_TARGET, params), SPARSE_TARGET, params)
    assert first > 0.05, f"a misplaced q passed: first-token error {first:.2g}"


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0)], ids=["greedy", "t1"])
@pytest.mark.parametrize("q", [1.0, math.nan], ids=["finite-q", "nan-q"])
def test_non_finite_proposal_commits_the_targets_own_token(params, q):
    """finite=False: nothing is accepted (even a draft the target likes, whatever q says) and the bonus
    is drawn from the target's row 0 alone."""
    likes = int(mx.argmax(SPARSE_TARGET[0]))  # a draft the target would accept at T = 0
    ids = mx.array([[likes, (likes + 1) % SPARSE_V]])
    probs = mx.array([[q, 1 - q]])
    if params.greedy:
        proposal = Proposal(mx.array([likes]), ids, probs, mx.array(False))
        accepted, bonus = accept(proposal, SPARSE_TARGET, params)
        assert (accepted.item(), bonus.item()) == (0, likes)
        return
    law = accept_law(ids, probs, SPARSE_TARGET, params, finite=False, drafts={likes: 1.0})
    assert accepted_mass(law) == 0
    first, _ = law_errors(law, SPARSE_TARGET, params)
    assert first < 2e-6, first


def test_sampling_needs_the_draft_distribution():
    greedy = Proposal(mx.array([1, 2]), None, None, mx.array(True))
    with pytest.raises(ValueError, match="needs the proposal's draft distribution"):
        accept(greedy, SPARSE_TARGET, SamplingParams(1.0))


# -- DFlash 2: the selector's sparse q (top-3 of 4 tokens) is the draft distribution ---------------------


@pytest.fixture(scope="module")
def pair2():
    model = make_target("llama", vocab=V, seed=21)
    drafter = make_dflash2_drafter(model, block_size=4, seed=5, output_multiplier=4.0, selector_top_k=3)
    return model, drafter, bind_drafter(drafter, model)


@pytest.mark.slow
def test_dflash2_sampling_follows_mlx_lm(pair2):
    """With top-p, q is zero on some of the selector's candidates too."""
    model, drafter, target = pair2
    params = SETTINGS["t0.7-topp0.9"]
    assert_follows_mlx_lm(model, sample_sequences(target, drafter, params, seed=3), params)


@pytest.mark.slow
def test_dflash2_adaptive_sampling_follows_mlx_lm(pair2):
    """Adaptive cycles verify the first drafts of a full block (4): a B = 3 cycle keeps two rows of the sampled
    path, the next one (B = 2 where one token is left) one."""
    model, drafter, target = pair2
    params = SETTINGS["t0.7-topp0.9"]
    assert_follows_mlx_lm(model, sample_sequences(target, drafter, params, seed=4, blocks=full_blocks), params)


@pytest.mark.slow
def test_dflash2_test_catches_a_wrong_q(pair2, monkeypatch):
    """Sampling along the selector's path but reporting a uniform q over its candidates breaks it."""
    import dflash2_mlx.drafter as drafter_module
    from dflash2_mlx.selector import walk_sampled

    model, drafter, target = pair2
    params = SETTINGS["t1"]

    def wrong_q(lattice, params):
        idx, q = walk_sampled(lattice, params)
        return idx, mx.full(q.shape, 1 / q.shape[-1])  # uniform over the candidates

    monkeypatch.setattr(drafter_module, "walk_sampled", wrong_q)
    counts = sample_sequences(target, drafter, params, seed=3, n=N_BROKEN)
    stat, critical = chi_square(counts, exact_distribution(model, params), N_BROKEN)
    assert stat > critical, f"a wrong q passed: chi2 {stat:.1f} < {critical:.1f}"
