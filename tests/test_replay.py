"""Replaying block-size policies on recorded drafts (`replay.py`, `dflash2 bench --replay`): the replay makes the
decode loop's decisions exactly, and times them at the cost model."""

from __future__ import annotations

import importlib
import json

import pytest
from helpers import COSTS, decide_on, make_oracle, make_target, prompts

from dflash2_apps.replay import perturbed
from dflash2_mlx.adaptive import AdaptiveBlocks, AdaptiveConfig, FixedBlocks
from dflash2_mlx.costs import CostModel
from dflash2_mlx.generate import block_policy
from dflash2_mlx.loading import bind_drafter, load
from dflash2_mlx.replay import Trace, record, replay

generate_module = importlib.import_module("dflash2_mlx.generate")  # the package exports a function of that name


def test_fixed_blocks_replay_commits_and_times_each_cycle_by_hand():
    """Twelve tokens, drafts right everywhere but after token 3: counted by hand, cycle by cycle."""
    tokens = list(range(12))
    drafts = [[j + 1, j + 2] for j in range(12)]
    drafts[3] = [99, 5]
    out = replay(Trace(tokens, {3: drafts}), FixedBlocks(3), COSTS, max_tokens=12)
    # anchors 0 (+3), 3 (+1: its first draft wrong), 4 (+3), 7 (+3), 10 (a block of 2 fits the last token: +1)
    assert out.blocks == [3, 3, 3, 3, 2] and out.accepted == [2, 0, 2, 2, 1]
    assert out.tokens == 12 and out.plain_steps == 0 and out.probes == 0
    assert out.seconds == pytest.approx(
        4 * (COSTS.verify_s[2] + COSTS.draft_s[1]) + COSTS.verify_s[1] + COSTS.draft_s[0]
    )
    assert out.tokens_per_s == pytest.approx(11 / out.seconds)


class Logged(AdaptiveBlocks):
    """Adaptive mode, every call the decode loop makes on it logged with its arguments and answer (times left
    out: the loop's are the clock's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def next_block(self, left):
        self.log.append(("next_block", left, super().next_block(left)))
        return self.log[-1][-1]

    def plain_run(self, left):
        self.log.append(("plain_run", left, super().plain_run(left)))
        return self.log[-1][-1]

    def drafting_wins(self, left):
        self.log.append(("drafting_wins", left, super().drafting_wins(left)))
        return self.log[-1][-1]

    def verified_block(self, B, confidence, left):
        self.log.append(("verified_block", B, left, super().verified_block(B, confidence, left)))
        return self.log[-1][-1]

    def observe_shadow(self, chain, single, confidence=None):
        self.log.append(("observe_shadow", list(chain), list(single), confidence))
        super().observe_shadow(chain, single, confidence)

    def observe_plain(self, steps, seconds, probes=0):
        self.log.append(("observe_plain", steps, probes))
        super().observe_plain(steps, seconds, probes)

    def observe_cycle(self, B, accepted, seconds):
        self.log.append(("observe_cycle", B, accepted))
        super().observe_cycle(B, accepted, seconds)

    def observe_unverified(self, first, seconds):
        self.log.append(("observe_unverified", first))
        super().observe_unverified(first, seconds)


@pytest.mark.slow
@pytest.mark.parametrize("logit_scale, wrong_every", [(30.0, None), (2.6, 3)])
def test_the_replay_makes_the_decode_loops_calls(tokenizer, monkeypatch, logit_scale, wrong_every):
    """A drafter right only inside a stretch, every cycle and plain step timed at exact costs: the real loop and
    the replay on the recorded drafts make the same calls on the policy, in the same order, with the same
    arguments and answers, and commit the same tokens the same way. Sure of its drafts, or so unsure that many
    go unverified (each scored by the token its cycle commits), and inside the stretch wrong after every third
    token."""
    decide_on(monkeypatch, COSTS)
    policies = []
    monkeypatch.setattr(
        generate_module,
        "block_policy",
        lambda target, drafter, B, mode, costs=None: policies.append(Logged(COSTS, AdaptiveConfig(B))) or policies[-1],
    )
    model = make_target("llama", seed=7)
    prompt = prompts(1, seed=6)[0]

    def oracle():
        return make_oracle(
            model, prompt, block_size=8, right_between=(40, 90), wrong_every=wrong_every, logit_scale=logit_scale
        )

    records = list(
        generate_module.stream_cycles(
            model, tokenizer, prompt, oracle(), verify_mode="adaptive", max_tokens=140, eos_token_ids=[]
        )
    )
    drafter = oracle()
    trace = record(bind_drafter(drafter, model), drafter, prompt, 140, [8])
    assert trace.tokens == [t for r in records for t in r.tokens]
    policy = Logged(COSTS, AdaptiveConfig(8))
    out = replay(trace, policy, COSTS, max_tokens=140)
    assert policy.log == policies[0].log
    cycles = [r for r in records if r.block_size is not None and r.block_size > 1]
    assert out.blocks == [r.block_size for r in cycles] and out.accepted == [r.accepted for r in cycles]
    assert out.plain_steps == sum(len(r.tokens) for r in records if r.block_size == 1)
    assert len(cycles) >= 5 and out.plain_steps >= 40  # both kinds of decision were made
    assert out.probes == sum(r.shadow is not None for r in records)
    assert any(c[0] == "drafting_wins" and c[2] for c in policy.log)  # a run cut short by its probe
    unverified = [c[1] for c in policy.log if c[0] == "observe_unverified"]
    # unsure: drafts left unverified, scored both ways (missed outside the stretch, right inside it); sure: none
    assert {0.0, 1.0} <= set(unverified) if logit_scale < 30 else not unverified


def test_perturbed_curves_stay_within_3_percent_of_the_measured_one_and_monotone():
    curves = [perturbed(COSTS, seed) for seed in range(20)]
    for curve in curves:
        assert curve.verify_s[0] == COSTS.verify_s[0]  # the plain step: the unit every ratio is taken in
        for measured, moved in ((COSTS.verify_s, curve.verify_s), (COSTS.draft_s, curve.draft_s)):
            assert all(0.97 * m <= p <= 1.03 * m for m, p in zip(measured, moved))
            assert all(a <= b for a, b in zip(moved, moved[1:]))
    assert len({tuple(c.verify_s) for c in curves}) == 20 and perturbed(COSTS, 3) == curves[3]


def test_bench_replay_reports_records_and_reuses(tiny_pair, tmp_path, monkeypatch, capsys):
    from dflash2_apps.cli import main

    target, drafter = tiny_pair
    traces, out, suite = tmp_path / "traces.json", tmp_path / "replay.json", tmp_path / "prompts.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["w1 w2 w3 w4", "w9 w8 w7"]))
    args = [
        "bench",
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--replay",
        "--prompts",
        str(suite),
        "--num-prompts",
        "2",
        "--max-tokens",
        "24",
        "--block-sizes",
        "3,5",
        "--replay-traces",
        str(traces),
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "replay.md"),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())["replay"]
    assert [r["prompt"] for r in rows] == [1, 2] and all(set(r["fixed"]) == {"3", "5"} for r in rows)
    assert all(1 < r["tokens"] <= 24 and 0 < r["adaptive"] and r["cycles"] + r["probes"] > 0 for r in rows)
    table = (tmp_path / "replay.md").read_text()
    assert "| drafter | prompt | tokens | B=3 | B=5 | adaptive | plain % | cycles | vs best |" in table
    assert table.startswith(f"Made by `dflash2 bench --model {target} ") and " --replay " in table.split("\n")[0]
    assert len(json.loads(traces.read_text())) == 2  # a trace per prompt, kept
    # how often first drafts are accepted at each confidence, counted here from the kept traces
    kept = list(json.loads(traces.read_text()).values())
    top = max(kept[0]["drafts"], key=int)
    firsts = [
        (t["confidence"][top][j][0], t["drafts"][top][j][0] == t["tokens"][j + 1])
        for t in kept
        for j in range(len(t["tokens"]) - 1)
    ]
    cells = {k: [ok for c, ok in firsts if min(int(c * 5), 4) == k] for k in range(5)}
    assert sum(map(len, cells.values())) == len(firsts) > 0 and 0.0 < sum(c for c, _ in firsts) / len(firsts) < 1.0
    line = ", ".join(
        f"{k / 5:.1f}-{(k + 1) / 5:.1f}: " + (f"{sum(v) / len(v):.0%} of {len(v)}" if v else "none")
        for k, v in cells.items()
    )
    assert f"accepted by the drafter's confidence in them: {line}\n" in table

    # on perturbed curves: each prompt averaged over them (by hand, from the kept traces and the report's curve)
    assert main(args + ["--replay-jitter", "3"]) == 0
    report = json.loads(out.read_text())
    model, _, loaded = load(str(target), str(drafter))
    bound = bind_drafter(loaded, model)
    costs = CostModel(**next(iter(report["costs"].values())))
    for row, kept_trace in zip(report["replay"], kept):
        trace = Trace(
            kept_trace["tokens"],
            {int(B): d for B, d in kept_trace["drafts"].items()},
            {int(B): c for B, c in kept_trace["confidence"].items()},
        )
        vs_plain, vs_best = [], []
        for seed in range(3):
            curve = perturbed(costs, seed)
            fixed = [replay(trace, FixedBlocks(B), curve, 24).tokens_per_s * curve.verify_s[0] for B in (3, 5)]
            policy = block_policy(bound, loaded, int(top), "adaptive", curve)
            vs_plain.append(replay(trace, policy, curve, 24).tokens_per_s * curve.verify_s[0])
            vs_best.append(vs_plain[-1] / max(1.0, *fixed))
        assert row["jitter"] == pytest.approx({"adaptive": sum(vs_plain) / 3, "vs_best": sum(vs_best) / 3})
    worst = min(r["jitter"]["vs_best"] for r in report["replay"])
    assert "of plain and fixed blocks mean" in (tmp_path / "replay.md").read_text()
    assert f"x, worst {worst:.3f}x\n" in (tmp_path / "replay.md").read_text()
    capsys.readouterr()
    assert main(args + ["--replay-jitter", "-1"]) == 2
    assert "--replay-jitter is a number of curves" in capsys.readouterr().err
    assert main(["bench", "--model", str(target), "--replay-jitter", "2"]) == 2
    assert "--replay-jitter goes with --replay" in capsys.readouterr().err

    def recorded_again(*args, **kwargs):
        raise AssertionError("the kept traces should have been replayed")

    monkeypatch.setattr("dflash2_apps.replay.record", recorded_again)  # the name the command calls
    assert main(args) == 0
    assert json.loads(out.read_text())["replay"] == rows
    capsys.readouterr()
    assert main(args + ["--temp", "0.7"]) == 2
    assert "--replay replays greedy answers (T = 0) only" in capsys.readouterr().err
    assert main(args + ["--walk", "greedy", "--walk", "viterbi"]) == 2
    assert "--replay replays one walk at a time" in capsys.readouterr().err
