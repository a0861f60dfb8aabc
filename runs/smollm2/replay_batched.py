"""Speculation inside the batch, replayed: the kept answers (`replay-traces.json`, the `long` suite's 8 prompts;
`replay-chat-traces.json`, 16 held-out `chat` prompts; 200 tokens each, the bundled DFlash 2 drafter's drafts along
them) decoded 1, 2, 4 and 8 at a time as `BatchedDecoder` decodes them (`replay.replay_batched`, T = 0), on three
batched cost curves, against batched plain steps on the same curve.

    .venv/bin/python runs/smollm2/replay_batched.py --measure   # this machine's curve -> curves/batched-cpu.json
    .venv/bin/python runs/smollm2/replay_batched.py --json runs/smollm2/replay-batched.json

The curves (`curves/batched-*.json`, `dflash2_mlx.batched_costs.BatchedCostModel`'s fields):
- `batched-cpu.json`: measured on this machine (`batched.measure_batched_costs`, every point of k = 1, 2, 4, 8 and
  n = 1..4, 8, the best of 3 rounds; the drafter's pass for one request and over k requests' blocks), SmolLM2-135M
  in float32 with OpenBLAS, the bundled drafter;
- `batched-flat.json`: Mac-like, derived from `curves/flat.json` (a forward over 8 tokens at 1.08 plain steps) on
  the assumption that a forward over n tokens for each of k requests costs what one request's forward over k x n
  tokens does, that curve's slope extended (a step bound by reading the weights); a drafter pass as there, and
  one over k requests' blocks growing as the target's forward over their tokens does;
- `batched-mid.json`: halfway between the two, point by point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from replay_knobs import DRAFTERS, HERE, SUITES, load_traces, weights_hash

from dflash2_apps.bench_report import report_context
from dflash2_apps.common import bench_prompts
from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.batched import measure_batched_costs
from dflash2_mlx.batched_costs import BatchedCostModel, read_batched_costs
from dflash2_mlx.loading import bind_drafter, load_drafter, load_target
from dflash2_mlx.replay import replay_batched

LEVELS = (1, 2, 4, 8)


BLOCK_MAX, BATCH_MAX = 8, 8
CURVES = ("cpu", "mid", "flat")


def curve_path(name: str) -> Path:
    return HERE / "curves" / f"batched-{name}.json"


def write_curve(name: str, costs: BatchedCostModel) -> None:
    curve_path(name).write_text(json.dumps(asdict(costs), indent=1) + "\n")


def derived_curves() -> None:
    """batched-flat.json from curves/flat.json, and batched-mid.json between it and the measured batched-cpu.json."""
    flat = json.loads((HERE / "curves" / "flat.json").read_text())
    verify = flat["verify_s"]
    slope = (verify[-1] - verify[0]) / (len(verify) - 1)
    forward = [[verify[0] + slope * (k * n - 1) for n in range(1, BLOCK_MAX + 1)] for k in range(1, BATCH_MAX + 1)]
    # a drafter pass over k blocks grows as the target's forward over k blocks' tokens does
    draft_batch = [forward[k - 1][BLOCK_MAX - 1] / forward[0][BLOCK_MAX - 1] for k in range(1, BATCH_MAX + 1)]
    mac = BatchedCostModel(forward, flat["draft_s"][: BLOCK_MAX - 1], draft_batch)
    write_curve("flat", mac)
    cpu = read_batched_costs(curve_path("cpu"))
    # each curve in units of its own plain step, then averaged, then back in the flat curve's seconds
    unit_cpu, unit_mac = cpu.forward_s[0][0], mac.forward_s[0][0]
    mid = BatchedCostModel(
        [
            [unit_mac * (a / unit_cpu + b / unit_mac) / 2 for a, b in zip(row_cpu, row_mac)]
            for row_cpu, row_mac in zip(cpu.forward_s, mac.forward_s)
        ],
        [unit_mac * (a / unit_cpu + b / unit_mac) / 2 for a, b in zip(cpu.draft_s, mac.draft_s)],
        [(a + b) / 2 for a, b in zip(cpu.draft_batch, mac.draft_batch)],
    )
    write_curve("mid", mid)


def measure() -> None:
    model, _ = load_target(None, "float32")
    drafter = load_drafter(DRAFTERS["dflash2"])
    costs = measure_batched_costs(bind_drafter(drafter, model), drafter, BLOCK_MAX, BATCH_MAX)
    write_curve("cpu", costs)
    print(f"wrote {curve_path('cpu')}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="measure this machine's batched curve first")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args()
    if args.measure:
        measure()
    derived_curves()
    drafter = load_drafter(DRAFTERS["dflash2"])
    _, tokenizer = load_target(None, "float32")
    rows = []
    print(
        "| curve | prompts | requests | plain batched tok/s | speculative tok/s | ratio | steps with drafts "
        "| ratio, a drafter pass per request |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for curve in CURVES:
        costs = read_batched_costs(curve_path(curve))
        for suite, n in SUITES.items():
            prompts = bench_prompts(argparse.Namespace(prompts=suite, num_prompts=n), tokenizer)[1]
            traces = load_traces(
                Path(HERE / f"replay{'-chat' if suite == 'chat' else ''}-traces.json"), weights_hash(drafter), prompts
            )
            for k in LEVELS:
                plain = replay_batched(traces, k, costs, BLOCK_MAX, drafter.acceptance_prior, drafting=False)
                spec = replay_batched(traces, k, costs, BLOCK_MAX, drafter.acceptance_prior)
                serial = replay_batched(
                    traces, k, BatchedCostModel(costs.forward_s, costs.draft_s), BLOCK_MAX, drafter.acceptance_prior
                )
                row = {
                    "curve": curve,
                    "prompts": suite,
                    "requests": k,
                    "plain_tokens_per_s": plain.tokens_per_s,
                    "tokens_per_s": spec.tokens_per_s,
                    "ratio": spec.tokens_per_s / plain.tokens_per_s,
                    "cycle_share": spec.cycles / spec.steps,
                    "accepted_per_cycle": spec.accepted / max(spec.cycles, 1),
                    "ratio_serial_drafter_passes": serial.tokens_per_s / plain.tokens_per_s,
                }
                rows.append(row)
                print(
                    f"| {curve} | {suite} | {k} | {row['plain_tokens_per_s']:.1f} | {row['tokens_per_s']:.1f} | "
                    f"{row['ratio']:.3f}x | {100 * row['cycle_share']:.0f}% | "
                    f"{row['ratio_serial_drafter_passes']:.3f}x |"
                )
    for curve in CURVES:
        mine = [r["ratio"] for r in rows if r["curve"] == curve]
        print(f"{curve}: speculative over plain batched, mean {statistics.mean(mine):.3f}x, worst {min(mine):.3f}x")
    if args.json:
        report = {"rows": rows, "levels": LEVELS, "context": report_context()}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    restart_with_openblas(sys.argv)
    main()
