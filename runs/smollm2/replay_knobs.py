"""What each of adaptive mode's settings is worth: the kept answers replayed (T = 0) with each setting at its neutral
value (or its part removed), on each cost curve in runs/smollm2/curves/, for both bundled drafters.

    .venv/bin/python runs/smollm2/replay_knobs.py --json runs/smollm2/replay-knobs.json

prints, per curve, drafter and prompt set, adaptive mode's mean and worst ratio to plain steps and each variant's
change of them (the settings, then other choices of the drafted block than a full one), and on the flat curve what
holds each prompt under 0.98x of the best fixed block; the JSON keeps every prompt's ratios (and the best fixed
block's, B = 3, 5, 8, and for the kept rule the best fixed verify of full blocks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_apps.bench_report import report_context
from dflash2_apps.common import bench_prompts
from dflash2_mlx.adaptive import AcceptanceEstimates, AdaptiveBlocks, AdaptiveConfig, FixedBlocks, expected_tokens
from dflash2_mlx.costs import CostModel
from dflash2_mlx.loading import load_drafter, load_target
from dflash2_mlx.replay import Trace, replay

HERE = Path(__file__).parent
DRAFTERS = {
    "dflash2": "dflash2_mlx/assets/drafters/smollm2-135m-dflash2-b8",
    "v1": "dflash2_mlx/assets/drafters/smollm2-135m-dflash-b8",
}
CURVES = ("cpu", "mid", "flat")
FIXED = (3, 5, 8)
MAX_TOKENS = 200  # as recorded: an answer that ended at EOS sooner is replayed as the loop decoded it, blind to the end
SUITES = {"long": 8, "chat": 16}  # the prompts: `--prompts long --num-prompts 8`, `--prompts chat --num-prompts 16`


class NoGains(AdaptiveBlocks):
    """The drafter passes' gains never counted: the averaged estimates alone decide."""

    def _count_gain(self, gain):
        pass


class RawConfidences(AdaptiveBlocks):
    """The rows' confidences taken as they are, uncalibrated."""

    def _best(self, rows):
        hits, sums = self.calibration.hits, self.calibration.sums
        self.calibration.hits, self.calibration.sums = [1.0] * len(hits), [1.0] * len(sums)
        try:
            return super()._best(rows)
        finally:
            self.calibration.hits, self.calibration.sums = hits, sums


class NoConfidences(AdaptiveBlocks):
    """Every drafting cycle verifies the block `next_block` chose: no per-cycle choice, no gains."""

    def verified_block(self, B, confidence, left):
        return super().verified_block(B, None, left)


# name: (config changes, class)
VARIANTS = {
    "kept rule": ({}, AdaptiveBlocks),
    "prior_weight 0 (no card prior)": ({"prior_weight": 0.0}, AdaptiveBlocks),
    "shrink 0.001": ({"shrink": 0.001}, AdaptiveBlocks),
    "decay 0.9": ({"decay": 0.9}, AdaptiveBlocks),
    "decay 0.7": ({"decay": 0.7}, AdaptiveBlocks),
    "calibration: raw confidences": ({}, RawConfidences),
    "calibration_prior 0.5": ({"calibration_prior": 0.5}, AdaptiveBlocks),
    "calibration_decay 1 (no decay)": ({"calibration_decay": 1.0}, AdaptiveBlocks),
    "gains removed": ({}, NoGains),
    "gain_decay 1 (no decay)": ({"gain_decay": 1.0}, AdaptiveBlocks),
    "entry_discount 1 (none)": ({"entry_discount": 1.0}, AdaptiveBlocks),
    "plain_run_max = plain_run (no doubling)": ({"plain_run_max": 8}, AdaptiveBlocks),
    "turn_p 0 (no turns)": ({"turn_p": 0.0}, AdaptiveBlocks),
    "recent_decay 0.5": ({"recent_decay": 0.5}, AdaptiveBlocks),
    "per-cycle confidences removed": ({}, NoConfidences),
}


class DraftedAt(AdaptiveBlocks):
    """Every cycle drafts a block of `drafted` (the estimates and the probes stay at block_max)."""

    drafted = 8

    def drafted_block(self, B):
        return self.drafted


class DraftedAt5(DraftedAt):
    drafted = 5


class DraftedAt3(DraftedAt):
    drafted = 3


class DraftedFits(AdaptiveBlocks):
    """A block of 5 drafted where the block `next_block` chose is 5 or less, a full one otherwise."""

    def drafted_block(self, B):
        return 5 if B <= 5 else self.block_max


class DraftedOnline(AdaptiveBlocks):
    """The drafted block chosen per cycle among SIZES: each size's own acceptance counts (decay 0.95, shrunk toward
    the shared estimates by 3 observations) price its best verify on the cost curve, plus an exploration bonus of
    BONUS / sqrt(1 + its decayed cycle count) in plain steps' rate (UCB)."""

    SIZES, BONUS = (3, 5, 8), 0.3

    def __init__(self, costs, config):
        super().__init__(costs, config)
        self.own = {D: AcceptanceEstimates(D - 1, decay=0.95) for D in self.SIZES}
        self.cycles = dict.fromkeys(self.SIZES, 0.0)
        self.drafted = config.block_max

    def _value(self, D):
        shared, own = self.acceptance(), self.own[D]
        acceptance = [(h + 3 * a) / (s + 3) for h, s, a in zip(own.hits, own.seen, shared)]
        rate = max(
            expected_tokens(acceptance, B) / (self.costs.passes_s(B, D) * self.clock.cycle_scale)
            for B in range(2, D + 1)
        )
        return rate * self.seconds(1) + self.BONUS / math.sqrt(1 + self.cycles[D])

    def next_block(self, left):
        B = super().next_block(left)
        if B > 1:
            self.drafted = max(self.SIZES, key=lambda D: (self._value(D), D))
        return B

    def drafted_block(self, B):
        return self.drafted

    def observe_cycle(self, B, accepted, seconds):
        for i in range(min(accepted + 1, B - 1)):
            self.own[self.drafted].count(i, 1.0, float(i < accepted))
        self.cycles = {D: 0.95 * n + (D == self.drafted) for D, n in self.cycles.items()}
        super().observe_cycle(B, accepted, seconds)


class DraftedTrial(AdaptiveBlocks):
    """Where the estimates' best block fits in one of 5, every 4th cycle drafts a block of 5, and blocks of 5 are
    drafted from then on while their accepted drafts (counted up to 4) beat the full blocks' by a standard error."""

    def __init__(self, costs, config):
        super().__init__(costs, config)
        self.counts = {5: [0, 0.0, 0.0], config.block_max: [0, 0.0, 0.0]}  # cycles, sum, sum of squares
        self.cycle, self.drafted = 0, config.block_max

    def _mean_se(self, D):
        n, total, squares = self.counts[D]
        if not n:
            return 0.0, 1.0
        mean = total / n
        return mean, math.sqrt(max(squares / n - mean * mean, 0.05) / n)

    def next_block(self, left):
        B = super().next_block(left)
        if B > 1:
            self.cycle += 1
            acceptance = self.acceptance()
            rates = {b: expected_tokens(acceptance, b) / self.cycle_seconds(b) for b in range(2, self.block_max + 1)}
            (small, small_se), (full, full_se) = self._mean_se(5), self._mean_se(self.block_max)
            if max(rates, key=rates.get) > 5:
                self.drafted = self.block_max
            elif small - math.hypot(small_se, full_se) > full or self.cycle % 4 == 0:
                self.drafted = 5
            else:
                self.drafted = self.block_max
        return B

    def drafted_block(self, B):
        return self.drafted

    def observe_cycle(self, B, accepted, seconds):
        if B >= 5:
            counts, a = self.counts[self.drafted], min(accepted, 4)
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + a, counts[2] + a * a
        super().observe_cycle(B, accepted, seconds)


class FullBlockFixed(FixedBlocks):
    """Every cycle drafts a full block (8) and verifies the first `block_size` tokens of it."""

    def drafted_block(self, B):
        return 8


# The drafted block chosen otherwise than always full: name: class (measured against the kept rule).
DRAFTED = {
    "always a block of 5 drafted": DraftedAt5,
    "always a block of 3 drafted": DraftedAt3,
    "a block of 5 drafted where the chosen block is 5 or less": DraftedFits,
    "drafted block chosen online among 3, 5, 8 (UCB)": DraftedOnline,
    "blocks of 5 tried every 4th cycle, kept where they accept more": DraftedTrial,
}


def weights_hash(drafter) -> str:
    """The drafter's part of a trace key (`dflash2_apps.replay.trace_keys`)."""
    return hashlib.sha256(np.array(drafter.fc.weight.astype(mx.float32)).tobytes()).hexdigest()[:16]


def load_traces(path: Path, drafter_hash: str, prompts: list[list[int]]) -> list[Trace]:
    """The traces of this drafter on these prompts (200 tokens, blocks of 3, 5 and 8), in the prompts' order."""
    kept = json.loads(path.read_text())
    wanted = [hashlib.sha256(json.dumps(p).encode()).hexdigest()[:16] for p in prompts]
    found = {
        key.split(" | prompt ")[1][:16]: t
        for key, t in kept.items()
        if f"drafter {drafter_hash} " in key and key.endswith(f"| {MAX_TOKENS} | B [3, 5, 8] | greedy")
    }
    if set(wanted) - found.keys():
        raise SystemExit(
            f"{len(set(wanted) - found.keys())} prompts have no trace in {path}: record them with "
            "`dflash2 replay --max-tokens 200 --block-sizes 3,5,8 --traces FILE`"
        )
    return [
        Trace(
            found[h]["tokens"],
            {int(B): d for B, d in found[h]["drafts"].items()},
            {int(B): c for B, c in found[h]["confidence"].items()},
        )
        for h in wanted
    ]


def accepted_drafts(trace: Trace, drafted: int, verified: int) -> tuple[float, float]:
    """Mean and standard deviation, over the answer's anchors, of the drafts accepted from a block of `drafted`
    verifying its first `verified` tokens."""
    accepted = [trace.accepted(j, verified, drafted) for j in range(len(trace.tokens) - 1)]
    return statistics.mean(accepted), statistics.pstdev(accepted)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", default=str(HERE / "replay-traces.json"))
    p.add_argument("--chat", default=str(HERE / "replay-chat-traces.json"))
    p.add_argument("--json", help="write every prompt's ratios here")
    args = p.parse_args()
    rows = {}
    drafters = {name: load_drafter(path) for name, path in DRAFTERS.items()}
    _, tokenizer = load_target(None, "float32")
    suites = {
        suite: bench_prompts(argparse.Namespace(prompts=suite, num_prompts=n), tokenizer)[1]
        for suite, n in SUITES.items()
    }
    variants = {**VARIANTS, **{f"drafted: {name}": ({}, cls) for name, cls in DRAFTED.items()}}
    for curve in CURVES:
        costs = CostModel(**json.loads((HERE / "curves" / f"{curve}.json").read_text()))
        plain = 1 / costs.verify_s[0]
        for name, drafter in drafters.items():
            for suite in ("long", "chat"):
                traces = load_traces(Path(getattr(args, suite)), weights_hash(drafter), suites[suite])
                best = [
                    max(replay(t, FixedBlocks(B), costs, MAX_TOKENS).tokens_per_s / plain for B in FIXED)
                    for t in traces
                ]
                base = AdaptiveConfig(8, prior=drafter.acceptance_prior)
                for variant, (changes, cls) in variants.items():
                    ratios = [
                        replay(t, cls(costs, replace(base, **changes)), costs, MAX_TOKENS).tokens_per_s / plain
                        for t in traces
                    ]
                    rows[f"{curve} | {name} | {suite} | {variant}"] = {"adaptive": ratios, "best_fixed": best}
                kept_row = rows[f"{curve} | {name} | {suite} | kept rule"]
                # the most any fixed verify of full blocks (8 drafted, the first k verified, k = 2..8) reaches
                kept_row["full_block_fixed"] = [
                    max(replay(t, FullBlockFixed(k), costs, MAX_TOKENS).tokens_per_s / plain for k in range(2, 9))
                    for t in traces
                ]
                kept = kept_row["adaptive"]
                mean, worst = statistics.mean(kept), min(kept)
                vs_best = min(a / b for a, b in zip(kept, best))
                print(
                    f"{curve} {name} {suite} ({len(traces)} prompts): mean {mean:.3f}x, worst {worst:.3f}x of plain; "
                    f"worst vs the best fixed block {vs_best:.3f}x"
                )
                for variant in list(variants)[1:]:
                    r = rows[f"{curve} | {name} | {suite} | {variant}"]["adaptive"]
                    print(
                        f"    {variant[:60]:60s} mean {statistics.mean(r) / mean - 1:+.2%}  "
                        f"worst {min(r) / worst - 1:+.2%}"
                    )
                if curve != "flat":
                    continue
                hindsight = {  # adaptive mode drafting always a block of D, per prompt
                    D: rows[f"{curve} | {name} | {suite} | {key}"]["adaptive"]
                    for D, key in (
                        (8, "kept rule"),
                        (5, "drafted: always a block of 5 drafted"),
                        (3, "drafted: always a block of 3 drafted"),
                    )
                }
                for i, t in enumerate(traces):
                    if kept[i] / best[i] >= 0.98:
                        continue
                    cycles = len(replay(t, AdaptiveBlocks(costs, base), costs, MAX_TOKENS).blocks)
                    D = max(hindsight, key=lambda d: hindsight[d][i])
                    (m3, _), (m35, _), (m38, _) = (accepted_drafts(t, D, 3) for D in (3, 5, 8))
                    (m5, s5), (m8, s8) = accepted_drafts(t, 5, 5), accepted_drafts(t, 8, 5)
                    se = math.sqrt((s5**2 + s8**2) / (cycles / 2))  # half the cycles drafting each size
                    print(
                        f"    prompt {i + 1} ({len(t.tokens)} tokens, {cycles} cycles): {kept[i] / best[i]:.3f}x "
                        f"of the best fixed block; any fixed verify of full blocks at most "
                        f"{kept_row['full_block_fixed'][i] / best[i]:.3f}x; adaptive drafting always {D}: "
                        f"{hindsight[D][i] / best[i]:.3f}x. Drafts accepted per anchor verifying 3 from blocks of "
                        f"3, 5, 8: {m3:.3f} {m35:.3f} {m38:.3f}; verifying 5 from blocks of 5, 8: {m5:.3f} {m8:.3f} "
                        f"(sd {s5:.2f}, {s8:.2f}; the difference {(m5 - m8) / se:.1f} standard errors at half the "
                        "cycles each)"
                    )
    if args.json:
        Path(args.json).write_text(json.dumps({**rows, "context": report_context()}, indent=0))


if __name__ == "__main__":
    main()
