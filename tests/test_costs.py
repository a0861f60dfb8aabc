"""Cost measurement (`dflash2_mlx/costs.py`): what a cycle costs on this machine, timed once and cached."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
from helpers import make_drafter, make_target

import dflash2_mlx.costs as costs_module
from dflash2_mlx.costs import load_or_measure_costs
from dflash2_mlx.loading import bind_drafter


def test_costs_are_measured_once_and_cached(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    model = make_target("qwen3", seed=1)
    drafter = make_drafter(model, block_size=4)
    target = bind_drafter(drafter, model)
    costs = load_or_measure_costs(target, drafter, 4)
    assert len(costs.verify_s) == 4 and len(costs.draft_s) == 3
    assert all(s > 0 for s in costs.verify_s + costs.draft_s)
    stored = json.loads((tmp_path / "costs.json").read_text())
    assert list(stored.values()) == [{"verify_s": costs.verify_s, "draft_s": costs.draft_s}]
    monkeypatch.setattr(costs_module, "measure_costs", lambda *a, **k: pytest.fail("measured twice"))
    assert load_or_measure_costs(target, drafter, 4) == costs
    with pytest.raises(pytest.fail.Exception, match="measured twice"):
        load_or_measure_costs(target, drafter, 3)  # another block range is another measurement


def test_another_job_starting_during_the_measurement_keeps_the_curves_shape(monkeypatch):
    """Timed in rounds, every size once per round, the best of each keeps the true ratios when the machine
    gets 2x slower halfway through the measurement (another job starting). Timed size after size, as before,
    every size timed after that moment would look 2x dearer, and the cost model turn against longer blocks."""
    true = [1.0, 1.2, 1.3, 1.5, 1.5, 1.6, 1.6, 1.7]  # in plain steps
    halfway = 6 * sum(true) / 2  # a warm-up and five timed calls each
    clock = [0.0]

    def call(cost):
        clock[0] += cost * (1 if clock[0] < halfway else 2)

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock[0])
    calls = [partial(call, c) for c in true]
    together = costs_module._best_seconds(calls, repeats=5)
    assert np.allclose(np.divide(together, together[0]), true)
    clock[0] = 0.0
    one_at_a_time = [costs_module._best_seconds([fn], repeats=5)[0] for fn in calls]  # the old order
    assert np.allclose(np.divide(one_at_a_time, one_at_a_time[0])[5:], 2 * np.array(true[5:]))  # those after it


def test_a_tree_verify_curve_reaches_past_the_block(tmp_path, monkeypatch):
    """ddtree's costs: the drafter up to the block, the verify curve to 33 tokens (timed at 1..B, every fourth
    and the last, linear in between), cached apart from adaptive mode's."""
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    assert costs_module.verify_points(4, 33) == [1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 33]
    model = make_target("qwen3", seed=1)
    drafter = make_drafter(model, block_size=4)
    target = bind_drafter(drafter, model)
    timed = []
    monkeypatch.setattr(
        costs_module, "_best_seconds", lambda fns, repeats: [fn() or timed.append(1) or 0.01 * len(timed) for fn in fns]
    )
    costs = load_or_measure_costs(target, drafter, 4, 33)
    assert len(costs.verify_s) == 33 and len(costs.draft_s) == 3 and costs.block_max == 4
    # timed values 0.01 * k at the k-th point: check the interpolation against NumPy's
    points = costs_module.verify_points(4, 33)
    expected = np.interp(np.arange(1, 34), points, [0.01 * (k + 1) for k in range(len(points))])
    assert np.allclose(costs.verify_s, expected)
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 1
    assert load_or_measure_costs(target, drafter, 4).verify_s != costs.verify_s  # adaptive's own entry
