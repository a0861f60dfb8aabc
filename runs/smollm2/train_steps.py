"""Seconds per training step without a feature cache, by how the step's target features are computed, in one run.

    .venv/bin/python runs/smollm2/train_steps.py [STEPS]

The recipe's batches of `runs/smollm2/data-384` (4 sequences x 64 anchors, the bundled DFlash 2 drafter continued),
steps 0..STEPS-1 (default 6), each step run by every way in turn, the order rotating from step to step:
`mlx, padded` (MLX float32 over the whole right-padded batch, as `dflash2 train` did before), `mlx` (each sequence
at its own length) and `torch` (the same, by PyTorch in the machine's dtype). Prints a markdown table: seconds for the
features alone and for the whole step (features included), per way and in total.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.loading import load_target
from dflash2_mlx.train import torch_engine
from dflash2_mlx.train.batches import make_batch
from dflash2_mlx.train.settings import TrainSettings
from dflash2_mlx.train.trainer import Trainer

DATA = "runs/smollm2/data-384"
DRAFTER = "dflash2_mlx/assets/drafters/smollm2-135m-dflash2-b8"


def main(steps: int) -> None:
    restart_with_openblas(sys.argv)
    model, _ = load_target()

    def trainer(engine: str, out: str) -> Trainer:
        settings = TrainSettings(
            data=DATA,
            init_from=DRAFTER,
            cache_features=False,
            feature_engine=engine,
            steps=1000,
            sequences_per_step=4,
            anchors_per_sequence=64,
            learning_rate=5e-4,
            mask_token_id=0,
            draft_vocab=3072,
            eval_samples=1,
        )
        return Trainer(model, out, settings)

    padded = trainer("mlx", "/tmp/train_steps/padded")
    padded._lengths = lambda batch, split: None  # the whole padded batch in one pass
    ways = {
        "mlx, padded": padded,
        "mlx": trainer("mlx", "/tmp/train_steps/mlx"),
        "torch": trainer("torch", "/tmp/train_steps/torch"),
    }
    names = list(ways)
    seconds = {name: {"features": 0.0, "step": 0.0} for name in names}
    print(f"torch dtype: {torch_engine.machine_dtype()}", flush=True)
    for step in range(steps):
        order = names[step % len(names) :] + names[: step % len(names)]
        for name in order:
            t = ways[name]
            t.step = step
            batch = make_batch(t.train_samples, step, t.settings, t.drafter.config.mask_token_id)
            tic = time.perf_counter()
            mx.eval(t.context(batch, "train"))
            seconds[name]["features"] += time.perf_counter() - tic
            tic = time.perf_counter()
            t.train_step()
            seconds[name]["step"] += time.perf_counter() - tic
        print(
            f"step {step}: padded to {batch.tokens.shape[1]} tokens, sequences of "
            f"{[len(t.train_samples[i].tokens) for i in batch.picked]}",
            flush=True,
        )
    print("| way | features s / step | whole step s | steps / min | vs mlx, padded |")
    print("|---|---|---|---|---|")
    base = seconds["mlx, padded"]["step"]
    for name in names:
        s = seconds[name]
        print(
            f"| {name} | {s['features'] / steps:.1f} | {s['step'] / steps:.1f} | {60 * steps / s['step']:.1f} | "
            f"{base / s['step']:.2f}x |"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
