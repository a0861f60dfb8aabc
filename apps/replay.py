"""`dflash2 replay`: plain steps, fixed blocks and adaptive mode replayed on recorded drafts (T = 0), timed on
this machine's measured cost curve (or on one read from a file: `--costs`): the policies' decisions without the
clock's noise. `dflash2 bench --replay` runs it too (with bench's flags of the same names)."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import statistics
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_apps.bench_report import report_context
from dflash2_apps.common import add_bench_model_args, bench_prompts, load_bench_models, write_markdown
from dflash2_mlx.costs import CostModel, cost_key, load_or_measure_costs
from dflash2_mlx.generate import block_policy, resolve_block_size
from dflash2_mlx.kernels import use_metal
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.replay import Trace, record, replay


def trace_keys(target, drafter, prompts: list[list[int]], max_tokens: int, sizes: list[int], walk: str) -> list[str]:
    """What each prompt's trace depends on: the target's and the drafter's weights (hashed once), the prompt, the
    length, the blocks, the walk."""
    weights = hashlib.sha256(np.array(drafter.fc.weight.astype(mx.float32)).tobytes()).hexdigest()[:16]
    head, tail = f"{target.fingerprint()} | drafter {weights}", f"{max_tokens} | B {sizes} | {walk}"
    return [f"{head} | prompt {hashlib.sha256(json.dumps(p).encode()).hexdigest()[:16]} | {tail}" for p in prompts]


def calibration_line(label: str, block_max: int, firsts: list[tuple[float, bool]]) -> str:
    """How often a first draft is accepted at each confidence (`Proposal.confidence`, fifths of [0, 1]): what
    adaptive mode's choice of how many drafts to verify rests on."""
    cells = []
    for k in range(5):
        hits = [ok for c, ok in firsts if k / 5 <= c < (k + 1) / 5 or (k == 4 and c >= 1.0)]
        cells.append(
            f"{k / 5:.1f}-{(k + 1) / 5:.1f}: {sum(hits) / len(hits):.0%} of {len(hits)}"
            if hits
            else f"{k / 5:.1f}-{(k + 1) / 5:.1f}: none"
        )
    return f"{label}: first drafts (blocks of {block_max}) accepted by the drafter's confidence in them: " + ", ".join(
        cells
    )


# How far `--replay-jitter` moves each point of the cost curve (uniformly, up or down).
JITTER = 0.03


def perturbed(costs: CostModel, seed: int, spread: float = JITTER) -> CostModel:
    """`costs` with every point but a plain step scaled by 1 + U(-spread, spread) (seeded), then made monotone (a
    pass over more tokens never costs less): a machine whose curve this one could have been measured from. The
    policies' decisions are discontinuous, so a single prompt's replay swings by several percent when the curve
    moves by 1%; averaged over such curves, it says how a rule does rather than how one curve falls for it."""
    rng = random.Random(seed)
    verify = costs.verify_s[:1] + [s * (1 + rng.uniform(-spread, spread)) for s in costs.verify_s[1:]]
    draft = [s * (1 + rng.uniform(-spread, spread)) for s in costs.draft_s]
    return CostModel(list(itertools.accumulate(verify, max)), list(itertools.accumulate(draft, max)))


def replay_prompt(trace: Trace, target, drafter, fixed: list[int], block_max: int, costs: CostModel, max_tokens: int):
    """On `trace`: each fixed block's committed tokens per second relative to plain steps, adaptive mode's replay
    (`Replayed`), its own ratio to plain steps, and its ratio to the best of plain steps and the fixed blocks."""
    plain = 1 / costs.verify_s[0]
    ratios = {
        B: replay(trace, block_policy(target, drafter, B, "dflash"), costs, max_tokens).tokens_per_s / plain
        for B in fixed
    }
    run = replay(trace, block_policy(target, drafter, block_max, "adaptive", costs), costs, max_tokens)
    adaptive = run.tokens_per_s / plain
    return ratios, run, adaptive, adaptive / max([1.0, *ratios.values()])


def jittered(trace: Trace, target, drafter, fixed: list[int], block_max: int, costs: CostModel, args) -> dict:
    """Adaptive mode against plain steps and against the best of plain and the fixed blocks on `trace`, each
    averaged over `args.replay_jitter` perturbed curves (`perturbed`, seeds 0..n-1)."""
    replays = [
        replay_prompt(trace, target, drafter, fixed, block_max, perturbed(costs, seed), args.max_tokens)
        for seed in range(args.replay_jitter)
    ]
    return {"adaptive": statistics.mean(r[2] for r in replays), "vs_best": statistics.mean(r[3] for r in replays)}


def jitter_line(label: str, n: int, per_prompt: list[dict]) -> str:
    return (
        f"{label} on {n} curves within +-{JITTER:.0%} of this one (each prompt averaged over them): adaptive vs "
        f"plain mean {statistics.mean(j['adaptive'] for j in per_prompt):.3f}x, worst "
        f"{min(j['adaptive'] for j in per_prompt):.3f}x; vs the best of plain and fixed blocks mean "
        f"{statistics.mean(j['vs_best'] for j in per_prompt):.3f}x, worst {min(j['vs_best'] for j in per_prompt):.3f}x"
    )


def load_traces(path: str | None) -> dict:
    if not path or not Path(path).exists():
        return {}
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not a traces file written by `dflash2 replay` ({e}); give another "
            "--traces (--replay-traces) path or delete it"
        ) from None


# What `--costs` reads: one curve as `CostModel` holds it (the costs cache holds them by key).
CURVE_SHAPE = (
    '{"verify_s": [seconds of a target forward over 1, 2, ... tokens], "draft_s": [seconds of a drafter '
    "pass for a block of 2, 3, ...]}"
)


def read_costs(path: str) -> dict[str, CostModel]:
    """The cost curves in the JSON file `path`, by name: a costs cache (what `load_or_measure_costs` writes:
    {cost key: curve}), a replay report (its "costs": {drafter: curve}), or a single curve (named "").

    Args:
        path: the file `--costs` names.

    Raises:
        ValueError: the file is not JSON, or a curve lacks a key or holds something else than seconds.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--costs {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--costs {path}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("costs"), dict):  # a replay report
        data = data["costs"]
    if isinstance(data, dict) and {"verify_s", "draft_s"} & data.keys():
        data = {"": data}
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"--costs {path}: expected a cost curve {CURVE_SHAPE}, or an object of them by name (as "
            "the costs cache keeps them)"
        )
    curves = {}
    for name, curve in data.items():
        where = f"--costs {path}" + (f", curve {name!r}" if name else "")
        if not isinstance(curve, dict):
            raise ValueError(f"{where}: expected a cost curve {CURVE_SHAPE}, got {json.dumps(curve)[:80]}")
        for key in ("verify_s", "draft_s"):
            if key not in curve:
                raise ValueError(f"{where}: no {key!r} key; a cost curve is {CURVE_SHAPE}")
            values = curve[key]
            if not (
                isinstance(values, list)
                and values
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)
            ):
                raise ValueError(
                    f"{where}: {key!r} must be a list of seconds (numbers > 0), got {json.dumps(values)[:80]}"
                )
        curves[name] = CostModel([float(v) for v in curve["verify_s"]], [float(v) for v in curve["draft_s"]])
    return curves


def pick_costs(curves: dict[str, CostModel], path: str, label: str, key: str, block_max: int) -> CostModel:
    """The curve of `curves` (`read_costs(path)`) a drafter replays on: the only one, else the one under its cost
    key (`cost_key`) or its label; it must cover the drafter's blocks (up to `block_max`)."""
    if len(curves) == 1:
        costs = next(iter(curves.values()))
    elif key in curves or label in curves:
        costs = curves[key] if key in curves else curves[label]
    else:
        raise ValueError(
            f"--costs {path} holds {len(curves)} curves and none is keyed by {label}'s cost key "
            f"({key!r}) or its label: keep the one to replay on alone in the file"
        )
    if len(costs.verify_s) < block_max or costs.block_max < block_max:
        raise ValueError(
            f"--costs {path}: the curve covers blocks up to {min(len(costs.verify_s), costs.block_max)} "
            f"tokens ({len(costs.verify_s)} in 'verify_s', {len(costs.draft_s)} in 'draft_s'), {label} "
            f"replays blocks up to {block_max}: it needs {block_max} and {block_max - 1}"
        )
    return costs


def replay_report(args, model, tokenizer, prompts: list[list[int]], drafters) -> int:
    """Per drafter and prompt, each fixed block's and adaptive mode's committed tokens per second relative to plain
    steps, replayed on the recorded greedy answer. `args.walk`: one walk (`dflash2 replay`) or bench's list."""
    if args.temp and any(t > 0 for t in args.temp):
        raise ValueError("--replay replays greedy answers (T = 0) only: drop --temp, or bench at T > 0 without it")
    walks = [args.walk] if isinstance(args.walk, str) else args.walk or ["greedy"]
    if len(walks) > 1:
        raise ValueError("--replay replays one walk at a time: give one --walk")
    given = read_costs(args.costs) if args.costs else None  # a bad file fails here, before any recording
    known = load_traces(args.replay_traces)
    asked = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else []
    walk = walks[0]
    eos = list(tokenizer.eos_token_ids)
    lines, rows, curves = [], [], {}
    for label, drafter in drafters:
        target = bind_drafter(drafter, model)
        block_max = resolve_block_size(drafter, None, "adaptive")
        fixed = sorted(
            {resolve_block_size(drafter, B) for B in asked if B <= block_max} or {resolve_block_size(drafter, None)}
        )
        if given:
            costs = pick_costs(given, args.costs, label, cost_key(target, drafter, block_max), block_max)
        else:
            costs = load_or_measure_costs(target, drafter, block_max)
        curves[label] = asdict(costs)
        sizes = sorted({*fixed, block_max})
        source = f"the cost curve in {args.costs}" if given else "this machine's cost curve"
        lines += [
            f"{label} replayed at T = 0 on {source} (target forward over n tokens / one "
            f"plain step: {' '.join(f'{r:.2f}' for _, r in costs.curve())}; drafter pass "
            f"{costs.draft_s[0] / costs.verify_s[0]:.2f}-{costs.draft_s[-1] / costs.verify_s[0]:.2f} steps): "
            "committed tokens per second relative to plain steps, the same answers for every policy, the "
            "passes' costs only (the loop's own work left out)",
            "",
        ]
        lines += [
            "| drafter | prompt | tokens | "
            + " | ".join(f"B={B}" for B in fixed)
            + " | adaptive | plain % | cycles | vs best |",
            "|---|---|---|" + "---|" * (len(fixed) + 4),
        ]
        keys = trace_keys(target, drafter, prompts, args.max_tokens, sizes, walk)
        firsts = []  # (confidence, accepted) of every first draft of a block of block_max, all prompts
        for i, (prompt, key) in enumerate(zip(prompts, keys), 1):
            if known.get(key, {}).get("confidence"):  # kept without confidences (an older trace): recorded again
                trace = Trace(
                    known[key]["tokens"],
                    {int(B): d for B, d in known[key]["drafts"].items()},
                    {int(B): c for B, c in known[key]["confidence"].items()},
                )
            else:
                trace = record(target, drafter, prompt, args.max_tokens, sizes, eos, walk)
                known[key] = asdict(trace)
            firsts += [
                (c[0], trace.matches(j, block_max, 1) == [1.0])
                for j, c in enumerate(trace.confidence[block_max][: len(trace.tokens) - 1])
            ]
            ratios, run, adaptive, vs_best = replay_prompt(
                trace, target, drafter, fixed, block_max, costs, args.max_tokens
            )
            share = run.plain_steps / max(1, run.tokens - 1)
            rows.append(
                {
                    "drafter": label,
                    "prompt": i,
                    "tokens": len(trace.tokens),
                    "fixed": ratios,
                    "adaptive": adaptive,
                    "plain_share": share,
                    "cycles": len(run.blocks),
                    "probes": run.probes,
                    "vs_best": vs_best,
                }
            )
            if args.replay_jitter:
                rows[-1]["jitter"] = jittered(trace, target, drafter, fixed, block_max, costs, args)
            lines.append(
                f"| {label} | {i} | {len(trace.tokens)} | "
                + " | ".join(f"{r:.2f}x" for r in ratios.values())
                + f" | {adaptive:.2f}x | {100 * share:.0f}% | {len(run.blocks)} | {vs_best:.2f}x |"
            )
        mine = [r for r in rows if r["drafter"] == label]
        lines += [
            "",
            f"{label}: adaptive vs plain mean {statistics.mean(r['adaptive'] for r in mine):.3f}x, worst "
            f"{min(r['adaptive'] for r in mine):.3f}x; vs the best of plain and fixed blocks worst "
            f"{min(r['vs_best'] for r in mine):.3f}x",
            "",
        ]
        if args.replay_jitter:
            lines += [jitter_line(label, args.replay_jitter, [r["jitter"] for r in mine]), ""]
        lines += [calibration_line(label, block_max, firsts), ""]
    if args.replay_traces:
        Path(args.replay_traces).write_text(json.dumps(known))
    text = "\n".join(lines)
    print(text)
    write_markdown(args, text)
    if args.json:
        context = {**report_context(), "costs_file": args.costs}  # the curves themselves: "costs"
        Path(args.json).write_text(
            json.dumps({"replay": rows, "block_sizes": asked, "costs": curves, "context": context}, indent=1)
        )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "replay",
        help="replay plain steps, fixed blocks and adaptive mode on recorded drafts, timed on a cost curve (T = 0)",
        description="Record each drafter's proposals and confidences along the target's greedy answers (once: "
        "--traces keeps them), then replay plain steps, the fixed blocks of --block-sizes and adaptive mode on "
        "them, timed on this machine's measured cost curve (or --costs): committed tokens per second relative to "
        "plain steps, the policies' decisions without timing noise.",
    )
    add_bench_model_args(p)
    p.add_argument("--prompts", default="math", help="suites (code, chat, math, long; comma-separated) or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts taken from each suite")
    p.add_argument("--max-tokens", type=int, default=128, help="length of each recorded answer, at most")
    p.add_argument(
        "--block-sizes", help="comma-separated fixed block sizes to replay (default: each drafter's default)"
    )
    p.add_argument(
        "--walk",
        choices=["greedy", "viterbi"],
        default="greedy",
        help="the DFlash 2 path walk the drafts are recorded with (default greedy)",
    )
    p.add_argument(
        "--traces",
        "--replay-traces",
        dest="replay_traces",
        metavar="FILE",
        help="keep the recorded answers and proposals here (JSON) and reuse them when they match",
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        help="replay on the cost curve in this JSON file instead of this machine's (a costs cache such as "
        '~/.cache/dflash2/costs.json, one {"verify_s": [...], "draft_s": [...]} object, or a replay '
        'report\'s "costs")',
    )
    p.add_argument(
        "--jitter",
        "--replay-jitter",
        dest="replay_jitter",
        type=int,
        default=0,
        metavar="N",
        help=f"also replay on N cost curves within +-{JITTER * 100:.0f}%% of the measured one and report "
        "adaptive mode averaged over them (a single curve's decisions swing by several percent)",
    )
    p.add_argument("--json", metavar="OUT", help="write the rows, the block sizes and the cost curves here")
    p.add_argument("--markdown", metavar="OUT", help="write the report as markdown here")
    p.set_defaults(run=run, temp=None)  # greedy answers only: no --temp


def run(args) -> int:
    """`dflash2 replay` (and `dflash2 bench --replay`): load the target, the drafters and the prompts, and replay."""
    if args.replay_jitter < 0:
        raise ValueError(f"--jitter/--replay-jitter is a number of curves (0: none), got {args.replay_jitter}")
    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    model, tokenizer, drafters, _ = load_bench_models(args)
    _, prompts = bench_prompts(args, tokenizer)
    return replay_report(args, model, tokenizer, prompts, drafters)
