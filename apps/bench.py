"""`dflash2 bench`: every decoding method side by side in ONE process, trial by trial, with a lossless check.

Methods: mlx-lm's own generation (the baseline users know), plain decoding through our loop, mlx-lm's
classic speculative decoding (with --baseline-draft-model), each DFlash drafter at each block size
(DFlash 2 with both walks), and peer engines with the same drafters (`peer_engines.py`, each in its own process).
Each prompt runs every method back to back, in alternating order (A B C, then C B A from one prompt and one
trial to the next: the ABBA design), so drift on a shared machine hits them alike: over a pair a linear drift
adds the same to every method's time, and a prompt's methods are compared on runs seconds apart, not minutes.
At T = 0 every method's tokens must hash to the baseline's: a mismatch is reported as an error.
This module is the command (its flags, what they load); the methods are `bench_methods.py`, the timing runs
`bench_runs.py`, their statistics `bench_stats.py` and the report (terminal tables, markdown, JSON)
`bench_report.py`. `--tree-sim DATA` and `--replay` run the commands `dflash2 tree-sim DATA` (`tree_sim.py`) and
`dflash2 replay` (`replay.py`), saying so on stderr: aliases kept for the commands written with them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlx.utils import tree_flatten

from dflash2_apps import replay, tree_sim
from dflash2_apps.bench_methods import drafter_names, methods_for, peer_methods, with_copyspec_modes
from dflash2_apps.bench_report import render, report_console, report_context, report_json
from dflash2_apps.bench_runs import bench
from dflash2_apps.common import add_bench_model_args, bench_prompts, command_line, load_bench_models, write_markdown
from dflash2_apps.compare import load_comparison, render_comparison
from dflash2_apps.peer_engines import PeerEngines, check_python, parse_engines
from dflash2_mlx.kernels import use_metal
from dflash2_mlx.loading import load_target
from dflash2_mlx.machine import runtime_info
from dflash2_mlx.prompts import prompts_sha256


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="compare tokens/s of every decoding method side by side, in one process, with a lossless check",
        description="Run mlx-lm's generation, plain decoding through our loop, mlx-lm's classic speculative "
        "decoding (--baseline-draft-model) and each DFlash drafter (each block size; DFlash 2 with both walks), "
        "trial by trial after a warm-up, and report tokens/s, speedup, acceptance, memory and a token-hash check.",
    )
    add_bench_model_args(p)
    p.add_argument("--baseline-draft-model", help="a classic draft model for mlx-lm's speculative decoding")
    p.add_argument(
        "--prompts", default="math", help="suites (code, chat, math, long, copy; comma-separated) or a JSONL file"
    )
    p.add_argument("--num-prompts", type=int, default=4, help="prompts taken from each suite")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--copyspec-modes",
        default="auto",
        metavar="LIST",
        help="copy-draft modes our rows run, comma-separated (auto, conservative, aggressive, off; "
        "default auto): several give each row once per mode, e.g. auto,off",
    )
    p.add_argument("--block-sizes", help="comma-separated runtime block sizes (default: each drafter's default)")
    p.add_argument("--temp", type=float, action="append", help="temperature (repeatable; default 0)")
    p.add_argument("--json", metavar="OUT", help="write everything machine-readable here")
    p.add_argument("--markdown", metavar="OUT", help="write the report as markdown here")
    p.add_argument(
        "--walk",
        action="append",
        choices=["greedy", "viterbi"],
        help="DFlash 2 path walks to bench (repeatable; default both)",
    )
    p.add_argument("--quick", action="store_true", help="1 trial, 2 prompts, 24 tokens: a smoke run")
    p.add_argument(
        "--wide",
        action="store_true",
        help="every column on the terminal (default: method, tok/s, vs mlx-lm, tau, lossless; the markdown "
        "and the JSON have them all)",
    )
    p.add_argument(
        "--compare",
        metavar="FILE",
        help="CUDA-side results to show beside ours: a dflash2-compare/1 JSON, a z-lab benchmark log, "
        "SGLang responses (JSONL), or 'published'",
    )
    p.add_argument(
        "--tree-sim",
        metavar="DATA",
        help="runs `dflash2 tree-sim DATA` (teacher-forced tau of the linear path and of ddtree trees per "
        "budget, no timing) with the flags given here",
    )
    p.add_argument(
        "--tree-budgets",
        help="comma-separated tree budgets: a ddtree row per budget (at each block size; 'auto': the "
        "default budget from this machine's costs), or the columns of --tree-sim (default there: "
        "1,2,4,8,16,32)",
    )
    p.add_argument("--tree-sim-samples", type=int, default=8, help="held-out samples --tree-sim reads")
    p.add_argument(
        "--replay",
        action="store_true",
        help="runs `dflash2 replay` (plain steps, fixed blocks and adaptive mode replayed on recorded "
        "drafts, timed on a cost curve) with the flags given here",
    )
    p.add_argument(
        "--replay-traces",
        metavar="FILE",
        help="keep the recorded answers and proposals here (JSON) and reuse them when they match",
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        help="with --replay: replay on the cost curve in this JSON file instead of this machine's (a costs "
        'cache such as ~/.cache/dflash2/costs.json, one {"verify_s": [...], "draft_s": [...]} '
        'object, or a replay report\'s "costs")',
    )
    p.add_argument(
        "--replay-jitter",
        type=int,
        default=0,
        metavar="N",
        help="with --replay: also replay on N cost curves within +-3%% of the measured one and report "
        "adaptive mode averaged over them (a single curve's decisions swing by several percent)",
    )
    p.add_argument(
        "--engines",
        metavar="LIST",
        help="peer engines to add rows for, each in its own process with the same target, drafters and "
        "prompts: dflash (the authors' reference), dflash-mlx (oMLX's engine); comma-separated",
    )
    p.add_argument(
        "--peer-python",
        metavar="PYTHON",
        help="the interpreter the peer engines are installed in (default: this one), e.g. a venv's "
        "bin/python, so their pinned dependencies stay out of this environment",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    if args.compare:  # fail on a bad comparison file before spending time on the runs
        load_comparison(args.compare)
    engines = parse_engines(args.engines)
    if args.peer_python and not engines:
        raise ValueError("--peer-python goes with --engines (the peer engines it runs)")
    if args.replay_jitter and not args.replay:
        raise ValueError("--replay-jitter goes with --replay (it replays the kept answers on perturbed curves)")
    if args.costs and not args.replay:
        raise ValueError("--costs goes with --replay (it replays the recorded answers on that cost curve)")
    peer_python = check_python(args.peer_python) if args.peer_python else sys.executable
    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    if args.quick:
        args.trials, args.num_prompts, args.max_tokens = 1, 2, 24
    if args.tree_sim or args.replay:
        return run_alias(args)
    model, tokenizer, drafters, sources = load_bench_models(args)
    classic = load_target(args.baseline_draft_model, args.dtype)[0] if args.baseline_draft_model else None
    texts, prompts = bench_prompts(args, tokenizer)
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else None
    budgets = tuple(None if b == "auto" else int(b) for b in args.tree_budgets.split(",")) if args.tree_budgets else ()
    methods = methods_for(drafters, sizes, classic is not None, tuple(args.walk or ("greedy", "viterbi")), budgets)
    methods = with_copyspec_modes(methods, args.copyspec_modes.split(","))
    peers = PeerEngines()
    try:
        if engines:
            started = peers.start(
                engines,
                peer_python,
                args.model,
                args.dtype,
                model,
                [(label, d, src) for (label, d), src in zip(drafters, sources)],
            )
            methods += peer_methods(started, drafters, sizes)
        report = bench(model, tokenizer, prompts, methods, args.max_tokens, args.trials, args.temp or [0.0], classic)
    finally:
        peers.close()
    weights = [v for _, v in tree_flatten(model.parameters())]
    report["context"] = {
        "target": args.model or "SmolLM2-135M-Instruct (default)",
        "drafters": [label for label, _ in drafters],
        "drafter_names": drafter_names(drafters),
        "dtype": ",".join(sorted({str(w.dtype).split(".")[-1] for w in weights})),
        "prompts": len(prompts),
        "suites": args.prompts,
        "prompts_sha256": prompts_sha256(texts),
        "trials": args.trials,
        "max_tokens": args.max_tokens,
        "runtime": runtime_info(args.kernels),
        "engines": engines,
        "peer_python": peer_python if engines else None,
        "command": command_line(args),
        **report_context(),  # the commit and the package version
        "costs": report["costs"],  # the cost curves (in plain steps) adaptive mode and ddtree budgets ran on
    }
    console = report_console()
    markdown = render(report, console, args.wide)
    if args.compare:
        report["compare"] = load_comparison(args.compare)
        markdown += render_comparison(report["compare"], report["results"], console)
    if args.json:
        Path(args.json).write_text(report_json(report))
    write_markdown(args, markdown)
    return 1 if report["errors"] else 0


def run_alias(args) -> int:
    """`bench --tree-sim DATA` and `bench --replay`: say on stderr which command they are now, and run it."""
    if args.tree_sim:
        print(
            "dflash2 bench: --tree-sim DATA is the command `dflash2 tree-sim DATA` now, which takes the other "
            "flags as they are; running it",
            file=sys.stderr,
        )
        return tree_sim.run(args)
    print(
        "dflash2 bench: --replay is the command `dflash2 replay` now, which takes the other flags as they are; "
        "running it",
        file=sys.stderr,
    )
    return replay.run(args)
