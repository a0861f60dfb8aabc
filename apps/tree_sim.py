"""`dflash2 bench --tree-sim`: teacher-forced tau of the linear path and of ddtree trees, no timing."""

from __future__ import annotations

from dflash2_apps.common import write_markdown
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.train.data import read_shards
from dflash2_mlx.train.tree_eval import simulate_tree_acceptance


def tree_sim(args, model, drafters) -> int:
    """`bench --tree-sim`: the teacher-forced tau table, one row per drafter (and block size)."""
    samples = read_shards(args.tree_sim, heldout=True)[: args.tree_sim_samples]
    if not samples:
        raise ValueError(f"{args.tree_sim} holds no held-out samples: give a `dflash2 data` folder of this target")
    budgets = [int(b) for b in (args.tree_budgets or "1,2,4,8,16,32").split(",")]
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else [None]
    lines = [f"teacher-forced tau on {len(samples)} held-out samples of {args.tree_sim}", "",
             "| drafter | B | blocks | linear | " + " | ".join(f"tree {b}" for b in budgets) + " |",
             "|---|---|---|---|" + "---|" * len(budgets)]
    for label, drafter in drafters:
        for B in sizes:
            sim = simulate_tree_acceptance(bind_drafter(drafter, model), drafter, samples, budgets, B)
            taus = [sum(sim["tree"][b]) / sim["blocks"] + 1 for b in budgets]
            lines.append(f"| {label} | {B or drafter.config.block_size} | {sim['blocks']} | "
                         f"{sum(sim['linear']) / sim['blocks'] + 1:.2f} | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_markdown(args, text)
    return 0
