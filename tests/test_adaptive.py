"""Adaptive verify mode: the block-size policy checked against its formula, and the decode loop it drives
checked against plain decoding (lossless whatever it picks)."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import random

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    COSTS,
    decide_on,
    make_dflash2_drafter,
    make_drafter,
    make_oracle,
    make_target,
    prompts,
    run,
    save_drafter,
)

import dflash2_mlx.adaptive as adaptive
import dflash2_mlx.costs as costs_module
from dflash2_mlx import decode, generate
from dflash2_mlx.adaptive import (
    AcceptanceEstimates,
    AdaptiveBlocks,
    AdaptiveConfig,
    ClockScales,
    FixedBlocks,
    Gains,
    TurnDetector,
    expected_tokens,
)
from dflash2_mlx.costs import CostModel, load_or_measure_costs
from dflash2_mlx.formats.card import ACCEPTANCE_FIELD
from dflash2_mlx.loading import bind_drafter, load_drafter
from dflash2_mlx.sampling import Proposal, SamplingParams, draft_acceptance

generate_module = importlib.import_module("dflash2_mlx.generate")  # the package exports a function of that name


def brute_force_expected(acceptance: list[float], B: int) -> float:
    """E[committed tokens] of a cycle at B by enumerating every accept/reject pattern of its B-1 drafts."""
    total = 0.0
    for pattern in itertools.product([True, False], repeat=B - 1):
        p = math.prod(a if ok else 1 - a for a, ok in zip(acceptance, pattern))
        run_length = next((i for i, ok in enumerate(pattern) if not ok), B - 1)
        total += p * (run_length + 1)
    return total


def test_expected_tokens_match_brute_force():
    estimates = AcceptanceEstimates(7)
    estimates.hits, estimates.seen = [0.9, 1.2, 0.3, 2.0, 0.1, 0.5, 0.7], [1.0, 2.0, 0.6, 2.5, 1.0, 0.5, 1.4]
    for B in range(1, 9):
        assert expected_tokens(estimates.estimates(), B) == pytest.approx(
            brute_force_expected(estimates.estimates(), B)
        )


def test_each_cycle_verifies_the_drafts_its_confidences_pay_for_and_learns_how_far_to_trust_them():
    """The block a drafting cycle verifies, against a count by hand: for each n, the tokens n drafts accepted
    with their rows' confidences give (brute force), less what plain steps commit in the cycle's time."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    plain_rate = 1 / (COSTS.verify_s[0] + COSTS.draft_s[-1] / policy.run)  # a plain step and its share of a probe

    def by_hand(confidence, top=8):  # n = 0: no draft verified, the cycle a plain step after the drafter pass
        gain = {
            n + 1: brute_force_expected(confidence[:n], n + 1) - plain_rate * COSTS.passes_s(n + 1, 8)
            for n in range(0, top)
        }
        return max(gain, key=gain.get)

    sure, lukewarm, unsure, mixed = [0.95] * 7, [0.3] * 7, [0.1] * 7, [0.9, 0.9, 0.9, 0.05, 0.9, 0.9, 0.9]
    chosen = [policy.verified_block(5, mx.array(c), None) for c in (sure, lukewarm, unsure, mixed)]
    # 8, 2, 1 (not even the first draft pays for its place in the verify) and 4 (up to the unsure row)
    assert chosen == [by_hand(c) for c in (sure, lukewarm, unsure, mixed)] and len(set(chosen)) == 4
    assert policy.verified_block(5, mx.array(sure), left=4) == by_hand(sure, top=4) == 4  # never past max_tokens
    assert policy.verified_block(5, mx.array([float("nan")] + sure[1:]), None) == 2  # nothing to accept
    assert policy.verified_block(5, None, None) == FixedBlocks(5).verified_block(5, mx.array(sure), None) == 5
    # a drafter sure of drafts that are never accepted: after a few cycles its confidence is discounted, until
    # its drafts are not worth verifying at all
    for _ in range(16):
        if policy.verified_block(2, mx.array(sure), None) == 1:
            policy.observe_unverified(0.0, 0.1)
        else:
            policy.observe_cycle(2, 0, 0.1)
    assert policy.verified_block(2, mx.array(sure), None) == 1


def test_a_draft_left_unverified_is_scored_by_the_token_committed_and_counts_as_if_verified():
    """By hand, from empty counts (no card): the first position's estimate and the confidences' calibration move
    as a verified first draft's would, accepted or not; later positions and the turn rule are not touched."""
    for first in (1.0, 0.0):
        policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
        assert policy.verified_block(8, mx.array([0.04] * 7), None) == 1
        policy.observe_unverified(first, 0.1)
        assert policy.estimates.seen == [1.0] + [0.0] * 6 and policy.estimates.hits == [first] + [0.0] * 6
        assert policy.acceptance()[0] == pytest.approx((first + 0.5) / 2)  # shrunk toward 1/2 by one observation
        assert policy.calibration.hits[0] == pytest.approx(0.95 * 2 + first)
        assert policy.calibration.sums[0] == pytest.approx(0.95 * 2 + 0.04) and policy.calibration.measured[0] == 1.0
        assert policy.calibration.sums[1:] == [2.0] * 6 and policy.confidence is None


def test_estimates_start_from_the_card_or_neutral_and_shrink_toward_the_previous_position():
    assert AdaptiveBlocks(COSTS, AdaptiveConfig(4)).acceptance() == [0.5, 0.5, 0.5]  # no card, no evidence
    seeded = AdaptiveBlocks(COSTS, AdaptiveConfig(4, prior=[0.8, 0.6], prior_weight=3))
    # by hand: (3 * 0.8 + 0.5) / 4, then (3 * 0.6 + 0.725) / 4, then no evidence: the previous one
    assert seeded.acceptance() == pytest.approx([0.725, 0.63125, 0.63125])


def test_the_config_derives_the_plain_runs_and_names_a_bad_setting():
    config = AdaptiveConfig(8)
    assert (config.plain_run, config.plain_run_max) == (8, 24)
    assert (AdaptiveConfig(4, plain_run=5).plain_run, AdaptiveConfig(4, plain_run=5).plain_run_max) == (5, 15)
    with pytest.raises(ValueError, match="AdaptiveConfig.decay is a share in"):
        AdaptiveConfig(8, decay=1.5)
    with pytest.raises(ValueError, match="blocks of 2 or more"):
        AdaptiveConfig(1)
    with pytest.raises(ValueError, match="covers blocks up to 8, not 9"):
        AdaptiveBlocks(COSTS, AdaptiveConfig(9))


def test_gains_are_a_decayed_mean():
    gains = Gains(decay=0.5)
    assert gains.mean is None
    for g in (2.0, -1.0, 4.0):
        gains.add(g)
    # by hand: sums 2, 0, 4 and counts 1, 1.5, 1.75
    assert gains.mean == pytest.approx(4.0 / 1.75)


@pytest.mark.parametrize(
    "draft, plain, stale",
    [
        (None, None, False),
        (1.9, None, False),
        (2.1, None, True),
        (0.4, None, True),
        (3.0, 1.6, False),
        (1.0, 2.5, True),
        (5.0, 2.0, True),
        (None, 0.3, True),
    ],
)
def test_clock_scales_are_stale_past_twice_off(draft, plain, stale):
    """Plain steps against their measured time, cycles against plain steps (against their own time where no plain
    step was timed): any of them more than 2x off, either way."""
    clock = ClockScales()
    clock.draft, clock.plain = draft, plain
    assert clock.stale() is stale


def test_a_turn_needs_short_cycles_in_a_row_under_the_chance():
    """By hand: estimates of 0.9 at every position; a cycle of 4 that accepts nothing had a 0.1 chance, two in a
    row 0.01 < 0.03: a turn (one alone is not); a cycle reaching the median in between breaks the run."""
    estimates = AcceptanceEstimates(3, prior=[0.9] * 3, prior_weight=100.0)
    turns = TurnDetector(estimates, turn_p=0.03)
    turns.observe_cycle(4, 0, [0.9] * 3, None)
    assert turns.shortfall == pytest.approx(0.1) and not turns.turned
    turns.observe_cycle(4, 3, [0.5] * 3, None)  # every draft accepted: the run is broken
    assert turns.shortfall == 1.0 and turns.reference is None
    turns.observe_cycle(4, 0, [0.9] * 3, None)
    turns.observe_cycle(4, 0, [0.2] * 3, None)  # judged on the estimates before the run: 0.9
    assert turns.shortfall == pytest.approx(0.01) and turns.turned
    calm = TurnDetector(estimates, turn_p=0.03)
    for _ in range(2):  # rows that expected the misses (calibrated 0.3): 0.7 each, no surprise
        calm.observe_cycle(4, 0, [0.9] * 3, [0.3] * 3)
    assert calm.shortfall == 1.0 and not calm.turned


def test_shadow_scores_count_each_position_as_far_as_it_is_reached():
    """By hand, decay 0.5: a position counts as reached with P(the drafts before it accepted), so past a
    rejection it only decays (a cycle never sees past one); single acceptances do not count."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(5, decay=0.5))
    policy.observe_shadow([1, 1, 0, 0], [1, 1, 0, 1])  # T = 0: drafts 1-2 right, 3 wrong, 4 right on its own
    assert policy.estimates.seen == [1, 1, 1, 0] and policy.estimates.hits == [1, 1, 0, 0]
    policy.observe_shadow([0.6, 0.3, 0.1, 0.05], [0.6, 0.5, 0.5, 0.5])  # T > 0: reached with P(chain before)
    assert policy.estimates.seen == pytest.approx([0.5 + 1, 0.5 + 0.6, 0.5 + 0.3, 0.0 + 0.1])
    assert policy.estimates.hits == pytest.approx([0.5 + 0.6, 0.5 + 0.3, 0.0 + 0.1, 0.0 + 0.05])


def test_draft_acceptance_at_t0_is_the_drafts_leading_and_single_matches():
    drafts = mx.array([5, 6, 9, 8], mx.uint32)
    proposal = Proposal(drafts, None, None, mx.array(True))
    tokens, logits = mx.array([5, 6, 7, 8, 3], mx.uint32), mx.zeros((5, 16))
    assert draft_acceptance(proposal, tokens, logits, SamplingParams()).tolist() == [[1, 1, 0, 0], [1, 1, 0, 1]]
    assert draft_acceptance(proposal, tokens[:2], logits, SamplingParams()).tolist() == [[1, 1], [1, 1]]
    broken = proposal._replace(finite=mx.array(False))
    assert draft_acceptance(broken, tokens, logits, SamplingParams()).tolist() == [[0] * 4] * 2


@pytest.mark.parametrize("seed", [0, 1])
def test_draft_acceptance_at_t_above_0_is_unbiased_for_the_chain_of_acceptances(seed):
    """The exact law, by enumeration over a 4-token vocabulary and 3 drafts: a target whose distribution
    depends on everything before it, drafts drawn from fixed q_i (a v1 drafter's). The true P(drafts 1..i
    accepted) sums over every draft path q(d) * prod min(1, p/q); the shadow estimate, averaged over the
    tokens plain decoding draws (t ~ p), must equal it at every position."""
    rng = np.random.default_rng(seed)
    V, n = 4, 3
    table = {}

    def p(prefix):  # the target's distribution after a prefix of drawn tokens
        if prefix not in table:
            table[prefix] = rng.dirichlet(np.ones(V) * 0.7)
        return table[prefix]

    q = rng.dirichlet(np.ones(V), size=n)
    q[1, 2] = 0.0  # a token the drafter never proposes at position 2
    q[1] /= q[1].sum()
    # P(drafts 1..i accepted) = sum over d_1..d_i of prod_j q_j(d_j) min(1, p_j(d_j | d_<j) / q_j(d_j))
    true = np.zeros(n)
    for i in range(n):
        for d in itertools.product(range(V), repeat=i + 1):
            true[i] += math.prod(min(q[j, d[j]], p(d[:j])[d[j]]) for j in range(i + 1))
    params = SamplingParams(temperature=1.0)
    candidates = mx.broadcast_to(mx.arange(V)[None], (n, V))
    proposal = Proposal(mx.zeros((n,), mx.uint32), candidates, mx.array(q, mx.float32), mx.array(True))
    estimate = np.zeros(n)
    for t in itertools.product(range(V), repeat=n):
        law = math.prod(p(t[:j])[t[j]] for j in range(n))
        logits = mx.array(np.log(np.stack([p(t[:j]) for j in range(n)]) + 1e-30), mx.float32)
        chain, single = draft_acceptance(proposal, mx.array(t, mx.uint32), logits, params).tolist()
        assert single[0] == pytest.approx(np.minimum(p(())[:], q[0]).sum(), abs=1e-5)
        estimate += law * np.array(chain)
    assert np.allclose(estimate, true, atol=1e-5), (estimate, true)
    assert true[0] > true[1] > true[2] > 0


def test_a_drafter_accepting_everything_never_runs_plain_steps():
    """No plain step before the first choice, none after it: a drafter whose every draft is accepted drafts all
    40 cycles, from the largest block on once the first cycle has shown it."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    blocks = []
    for _ in range(40):
        B = policy.next_block(None)
        blocks.append(B)
        policy.observe_cycle(B, B - 1, COSTS.passes_s(B))
    assert min(blocks) > 1 and blocks[1:] == [8] * 39
    assert policy.plain_run(left=2) == 2  # never past max_tokens


def test_misses_as_usual_keep_drafting_and_a_turn_stops_it():
    """The long memory decides while drafting: a drafter whose first draft is right about half the time (and
    the drafts after it mostly, which pays) misses twice in a row, three times over, and drafts on; one right
    every time that misses two or three times in a row (under a 3% chance on its record) has turned, and the
    recent memory takes over: plain steps. (The script's outcomes fit the blocks chosen at undiscounted prices: at
    the entry discount its first cycle verifies 4, accepts all three, and the record that follows reads as a turn.)"""
    half = AdaptiveBlocks(COSTS, AdaptiveConfig(8, entry_discount=1.0))
    for a in [4, 0, 5, 3, 0, 0, 6, 4, 0, 0, 5, 0, 0]:
        B = half.next_block(None)
        assert B > 1
        half.observe_cycle(B, min(a, B - 1), COSTS.passes_s(B))
    assert half.next_block(None) > 1
    misses = misses_after_a_perfect_record()
    assert 2 <= misses <= 3
    # control: without the turn (a chance no run of misses falls under) the long memory takes longer
    assert misses_after_a_perfect_record(turn_p=0.0) > misses + 1


def misses_after_a_perfect_record(missed_on: list[float] | None = None, **kw) -> int:
    """Cycles accepting nothing that a policy drafts, after six that accepted every draft, before plain steps.
    `missed_on`: the misses' row confidences (the record's: sure rows); None: cycles without confidences."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8, **kw))
    for _ in range(6):
        B = policy.next_block(None)
        B = policy.verified_block(B, None if missed_on is None else mx.array([0.95] * 7), None)
        policy.observe_cycle(B, B - 1, COSTS.passes_s(B))
    misses = 0
    while (B := policy.next_block(None)) > 1 and misses < 100:
        B = policy.verified_block(B, None if missed_on is None else mx.array(missed_on), None)
        if B == 1:  # not even the first draft worth verifying: scored by the token committed
            policy.observe_unverified(0.0, COSTS.passes_s(1, 8))
        else:
            policy.observe_cycle(B, 0, COSTS.passes_s(B))
        misses += 1
    return misses


def test_a_verified_draft_counts_its_outcome_and_calibrates_its_rows_confidence():
    """By hand, two cycles (decay 0.5, calibration decay 0.9, the calibration's prior two drafts at confidence 1):
    each position reached counts its outcome, and its row's confidence and outcome go to the calibration; a
    position not reached neither counts nor decays."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(5, decay=0.5, calibration_decay=0.9))
    policy.verified_block(5, mx.array([0.8, 0.6, 0.4, 0.2]), None)
    policy.observe_cycle(5, 1, 0.1)  # draft 1 accepted, draft 2 rejected
    assert policy.estimates.hits == [1.0, 0.0, 0.0, 0.0] and policy.estimates.seen == [1.0, 1.0, 0.0, 0.0]
    assert policy.calibration.hits == pytest.approx([2 * 0.9 + 1, 2 * 0.9, 2.0, 2.0])
    assert policy.calibration.sums == pytest.approx([2 * 0.9 + 0.8, 2 * 0.9 + 0.6, 2.0, 2.0])
    policy.verified_block(5, mx.array([0.5, 0.5, 0.5, 0.5]), None)
    policy.observe_cycle(5, 0, 0.1)  # draft 1 rejected
    assert policy.estimates.hits == pytest.approx([0.5, 0.0, 0.0, 0.0])
    assert policy.estimates.seen == [1.5, 1.0, 0.0, 0.0]
    assert policy.calibration.measured == pytest.approx([1.9, 1.0, 0.0, 0.0])
    # the next rows read through the calibration: confidence x accepted / confidence so far, at most 1
    first = 0.5 * (0.9 * 2.8 + 0) / (0.9 * 2.6 + 0.5)
    second = min(1.0, 0.5 * 1.8 / 2.4)
    assert policy.calibration.calibrated([0.5, 0.5]) == pytest.approx([first, second])


def test_misses_the_drafter_saw_coming_are_no_turn():
    """A drafter right every time, then missing: where its rows were sure of the misses it has turned (as
    without confidences; the turn forgets its cycles' gains too, which would otherwise keep it drafting); where
    they were unsure (its first draft's row at 0.2: verified, seldom accepted), it said so itself, and the long
    memory decides as if no turn were ever detected; so too where they were too unsure to verify (0.05: the
    misses are the unverified drafts' scores)."""
    sure = [0.95] * 7
    assert misses_after_a_perfect_record(sure) == misses_after_a_perfect_record() <= 3
    for unsure in ([0.2] + sure[1:], [0.05] + sure[1:]):
        assert misses_after_a_perfect_record(unsure) == misses_after_a_perfect_record(unsure, turn_p=0.0) > 3 + 1


def test_evidence_of_an_accepting_drafter_reaches_the_largest_block_within_three_cycles():
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    blocks = []
    for _ in range(3):
        B = policy.next_block(None)
        if B == 1:
            policy.plain_run(None)
            policy.observe_shadow([1.0] * 7, [1.0] * 7)
            continue
        blocks.append(B)
        policy.observe_cycle(B, B - 1, COSTS.passes_s(B))
    assert blocks[-1] == 8 and policy.next_block(None) == 8
    assert policy.next_block(left=3) == 3  # never drafts past max_tokens


def rarely_right_but_sure(policy: AdaptiveBlocks, seed: int, tokens: int = 600) -> tuple[float, int]:
    """A drafter right after one anchor in eight (at random, seeded) and sure of it there (its rows at 0.95, every
    draft right), unsure and wrong elsewhere (0.05: not worth verifying), decoded for `tokens` tokens, probes
    scored alike. Returns the committed tokens per second on COSTS, counted here, and how many times `next_block`
    drafted where the averaged estimates said plain steps."""
    rng = random.Random(seed)
    right = [rng.random() < 1 / 8 for _ in range(tokens + 64)]
    position, seconds, drafted_on = 0, 0.0, 0
    while position < tokens:
        averaged = policy.drafting_vs_plain(policy.rates(8, entering=not policy.drafting))  # as `next_block` prices
        B = policy.next_block(None)
        drafted_on += B > 1 and averaged < 1
        r, rows = right[position], [0.95 if right[position] else 0.05] * 7
        if B == 1:  # a plain run after its probe
            run = policy.plain_run(None)
            policy.observe_shadow([float(r)] * 7, [float(r)] * 7, rows)
            position, seconds = position + run, seconds + run * COSTS.verify_s[0] + COSTS.draft_s[-1]
            continue
        B = policy.verified_block(B, mx.array(rows), None)
        if B == 1:
            policy.observe_unverified(float(r), COSTS.passes_s(1, 8))
        else:
            policy.observe_cycle(B, B - 1 if r else 0, COSTS.passes_s(B, 8))
        position, seconds = position + (B if r else 1), seconds + COSTS.passes_s(B, 8)
    return position / seconds, drafted_on


def test_while_drafting_the_cycles_expected_gains_keep_it_drafting_where_the_averaged_estimates_would_not():
    """A drafter right after one anchor in eight, and sure of it there, averages a first-draft acceptance (1/8) at
    which a block of 8 commits 1 + 7/8 tokens in 0.153 s, under plain steps' rate; yet drafting on, verifying its
    sure blocks whole and none of its unsure ones, commits 15 tokens in 0.153 + 7 x 0.102 s, 1.2x plain steps.
    The expected gains of its cycles and probes say so: it drafts on where the averaged estimates say plain steps,
    and commits more per second than plain steps and than the policy without the gains (the control: the test
    fails on the rule without them)."""
    plain_rate = 1 / COSTS.verify_s[0]
    assert 1 + 7 / 8 < plain_rate * COSTS.passes_s(8, 8)
    assert 15 / (COSTS.passes_s(8, 8) + 7 * COSTS.passes_s(1, 8)) > 1.2 * plain_rate

    class Averaged(AdaptiveBlocks):  # the control: no gain ever counted
        def _count_gain(self, gain):
            pass

    runs = [rarely_right_but_sure(AdaptiveBlocks(COSTS, AdaptiveConfig(8)), seed) for seed in range(3)]
    controls = [rarely_right_but_sure(Averaged(COSTS, AdaptiveConfig(8)), seed) for seed in range(3)]
    assert all(drafted_on >= 20 for _, drafted_on in runs) and all(d == 0 for _, d in controls)
    rates, control_rates = [r / plain_rate for r, _ in runs], [r / plain_rate for r, _ in controls]
    assert all(r > c for r, c in zip(rates, control_rates)), (rates, control_rates)
    assert sum(rates) / 3 > 1.04 and sum(rates) > 1.05 * sum(control_rates), (rates, control_rates)


def test_a_cycles_gain_counts_once_the_calibration_is_measured():
    """The gains rest on calibrated confidences: the first cycle's (the calibration the prior alone) does not count,
    so a drafter sure of wrong drafts from the start stops after one cycle, as without the gains; the next cycle's
    counts the brute-force expected tokens of its best choice less what plain steps commit in its time."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    sure = [0.95] * 7
    B = policy.verified_block(policy.next_block(None), mx.array(sure), None)
    assert B == 8 and policy.gain is None
    policy.observe_cycle(B, 0, COSTS.passes_s(B, 8))
    assert policy.next_block(None) == 1
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    policy.verified_block(8, mx.array(sure), None)
    policy.observe_cycle(8, 7, COSTS.passes_s(8, 8))
    plain_rate = 1 / (COSTS.verify_s[0] + COSTS.draft_s[-1] / policy.run)
    calibrated = [0.95 * (2 * 0.95 + 1) / (2 * 0.95 + 0.95)] * 7  # one accepted draft at 0.95 over the prior's two
    gains = [brute_force_expected(calibrated, n) - plain_rate * COSTS.passes_s(n, 8) for n in range(1, 9)]
    assert policy.verified_block(8, mx.array(sure), None) == 8 and policy.gain == pytest.approx(max(gains))


def test_running_plain_steps_a_cycle_is_priced_at_the_entry_discount_above_a_plain_step():
    """Estimates (the card's, weighted as 100 cycles) at which the best block commits under plain steps' rate on
    COSTS, but over it once a cycle's cost above a plain step counts at the entry discount: running plain steps,
    the policy drafts, at the block the discounted prices pick (and a probe with them ends its run); without the
    discount (1.0) it runs plain steps, and so it does at estimates under plain steps' rate even discounted."""
    discount = AdaptiveConfig(8).entry_discount
    plain_s = COSTS.verify_s[0] + COSTS.draft_s[-1] / 8  # a plain step and its share of a probe (a run of 8)

    def by_hand(policy, discount):  # tokens per second over plain steps' at each block, from COSTS and the estimates
        rates = {}
        for B in range(2, 9):
            cycle = COSTS.verify_s[B - 1] + COSTS.draft_s[-1]  # every cycle's drafter pass proposes a block of 8
            price = COSTS.verify_s[0] + discount * (cycle - COSTS.verify_s[0])
            rates[B] = brute_force_expected(policy.acceptance(), B) / price * plain_s
        return rates

    def policy(acceptance, discount=discount):
        return AdaptiveBlocks(
            COSTS, AdaptiveConfig(8, prior=[acceptance] * 7, prior_weight=100.0, entry_discount=discount)
        )

    near = policy(0.36)
    discounted, undiscounted = by_hand(near, discount), by_hand(near, 1.0)
    assert max(undiscounted.values()) < 1 < max(discounted.values())  # the premise
    assert near.drafting_wins(None) and near.next_block(None) == max(discounted, key=discounted.get)
    control = policy(0.36, discount=1.0)
    assert not control.drafting_wins(None) and control.next_block(None) == 1
    far = policy(0.25)
    assert max(by_hand(far, discount).values()) < 1
    assert not far.drafting_wins(None) and far.next_block(None) == 1


def test_a_losing_drafter_gets_plain_runs_each_after_a_shadow_probe_and_comes_back_when_it_accepts():
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    B = policy.next_block(None)
    while B > 1:  # cycles that accept nothing, until plain steps win
        policy.observe_cycle(B, 0, COSTS.passes_s(B))
        B = policy.next_block(None)
    runs = []
    for _ in range(6):
        runs.append(policy.plain_run(None))
        policy.observe_shadow([0.0] * 7, [0.0] * 7)
        assert policy.next_block(None) == 1
    # a decision after every run; where a run follows a run, it doubles, up to three times the block
    assert runs == [8, 16, 24, 24, 24, 24]
    policy.plain_run(None)
    policy.observe_shadow([1.0] * 7, [1.0] * 7)  # the drafter accepts again: probes say so
    policy.observe_shadow([1.0] * 7, [1.0] * 7)
    B = policy.next_block(None)
    assert B > 1
    policy.observe_cycle(B, B - 1, COSTS.passes_s(B))
    while B > 1:  # and stops again: the first run after a cycle is short again
        policy.observe_cycle(B, 0, COSTS.passes_s(B))
        B = policy.next_block(None)
    assert policy.plain_run(None) == 8


def test_slow_cycles_observed_online_turn_drafting_off():
    """Measured costs say drafting pays; the cycles actually timed say it does not (a long context, a busy
    machine): the observed times win."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    for _ in range(4):
        B = policy.next_block(None)
        policy.observe_cycle(B, 2, COSTS.passes_s(B))
    assert policy.next_block(None) > 1
    policy.observe_plain(16, 16 * COSTS.verify_s[0])
    for _ in range(8):
        B = policy.next_block(None)
        if B == 1:
            break
        policy.observe_cycle(B, 2, 4 * COSTS.passes_s(B))
    assert B == 1


def test_a_cycles_one_off_costs_do_not_set_the_time_scale():
    """A cycle right after plain steps feeds the drafter their rows in bulk, and the first cycle at a block size
    traces it: both are slow once. Their acceptance counts; their time does not, or a first cycle 10x its steady
    cost would keep the drafter off. Later cycles at the same size set the scale."""
    policy = AdaptiveBlocks(COSTS, AdaptiveConfig(8))
    policy.observe_plain(policy.plain_run(4), 4 * COSTS.verify_s[0])
    policy.observe_shadow([1.0] * 3, [1.0] * 3)
    policy.observe_shadow([1.0] * 3, [1.0] * 3)
    assert policy.next_block(None) > 1
    policy.observe_cycle(5, 4, 10 * COSTS.passes_s(5))  # after plain steps
    assert policy.clock.draft is None and policy.acceptance()[0] > 0.8
    B = policy.next_block(None)
    assert B == 8  # drafting still pays on the measured costs (scaled as plain steps are)
    policy.observe_cycle(B, B - 1, 3 * COSTS.passes_s(B))  # the first cycle at B
    assert policy.clock.draft is None
    policy.observe_cycle(B, B - 1, 2 * COSTS.passes_s(B))
    policy.observe_cycle(B, B - 1, 1 * COSTS.passes_s(B))
    d = policy.config.decay
    assert policy.clock.draft == pytest.approx(d * 2 + (1 - d) * 1)  # steady cycles, mixed with weight `decay`
    policy.plain_run(None)  # plain steps again: the next cycle is one-off
    policy.observe_cycle(B, 4, 10 * COSTS.passes_s(B))
    policy.observe_cycle(5, 4, 10 * COSTS.passes_s(5))  # the first steady cycle at 5 after its traced one
    steady = d * (d * 2 + (1 - d) * 1) + (1 - d) * 10
    assert policy.clock.draft == pytest.approx(steady)
    policy.plain_run(None)
    policy.observe_cycle(5, 4, 10 * COSTS.passes_s(5))
    assert policy.clock.draft == pytest.approx(steady)


def test_the_card_prior_seeds_the_policy(tmp_path, monkeypatch):
    """A drafter folder's card field is read at load (`load_drafter`) and adaptive mode starts from it: a card
    that says the drafter accepts starts at the largest block, one that says it does not starts plain."""
    model = make_target("qwen3", seed=1)
    costs = CostModel(COSTS.verify_s[:4], COSTS.draft_s[:3])
    monkeypatch.setattr(generate_module, "load_or_measure_costs", lambda target, drafter, B: costs)
    folder = save_drafter(tmp_path / "d", make_drafter(model, block_size=4))
    assert load_drafter(str(folder)).acceptance_prior is None  # no card: neutral
    for prior, first in [([0.95, 0.95, 0.95], 4), ([0.05, 0.05, 0.05], 1)]:
        (folder / "card.json").write_text(json.dumps({"heldout_tau": 2.0, ACCEPTANCE_FIELD: prior}))
        drafter = load_drafter(str(folder))
        assert drafter.acceptance_prior.tolist() == prior
        target = bind_drafter(drafter, model)
        policy = generate_module.block_policy(target, drafter, 4, "adaptive")
        assert policy.acceptance()[0] == pytest.approx((3 * prior[0] + 0.5) / 4)
        assert policy.next_block(None) == first


@pytest.fixture
def measured(monkeypatch):
    decide_on(monkeypatch, COSTS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama_swa"])
def test_adaptive_is_lossless(arch, tokenizer, measured):
    model = make_target(arch, seed=5)
    for i, prompt in enumerate(prompts(2, seed=8)):
        plain, _, _ = run(model, tokenizer, prompt, max_tokens=60, eos_token_ids=[])
        drafters = [
            make_drafter(model, block_size=8, seed=1),
            make_dflash2_drafter(model, block_size=8),
            make_oracle(model, prompt, block_size=8, spoil_seed=i),
            make_oracle(model, prompt, block_size=8),
            make_oracle(model, prompt, block_size=8, right_for=25),
            make_oracle(model, prompt, block_size=8, right_between=(10, 30)),
        ]
        for drafter in drafters:
            r = generate(model, tokenizer, prompt, drafter, verify_mode="adaptive", max_tokens=60, eos_token_ids=[])
            assert r.tokens == plain, f"{arch} prompt {i} {type(drafter).__name__}"
            # every token accounted for (the last cycle may be cut short by max_tokens)
            assert 60 <= r.plain_tokens + sum(r.accepted) + r.cycles + 1 < 60 + 8


def test_the_oracle_gets_the_largest_block_within_three_cycles(tokenizer, measured):
    """Every draft accepted: by its third cycle it drafts the largest block (8), and stays there."""
    model = make_target("qwen3", seed=6)
    prompt = prompts(1, seed=3)[0]
    records = list(
        generate_module.stream_cycles(
            model,
            tokenizer,
            prompt,
            make_oracle(model, prompt, 8),
            verify_mode="adaptive",
            max_tokens=80,
            eos_token_ids=[],
        )
    )
    blocks = [r.block_size for r in records[1:-1]]  # the last cycle may be shortened by max_tokens
    cycles = [b for b in blocks if b > 1]
    assert 8 in cycles[:3] and cycles[cycles.index(8) :] == [8] * len(cycles[cycles.index(8) :])
    assert len(cycles) >= 8 and all(r.accepted == r.block_size - 1 for r in records[1:-1] if r.block_size > 1)


def test_an_unsure_drafter_that_is_always_right_goes_unverified_until_its_confidence_is_trusted(
    tokenizer, measured, monkeypatch
):
    """An oracle whose rows give its drafts probability 0.05 (a first draft's place in the verify costs more than
    that buys): its first drafts go unverified, each scored by the token the cycle commits; right every time, its
    calibrated confidence rises until they are worth verifying, and then they are accepted. Greedy-identical
    throughout. A score that never credited an unverified draft would leave them all unverified."""
    model = make_target("qwen3", seed=6)
    prompt = prompts(1, seed=3)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=60, eos_token_ids=[])
    chosen = []

    class Recorded(AdaptiveBlocks):
        def verified_block(self, B, confidence, left):
            chosen.append(super().verified_block(B, confidence, left))
            return chosen[-1]

    monkeypatch.setattr(
        generate_module, "block_policy", lambda target, drafter, B, mode, costs=None: Recorded(COSTS, AdaptiveConfig(B))
    )
    oracle = make_oracle(model, prompt, block_size=8, logit_scale=2.6)
    records = list(
        generate_module.stream_cycles(
            model, tokenizer, prompt, oracle, verify_mode="adaptive", max_tokens=60, eos_token_ids=[]
        )
    )
    assert [t for r in records for t in r.tokens] == plain
    trusted = next((i for i, B in enumerate(chosen) if B > 1), len(chosen))
    assert 3 <= trusted <= 10 and chosen[:trusted] == [1] * trusted, chosen
    cycles = [r for r in records[:-1] if r.block_size is not None and r.block_size > 1]
    assert len(cycles) >= 5 and all(r.accepted == r.block_size - 1 for r in cycles)


def test_a_drafter_right_only_inside_a_stretch_drafts_there_and_not_outside(tokenizer, measured):
    """Right only while the output is between tokens 40 and 90 (a passage copied from the prompt), wrong
    everywhere else: adaptive mode drafts through most of the stretch, found by a shadow probe, and outside it
    spends no more than a few cycles before plain steps again."""
    lo, hi = 40, 90
    model = make_target("llama", seed=7)
    prompt = prompts(1, seed=6)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=140, eos_token_ids=[])
    oracle = make_oracle(model, prompt, block_size=8, right_between=(lo, hi))
    records = list(
        generate_module.stream_cycles(
            model, tokenizer, prompt, oracle, verify_mode="adaptive", max_tokens=140, eos_token_ids=[]
        )
    )
    assert [t for r in records for t in r.tokens] == plain
    inside, before, after, drafted_inside, committed = 0, 0, 0, 0, 0
    for r in records:
        if r.block_size is not None and r.block_size > 1:
            anchor = committed - 1  # the cycle drafts after its anchor, the last token committed before it
            if lo <= anchor < hi:
                inside += 1
                drafted_inside += len(r.tokens)
            elif anchor < lo:
                before += 1
            else:
                after += 1
        committed += len(r.tokens)
    # before it, the card's first choice (a cycle); after it, two or three that find it over (see
    # test_misses_as_usual_keep_drafting_and_a_turn_stops_it)
    assert before <= 1 and after <= 3, (before, after)
    assert inside >= 5 and drafted_inside >= 0.6 * (hi - lo), (inside, drafted_inside)
    shadows = [r.shadow for r in records if r.shadow is not None]
    assert shadows and all(len(s) == 7 for s in shadows[:-1])


@pytest.mark.parametrize(
    "plain_off, cycle_off, stale",
    [(1.0, 1.3, False), (0.1, 0.1, True), (5.0, 5.0, True), (1.0, 3.0, True), (1.8, 1.0, False)],
)
def test_costs_off_by_more_than_the_ratio_are_measured_again(
    tmp_path, monkeypatch, tokenizer, plain_off, cycle_off, stale
):
    """A cost model measured while the machine was busy (or before it changed) is dropped from the cache
    when a generation's timed plain steps, or its cycles relative to them, are more than 2x off it; the
    next generation measures again. Timings within 2x keep it. (The drafter is the oracle: cycles are timed
    only once they are steady, which a drafter that never accepts never reaches.)"""
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    model = make_target("qwen3", seed=1)
    prompt = prompts(1, seed=2)[0]
    drafter = make_oracle(model, prompt, block_size=4)
    key = costs_module.cost_key(bind_drafter(drafter, model), drafter, 4)
    costs = CostModel(COSTS.verify_s[:4], COSTS.draft_s[:3])
    (tmp_path / "costs.json").write_text(
        json.dumps(
            {
                key: {"verify_s": costs.verify_s, "draft_s": costs.draft_s},
                "another machine": {"verify_s": [1.0], "draft_s": []},
            }
        )
    )
    cycle, plain = AdaptiveBlocks.observe_cycle, AdaptiveBlocks.observe_plain
    monkeypatch.setattr(
        AdaptiveBlocks,
        "observe_cycle",
        lambda self, B, a, s: cycle(self, B, a, cycle_off * plain_off * costs.passes_s(B)),
    )
    monkeypatch.setattr(
        AdaptiveBlocks, "observe_plain", lambda self, n, s, probes=0: plain(self, n, plain_off * n * costs.verify_s[0])
    )
    generate(model, tokenizer, prompt, drafter, verify_mode="adaptive", max_tokens=60, eos_token_ids=[])
    kept = json.loads((tmp_path / "costs.json").read_text())
    assert (key not in kept) == stale and "another machine" in kept
    if stale:
        monkeypatch.setattr(costs_module, "measure_costs", lambda *a, **k: costs)
        load_or_measure_costs(bind_drafter(drafter, model), drafter, 4)
        assert key in json.loads((tmp_path / "costs.json").read_text())


@pytest.mark.parametrize("cut", [True, False])
def test_a_plain_run_ends_where_its_probe_says_drafting_pays(tokenizer, measured, monkeypatch, cut):
    """A first plain run of 16 steps whose probe (7 drafts, all right: the oracle) is scored at the run's 7th
    token: the run ends there, the step already in flight commits one more token, and the next record is a
    cycle. Control: with the early end switched off the run takes all 16 steps."""
    model = make_target("qwen3", seed=6)
    prompt = prompts(1, seed=3)[0]
    monkeypatch.setattr(
        generate_module,
        "block_policy",
        lambda target, drafter, B, mode, costs=None: AdaptiveBlocks(
            COSTS, AdaptiveConfig(B, prior=[0.0] * (B - 1), prior_weight=1.0, plain_run_max=16)
        ),
    )
    if not cut:
        monkeypatch.setattr(AdaptiveBlocks, "drafting_wins", lambda self, left: False)
    records = list(
        generate_module.stream_cycles(
            model,
            tokenizer,
            prompt,
            make_oracle(model, prompt, 8),
            verify_mode="adaptive",
            max_tokens=40,
            eos_token_ids=[],
            copyspec_mode="off",
        )
    )  # runs ended by probes alone
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=40, eos_token_ids=[])
    assert [t for r in records for t in r.tokens] == plain
    first_cycle = next(i for i, r in enumerate(records) if r.block_size and r.block_size > 1)
    probed = [i for i, r in enumerate(records) if r.shadow is not None]
    assert probed[0] == 7 and records[7].shadow == [1.0] * 7
    assert first_cycle == (1 + 7 + 1 if cut else 1 + 16 + 1)  # the prefill's token, the run, the step in flight
    assert all(r.block_size == 1 for r in records[1:first_cycle])


def test_calibration_probes_are_evenly_spaced_even_when_they_say_drafting_pays(tokenizer):
    """`ShadowBlocks` (the bench's calibration of shadow probes against fixed-block cycles) never cuts a run: with
    the oracle every probe says drafting pays, and still each run is the whole block, so good stretches are not
    probed more often than the text has them."""
    model = make_target("qwen3", seed=6)
    prompt = prompts(1, seed=3)[0]
    drafter = make_oracle(model, prompt, 8)
    policy = adaptive.ShadowBlocks(COSTS, AdaptiveConfig(8))
    steps = itertools.islice(
        decode.dflash_steps(
            bind_drafter(drafter, model), drafter, mx.array(prompt, mx.uint32), SamplingParams(), policy, 60
        ),
        41,
    )
    probed = [i for i, step in enumerate(steps) if step.shadow is not None]
    assert probed == [7, 15, 23, 31, 39]  # each run of 8: its probe scored at its 7th token
    assert AdaptiveBlocks.drafting_wins(policy, None)  # what an adaptive run would have cut at


def test_a_probes_score_is_queued_before_the_next_plain_step(tokenizer, monkeypatch):
    """Reading a probe's score waits for everything queued before it: queued after the next plain step, the read
    waited for that step too and the device then idled while the host chose (the step that read the score took
    ~1.2 plain steps). So the score of a run's 7th token is queued when 7 plain steps have been dispatched since
    the prefill, not 8: runs of 8 (`ShadowBlocks`) put the scores at 7, 15, 23, ... dispatches."""
    model = make_target("qwen3", seed=6)
    prompt = prompts(1, seed=3)[0]
    drafter = make_oracle(model, prompt, 8)
    dispatched, at_score = [], []
    step, score = decode._plain_step, decode.draft_acceptance
    monkeypatch.setattr(decode, "_plain_step", lambda *a: dispatched.append(1) or step(*a))
    monkeypatch.setattr(decode, "draft_acceptance", lambda *a: at_score.append(len(dispatched)) or score(*a))
    policy = adaptive.ShadowBlocks(COSTS, AdaptiveConfig(8))
    steps = itertools.islice(
        decode.dflash_steps(
            bind_drafter(drafter, model), drafter, mx.array(prompt, mx.uint32), SamplingParams(), policy, 60
        ),
        41,
    )
    assert [i for i, s in enumerate(steps) if s.shadow is not None] == [7, 15, 23, 31, 39]
    assert at_score == [7, 15, 23, 31, 39]


class RightOnlyFromFullBlocks:
    """Wraps an oracle drafter: right (the oracle's drafts) in blocks of its trained size, wrong in any smaller
    block, as a block-diffusion drafter drafts worse out of the block size it was trained at. Records the
    size of every block it is given."""

    def __init__(self, oracle):
        self.oracle, self.sizes = oracle, []
        self.full = oracle.config.block_size
        oracle.draft_rows = self.draft_rows

    def draft_rows(self, block, context, cache):
        hidden, logits = type(self.oracle).draft_rows(self.oracle, block, context, cache)
        self.sizes.append(block.shape[1])
        # every draft the token after the right one: wrong
        return hidden, logits if block.shape[1] == self.full else mx.roll(logits, 1, axis=-1)


def test_cycles_verifying_fewer_drafts_take_them_from_a_full_block(tokenizer, monkeypatch):
    """Where large blocks cost too much to verify, the policy picks B = 3 cycles; their two drafts are the
    first of a full block's (8), which this drafter gets right, and not a block of 3's, which it gets wrong:
    so every B = 3 cycle accepts both drafts. The loop proposing blocks of B fails this (no draft accepted)."""
    steep = CostModel(verify_s=[0.072, 0.080, 0.088, 0.40, 0.45, 0.50, 0.55, 0.60], draft_s=[0.030] * 7)
    decide_on(monkeypatch, steep)
    model = make_target("qwen3", seed=6)
    prompt = prompts(1, seed=3)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=60, eos_token_ids=[])
    drafter = RightOnlyFromFullBlocks(make_oracle(model, prompt, block_size=8))
    records = list(
        generate_module.stream_cycles(
            model, tokenizer, prompt, drafter.oracle, verify_mode="adaptive", max_tokens=60, eos_token_ids=[]
        )
    )
    assert [t for r in records for t in r.tokens] == plain
    cycles = [r for r in records[:-1] if r.block_size is not None and r.block_size > 1]  # the last may be cut
    assert len(cycles) >= 8 and {r.block_size for r in cycles} == {3}, [r.block_size for r in cycles]
    assert all(r.accepted == 2 for r in cycles), [r.accepted for r in cycles]
    assert set(drafter.sizes) == {8}  # probes and cycles alike
