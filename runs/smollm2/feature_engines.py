"""The target's teacher features by MLX (float32 + OpenBLAS) and by PyTorch (the machine's dtype), in one run.

    .venv/bin/python runs/smollm2/feature_engines.py

Both engines compute `Target.teacher` of the same 16 x 256 random token batch (the bundled drafters' five feature
layers), in the order MLX, torch, torch, MLX, with and without the top-8 next tokens; prints tokens/s of each,
their ratio, and the relative Frobenius difference of the features.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import numpy as np

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.loading import load_drafter, load_target
from dflash2_mlx.target import Target
from dflash2_mlx.train.torch_engine import TorchTarget

DRAFTER = "dflash2_mlx/assets/drafters/smollm2-135m-dflash2-b8"


def main() -> None:
    restart_with_openblas(sys.argv)
    model, _ = load_target()
    layers = list(load_drafter(DRAFTER).config.target_layer_ids)
    target, engine = Target(model, layers), TorchTarget(model, slots=0, max_len=0)
    tokens = np.random.default_rng(0).integers(0, 30000, (16, 256))

    def by_mlx(top_k):
        features, ids, logprobs = target.teacher(mx.array(tokens), top_k)
        mx.eval(features, ids, logprobs)
        return np.array(features.astype(mx.float32))

    def by_torch(top_k):
        return engine.sequences(tokens, layers, top_k)[0]

    for top_k in (0, 8):
        seconds, out = {"mlx": [], "torch": []}, {}
        for name, run in (("mlx", by_mlx), ("torch", by_torch), ("torch", by_torch), ("mlx", by_mlx)):
            tic = time.perf_counter()
            out[name] = run(top_k)
            seconds[name].append(time.perf_counter() - tic)
        mlx_s, torch_s = np.mean(seconds["mlx"]), np.mean(seconds["torch"])
        diff = np.linalg.norm(out["torch"] - out["mlx"]) / np.linalg.norm(out["mlx"])
        print(
            f"top_k {top_k}: MLX {tokens.size / mlx_s:.0f} tok/s, torch {tokens.size / torch_s:.0f} tok/s, "
            f"torch / MLX {mlx_s / torch_s:.2f}x, relative difference {diff:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
