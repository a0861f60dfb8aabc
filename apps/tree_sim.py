"""`dflash2 tree-sim DATA`: teacher-forced tau of the linear path and of ddtree trees, no timing.
`dflash2 bench --tree-sim DATA` runs it too (with bench's flags of the same names)."""

from __future__ import annotations

from dflash2_apps.common import add_bench_model_args, load_bench_models, write_markdown
from dflash2_mlx.kernels import use_metal
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.train.data import read_shards
from dflash2_mlx.train.tree_eval import simulate_tree_acceptance


def tree_sim(args, model, drafters) -> int:
    """The teacher-forced tau table, one row per drafter (and block size)."""
    samples = read_shards(args.tree_sim, heldout=True)[: args.tree_sim_samples]
    if not samples:
        raise ValueError(f"{args.tree_sim} holds no held-out samples: give a `dflash2 data` folder of this target")
    budgets = [int(b) for b in (args.tree_budgets or "1,2,4,8,16,32").split(",")]
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else [None]
    lines = [
        f"teacher-forced tau on {len(samples)} held-out samples of {args.tree_sim}",
        "",
        "| drafter | B | blocks | linear | " + " | ".join(f"tree {b}" for b in budgets) + " |",
        "|---|---|---|---|" + "---|" * len(budgets),
    ]
    for label, drafter in drafters:
        for B in sizes:
            sim = simulate_tree_acceptance(bind_drafter(drafter, model), drafter, samples, budgets, B)
            taus = [sum(sim["tree"][b]) / sim["blocks"] + 1 for b in budgets]
            lines.append(
                f"| {label} | {B or drafter.config.block_size} | {sim['blocks']} | "
                f"{sum(sim['linear']) / sim['blocks'] + 1:.2f} | " + " | ".join(f"{t:.2f}" for t in taus) + " |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    write_markdown(args, text)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tree-sim",
        help="teacher-forced tau of the linear path and of ddtree trees per budget, on held-out samples (no timing)",
        description="For each drafter (and block size): the mean tokens a cycle would commit (tau) along the "
        "held-out samples of a `dflash2 data` folder, verifying the linear path and trees of each budget, "
        "teacher-forced on the samples' responses (greedy responses of this target).",
    )
    p.add_argument("tree_sim", metavar="DATA", help="a `dflash2 data` folder made with this target")
    add_bench_model_args(p)
    p.add_argument("--block-sizes", help="comma-separated block sizes (default: each drafter's trained size)")
    p.add_argument(
        "--budgets",
        "--tree-budgets",
        dest="tree_budgets",
        metavar="LIST",
        help="comma-separated tree budgets (draft nodes per tree), a column each (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--samples",
        "--tree-sim-samples",
        dest="tree_sim_samples",
        type=int,
        default=8,
        metavar="N",
        help="held-out samples read (default 8)",
    )
    p.add_argument("--markdown", metavar="OUT", help="write the table as markdown here")
    p.set_defaults(run=run)


def run(args) -> int:
    """`dflash2 tree-sim` (and `dflash2 bench --tree-sim`): load the target and the drafters, and simulate."""
    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    model, _, drafters, _ = load_bench_models(args)
    return tree_sim(args, model, drafters)
