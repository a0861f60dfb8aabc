"""`dflash2 train`: a DFlash v1 or DFlash 2 drafter trained for a target on `dflash2 data` output; data parallel
over several processes or Macs when started by `mlx.launch` (`mlx.launch -n 2 python -m dflash2_apps.cli train ...`)."""

from __future__ import annotations

import sys
from dataclasses import fields

from dflash2_mlx import process_group as ranks
from dflash2_mlx.loading import load_target
from dflash2_mlx.train.data import ENGINES
from dflash2_mlx.train.export import write_card
from dflash2_mlx.train.settings import TrainSettings, check_world_size
from dflash2_mlx.train.trainer import Trainer

# `dflash2 train` flag -> (TrainSettings field, type, help); each default is the dataclass's, shown in --help.
TRAIN_FLAGS = {
    "--arch": (
        "architecture",
        str,
        "dflash2 or v1 (default dflash2; with --init-from: the folder's, and "
        "dflash2 over a v1 folder warm-starts a DFlash 2 drafter from it)",
    ),
    "--block-size": ("block_size", int, "block size the drafter is trained for"),
    "--layers": (
        "layers",
        int,
        "drafter layers (default 1; with --init-from: the folder's, and more adds layers on top that start as "
        "the identity)",
    ),
    "--steps": ("steps", int, "optimizer steps (the schedule's length; a longer value on resume stretches it)"),
    "--sequences-per-step": ("sequences_per_step", int, "training sequences per step"),
    "--anchors-per-sequence": ("anchors_per_sequence", int, "blocks drafted from random anchors per sequence"),
    "--lr": ("learning_rate", float, "peak learning rate (warmup 4%%, cosine to 10%%)"),
    "--selector-rank": ("selector_rank", int, "DFlash 2 path selector rank"),
    "--mask-token-id": ("mask_token_id", int, "the block's mask token (default: the last vocabulary id)"),
    "--eval-every": ("eval_every", int, "steps between held-out evaluations (tau, first-draft accuracy)"),
    "--checkpoint-every": ("checkpoint_every", int, "steps between checkpoints"),
    "--seed": ("seed", int, "the batches and the initialization"),
    "--init-from": (
        "init_from",
        str,
        "start from this drafter folder or hub id (its config replaces --block-size; --layers may add layers)",
    ),
    "--distill": (
        "distill",
        float,
        "weight of the loss to the target's top-8 next-token distribution (cached "
        "with the features); 0 = hard labels only",
    ),
    "--chain-loss": (
        "chain_loss",
        float,
        "weight of the expected accepted length of each block (the drafts' gold probabilities multiplied "
        "along the block, summed), subtracted from the loss; 0 = off",
    ),
    "--gamma": (
        "gamma",
        float,
        "draft k's loss weight is exp(-(k-1)/gamma) (default: the paper's, 4 at block 8, 5 at 10, 7 at 16)",
    ),
    "--draft-vocab": (
        "draft_vocab",
        int,
        "train and draft over the N most frequent tokens of the training "
        "responses (the drafter's draft vocabulary: a smaller LM head in every training step and "
        "draft; the loss skips drafts of rarer tokens); default: every token of the training data",
    ),
    "--ema": (
        "ema",
        float,
        "decay of an exponential moving average of the weights (e.g. 0.999): the average is "
        "what is evaluated and exported, the raw weights' tau is logged beside it; 0 = off",
    ),
    "--time-budget": (
        "time_budget",
        float,
        "minutes of wall time for this run: it stops there with a checkpoint, and rerunning the command continues",
    ),
    "--peer-timeout": (
        "peer_timeout",
        float,
        "under mlx.launch: seconds a rank waits for the others (to join, then at "
        "each step) before it stops with an error",
    ),
}


def add_parser(sub) -> None:
    defaults = {f.name: f.default for f in fields(TrainSettings)}
    p = sub.add_parser(
        "train",
        help="train a DFlash v1 or DFlash 2 drafter for a target on `dflash2 data` output",
        description="Train a drafter (resumable: rerun the same command to continue from the last checkpoint). "
        "Writes OUT/checkpoint and OUT/curve.csv (the held-out learning curve), then OUT/drafter (a folder "
        "`--draft-model` and `dflash2 export` take) with its card. Runs unchanged on MLX's CUDA backend. Under "
        "`mlx.launch` (e.g. `mlx.launch --hostfile hosts.json python -m dflash2_apps.cli train ...`) the ranks "
        "share each step's sequences (the same steps as one process) and rank 0 writes OUT.",
    )
    p.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="a `dflash2 data` folder")
    p.add_argument("--out", required=True)
    for flag, (name, kind, text) in TRAIN_FLAGS.items():
        default = defaults[name]
        p.add_argument(
            flag,
            type=kind,
            dest=name,
            choices=["dflash2", "v1"] if name == "architecture" else None,
            help=text if default is None or name == "architecture" else f"{text} (default {default})",
        )
    p.add_argument("--full-selector", action="store_true", help="V x R codebooks instead of factorised ones")
    p.add_argument(
        "--init-from-target",
        action="store_true",
        help="start the drafter's layers and final norm as the target's last layers",
    )
    p.add_argument(
        "--distinct-anchors",
        action="store_true",
        help="draw each sequence's anchors without replacement (more of its tokens supervised per step)",
    )
    p.add_argument(
        "--feature-engine",
        choices=ENGINES,
        default="auto",
        help="what computes the target's features (the cache, or each step's with --no-feature-cache): auto takes "
        "PyTorch on an x86-64 CPU where it is installed (in bfloat16 where the CPU has avx512_bf16 or AMX, with a "
        "cache of its own; else float32), MLX elsewhere",
    )
    p.add_argument(
        "--no-feature-cache",
        action="store_true",
        help="compute the training samples' features at every step instead of once into the data folder (the "
        "held-out samples' are cached in any case)",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    given = {name: getattr(args, name) for name, _, _ in TRAIN_FLAGS.values() if getattr(args, name) is not None}
    settings = TrainSettings(
        data=args.data,
        selector_factorized=not args.full_selector,
        cache_features=not args.no_feature_cache,
        init_from_target=args.init_from_target,
        distinct_anchors=args.distinct_anchors,
        feature_engine=args.feature_engine,
        **given,
    )
    peers = None
    if ranks.launched():
        check_world_size(settings, ranks.world_size())  # before any work
        peers = ranks.join(settings.peer_timeout)
        check_world_size(settings, peers.size)
    model, _ = load_target(args.model)
    trainer = Trainer(model, args.out, settings, peers)
    result = trainer.run()
    if not trainer.writes:
        return 0
    folder = trainer.export(f"{args.out}/drafter")
    write_card(folder, trainer, args.model or "SmolLM2-135M-Instruct")
    tau = next((e["tau"] for e in reversed(trainer.log) if "tau" in e), None)
    print(f"{folder}: step {result['step']}, held-out tau {tau}", file=sys.stderr)
    return 0
