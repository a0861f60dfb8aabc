"""What each of adaptive mode's settings is worth: the kept answers replayed (T = 0) with each setting at its neutral
value (or its part removed), on each cost curve in runs/smollm2/curves/, for both bundled drafters.

    .venv/bin/python runs/smollm2/replay_knobs.py --json runs/smollm2/replay-knobs.json

prints, per curve, drafter and prompt set, adaptive mode's mean and worst ratio to plain steps and each variant's
change of them; the JSON keeps every prompt's ratios (and the best fixed block's, B = 3, 5, 8).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_apps.common import bench_prompts
from dflash2_mlx.adaptive import AdaptiveBlocks, AdaptiveConfig, FixedBlocks
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
                for variant, (changes, cls) in VARIANTS.items():
                    ratios = [
                        replay(t, cls(costs, replace(base, **changes)), costs, MAX_TOKENS).tokens_per_s / plain
                        for t in traces
                    ]
                    rows[f"{curve} | {name} | {suite} | {variant}"] = {"adaptive": ratios, "best_fixed": best}
                kept = rows[f"{curve} | {name} | {suite} | kept rule"]["adaptive"]
                mean, worst = statistics.mean(kept), min(kept)
                vs_best = min(a / b for a, b in zip(kept, best))
                print(
                    f"{curve} {name} {suite} ({len(traces)} prompts): mean {mean:.3f}x, worst {worst:.3f}x of plain; "
                    f"worst vs the best fixed block {vs_best:.3f}x"
                )
                for variant in list(VARIANTS)[1:]:
                    r = rows[f"{curve} | {name} | {suite} | {variant}"]["adaptive"]
                    print(
                        f"    {variant:42s} mean {statistics.mean(r) / mean - 1:+.2%}  worst {min(r) / worst - 1:+.2%}"
                    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=0))


if __name__ == "__main__":
    main()
