"""The batched cost curve and the choice it makes (`batched_costs.py`): the plan against a brute-force search of
every block assignment, plain steps where cycles do not pay, the measurement and its cache."""

from __future__ import annotations

import itertools
import random

import mlx.core as mx
import pytest
from helpers import make_drafter, make_oracle, make_target
from mlx_lm.generate import generate_step

from dflash2_mlx import batched
from dflash2_mlx.adaptive import expected_tokens
from dflash2_mlx.batched import BatchedDecoder, load_or_measure_batched_costs, measure_batched_costs
from dflash2_mlx.batched_costs import BatchedCostModel, batch_points, block_points, plan
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.replay import record, replay_batched
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target


def curve(plain: float, per_token: float, per_request: float, draft: float, batch_max=8, block_max=6):
    """A forward over n tokens for k requests costing plain + per_token * (n - 1) * k + per_request * (k - 1)."""
    forward = [
        [plain + per_token * (n - 1) * k + per_request * (k - 1) for n in range(1, block_max + 1)]
        for k in range(1, batch_max + 1)
    ]
    return BatchedCostModel(forward, [draft] * (block_max - 1))


# weights-bound (a Mac): a forward over 6 tokens for 4 requests costs little more than a plain batched step
MAC = curve(0.020, 0.0004, 0.001, 0.004)
# compute-bound (this CPU): every token of every request costs nearly a plain step's
CPU = curve(0.020, 0.018, 0.015, 0.010)


def brute_force(costs, acceptances, lefts, drafting, block_max, lookups=None):
    """The best expected tokens per second over every assignment of blocks (1 for requests without drafts; a
    lookup's drafts need no drafter pass)."""
    k, best = len(acceptances), 0.0
    lookups = lookups or [False] * k
    choices = [range(1, min(block_max, left) + 1) if d else [1] for left, d in zip(lefts, drafting)]
    for blocks in itertools.product(*choices):
        n, j = max(blocks), sum(B > 1 and not lk for B, lk in zip(blocks, lookups))
        tokens = sum(expected_tokens(a, B) for a, B in zip(acceptances, blocks))
        best = max(best, tokens / costs.step(k, n, j))
    return best


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("costs", [MAC, CPU, curve(0.02, 0.004, 0.002, 0.006)], ids=["mac", "cpu", "between"])
def test_the_plan_is_the_best_assignment(costs, seed):
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    acceptances = [[rng.random() ** 0.5 for _ in range(5)] for _ in range(k)]
    lefts = [rng.choice([1, 2, 3, 100]) for _ in range(k)]
    drafting = [rng.random() < 0.8 for _ in range(k)]
    lookups = [d and rng.random() < 0.4 for d in drafting]  # drafts from a lookup: no drafter pass
    blocks, rate, plain = plan(costs, acceptances, lefts, drafting, 6, lookups)
    n, j = max(blocks), sum(B > 1 and not lk for B, lk in zip(blocks, lookups))
    assert rate == pytest.approx(
        sum(expected_tokens(a, B) for a, B in zip(acceptances, blocks)) / costs.step(k, n, j), rel=1e-12
    )
    assert rate == pytest.approx(brute_force(costs, acceptances, lefts, drafting, 6, lookups), rel=1e-9)
    assert plain == pytest.approx(k / costs.forward(k, 1))
    assert all(B == 1 or d and B <= left for B, left, d in zip(blocks, lefts, drafting))


def test_cycles_where_the_curve_pays_plain_steps_where_it_does_not():
    good, bad = [0.8] * 5, [0.05] * 5
    assert plan(MAC, [good] * 4, [100] * 4, [True] * 4, 6)[0] == [6] * 4
    assert plan(CPU, [good] * 4, [100] * 4, [True] * 4, 6)[0] == [1] * 4
    assert plan(MAC, [bad] * 4, [100] * 4, [True] * 4, 6)[0] == [1] * 4
    # on the Mac-like curve one request that drafts well verifies its block beside the others' plain steps
    blocks = plan(MAC, [good, bad, bad, bad], [100] * 4, [True] * 4, 6)[0]
    assert blocks[0] > 1 and blocks[1:] == [1, 1, 1]


def test_a_lookup_that_accepts_pays_where_a_drafter_pass_would_not():
    """Copy drafts cost no drafter pass: on a curve where a drafter's cycle does not pay, four requests whose
    lookups accept verify their blocks, and the plan prices them without a pass."""
    sure = [0.95] * 5
    costly = BatchedCostModel(MAC.forward_s, [0.2] * 5)  # a drafter pass worth ten plain batched steps
    assert plan(costly, [sure] * 4, [100] * 4, [True] * 4, 6)[0] == [1] * 4
    blocks, rate, plain = plan(costly, [sure] * 4, [100] * 4, [True] * 4, 6, [True] * 4)
    assert blocks == [6] * 4 and rate == pytest.approx(4 * expected_tokens(sure, 6) / costly.forward(4, 6))
    assert rate > plain


def test_past_the_measured_batch_the_forward_scales_with_the_requests():
    assert MAC.forward(16, 3) == pytest.approx(MAC.forward(8, 3) * 2)
    assert MAC.step(4, 3, 2) == pytest.approx(MAC.forward(4, 3) + 2 * MAC.draft_s[1])
    assert MAC.step(4, 1, 0) == MAC.forward(4, 1)


def test_a_measured_batched_drafter_pass_prices_the_drafting_requests_together():
    """Without a measured batched pass, j requests drafting cost j passes; with one, what it says (past the
    measured batch, in proportion to j)."""
    together = BatchedCostModel(MAC.forward_s, MAC.draft_s, [1.0, 1.2, 1.5])
    assert MAC.drafting(4, 3) == pytest.approx(3 * MAC.draft_s[2]) and MAC.drafting(1, 3) == 0.0
    assert together.drafting(4, 1) == pytest.approx(MAC.draft_s[2])
    assert together.drafting(4, 2) == pytest.approx(1.2 * MAC.draft_s[2])
    assert together.drafting(4, 6) == pytest.approx(1.5 * 2 * MAC.draft_s[2])
    assert together.step(4, 4, 2) == pytest.approx(MAC.forward(4, 4) + 1.2 * MAC.draft_s[2])
    # priced together, more requests draft on a curve where one pass each kept some of them plain
    acceptances = [[0.6] * 5] * 8
    blocks = [plan(costs, acceptances, [100] * 8, [True] * 8, 6)[0] for costs in (MAC, together)]
    assert sum(B > 1 for B in blocks[1]) > sum(B > 1 for B in blocks[0])


def test_points_timed():
    assert batch_points(8) == [1, 2, 4, 8] and batch_points(6) == [1, 2, 4, 6] and batch_points(1) == [1]
    assert block_points(16) == [1, 2, 3, 4, 8, 12, 16] and block_points(6) == [1, 2, 3, 4, 6]


def test_measured_on_a_tiny_target_and_cached(tmp_path, monkeypatch):
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    target = bind_drafter(drafter, model)
    costs = measure_batched_costs(target, drafter, 4, batch_max=3, context_tokens=16, repeats=1)
    assert len(costs.forward_s) == 3 and all(len(row) == 4 for row in costs.forward_s)
    assert all(a <= b for row in costs.forward_s for a, b in zip(row, row[1:]))  # never cheaper with more tokens
    assert len(costs.draft_s) == 3 and all(s > 0 for s in costs.draft_s)
    batch = costs.draft_batch  # one pass over k requests' blocks, in passes for one: never below 1, never falling
    assert len(batch) == 3 and batch[0] == 1.0 and all(a <= b for a, b in zip(batch, batch[1:]))
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setattr(batched, "measure_batched_costs", lambda *a, **k: costs)
    assert load_or_measure_batched_costs(target, drafter, 4, 3) == costs
    monkeypatch.setattr(batched, "measure_batched_costs", lambda *a, **k: pytest.fail("measured again"))
    assert load_or_measure_batched_costs(target, drafter, 4, 3) == costs


@pytest.mark.parametrize("costs, passes", [(MAC, 2), (CPU, 1)], ids=["mac", "cpu"])
def test_a_curve_where_no_draft_could_pay_is_measured_coarsely(costs, passes, tmp_path, monkeypatch):
    """The coarse pass first (batches 1, 2, 8; forwards of 1, 2, 6 tokens; one round); the whole grid only where
    drafts that are all accepted would pay: on the CPU-like curve a block of n costs more than n plain steps' worth
    of tokens, on the Mac-like one it costs little more than one."""
    perfect = [1.0] * 5
    for k in range(2, 9):  # the property the choice rests on, checked by brute force
        pays = any(k * n / costs.step(k, n, k) > k / costs.forward(k, 1) for n in range(2, 7))
        assert pays == (costs is MAC) and (max(plan(costs, [perfect] * k, [6] * k, [True] * k, 6)[0]) > 1) == pays
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=6)
    target = bind_drafter(drafter, model)
    calls = []

    def measure(*args, **kw):
        calls.append(kw.get("points"))
        return costs

    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setattr(batched, "measure_batched_costs", measure)
    assert load_or_measure_batched_costs(target, drafter, 6, 8) == costs
    assert calls[0] == ([1, 2, 8], [1, 2, 6]) and len(calls) == passes and (passes == 1 or calls[1] is None)


@pytest.mark.parametrize("costs", [MAC, CPU], ids=["mac", "cpu"])
def test_the_decoder_steps_as_the_curve_says(costs):
    """Sure, right drafts: the Mac-like curve runs cycles, the CPU-like one plain batched steps; the tokens are
    mlx-lm's greedy ones either way."""
    model = make_target("llama", seed=1)
    prompts = [[7, 8, 9], list(range(10, 30)), [200]]
    oracles = [make_oracle(model, p, block_size=6) for p in prompts]
    target = Target(model, oracles[0].config.target_layer_ids)
    out = {}
    with BatchedDecoder(target, None, 6, costs) as decoder:
        for p, o in zip(prompts, oracles):
            o.acceptance_prior = [0.9] * 5
            uid, first = decoder.add(p, SamplingParams(), drafter=o)
            out[uid] = list(first.tokens)
        while min(len(t) for t in out.values()) < 16:
            for uid, s in decoder.step().items():
                out[uid] += s.tokens
        rate, plain = decoder.last_plan
    for p, tokens in zip(prompts, out.values()):
        assert tokens[:16] == [t for (t, _), _ in zip(generate_step(mx.array(p), model), range(16))]
    if costs is MAC:
        assert decoder.batched_cycles > 0 and rate > plain
    else:
        assert decoder.batched_cycles == 0 and decoder.plain_steps > 0 and rate == plain


@pytest.mark.slow
@pytest.mark.parametrize("drafting", [True, False], ids=["cycles", "plain"])
def test_the_batched_replay_decides_and_times_as_the_decoder(drafting):
    """Four requests, three at a time, on the Mac-like curve: the replay of their recorded answers takes the
    decoder's steps (blocks chosen by `plan` from the same estimates, requests joining as one leaves) and times them
    at the curve, step by step."""
    model = make_target("llama", seed=1)
    prompts = [[7, 8, 9], list(range(10, 30)), [200], [31, 32]]
    spoilers = [{"wrong_every": 4}, {"right_between": (10, 30)}, {}, {"wrong_every": 3}]
    max_tokens, concurrency, prior = 40, 3, [0.9] * 5

    def oracle(i):
        o = make_oracle(model, prompts[i], block_size=6, **spoilers[i])
        o.acceptance_prior = prior
        return o

    traces = []
    for i, p in enumerate(prompts):
        o = oracle(i)
        traces.append(record(bind_drafter(o, model), o, p, max_tokens, [6]))
    o = oracle(0)
    target = Target(model, o.config.target_layer_ids)
    seconds, steps, waiting, produced, kinds = 0.0, 0, list(range(len(prompts))), {}, set()
    with BatchedDecoder(target, None, 6, MAC) as decoder:
        while waiting or produced:
            while waiting and len(produced) < concurrency:
                i = waiting.pop(0)
                uid, first = decoder.add(prompts[i], SamplingParams(), max_tokens, drafter=o if i == 0 else oracle(i))
                produced[uid] = (i, list(first.tokens))
            blocks = decoder.choose_blocks() if drafting else {uid: 1 for uid in produced}
            seconds += MAC.step(len(produced), max(blocks.values()), sum(B > 1 for B in blocks.values()))
            steps += 1
            kinds.add(tuple(sorted({min(B, 2) for B in blocks.values()})))
            for uid, s in decoder.step(blocks).items():
                produced[uid][1].extend(s.tokens)
                i, tokens = produced[uid]
                if len(tokens) >= max_tokens:
                    assert tokens[:max_tokens] == traces[i].tokens  # the answer recorded is the one decoded
                    decoder.remove(uid)
                    del produced[uid]
    out = replay_batched(traces, concurrency, MAC, 6, prior, drafting)
    assert (out.steps, out.cycles) == (steps, decoder.batched_cycles)
    assert out.seconds == pytest.approx(seconds) and out.tokens == len(prompts) * (max_tokens - 1)
    if drafting:  # steps where every request drafted and steps where some did not: the estimates decide
        assert {(2,), (1, 2)} <= kinds
        assert out.tokens_per_s > replay_batched(traces, concurrency, MAC, 6, prior, drafting=False).tokens_per_s
    else:
        assert decoder.batched_cycles == 0
