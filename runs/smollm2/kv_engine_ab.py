"""The torch data engine's decoding with its key/value cache in bfloat16 (attention by PyTorch's fused
`scaled_dot_product_attention`) against the float32 cache and hand-written attention it replaced, in one run
(ABAB), on `runs/smollm2/data-384` prompts with their multi-turn context: tokens per second and how many responses
are the same.

    .venv/bin/python runs/smollm2/kv_engine_ab.py [PROMPTS] [NEW_TOKENS]
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.formats.shards import read_shards
from dflash2_mlx.loading import load_target
from dflash2_mlx.train import torch_engine


class Float32Cache(torch_engine.TorchTarget):
    """The engine before: a float32 cache, attention by hand in float32."""

    def __init__(self, model, slots, max_len, dtype="bfloat16"):
        super().__init__(model, slots, max_len, dtype)
        self.keys, self.values = self.keys.float(), self.values.float()

    def _attend(self, q, keys, values, mask):
        n, _, s, d = q.shape
        group = self.heads // self.kv_heads
        q = q.reshape(n, self.kv_heads, group * s, d) * (1.0 / math.sqrt(d))
        scores = (q @ keys.transpose(-1, -2)).view(n, self.kv_heads, group, s, -1)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1)
        return (scores.view(n, self.kv_heads, group * s, -1) @ values).view(n, self.heads, s, d)


def run(model, prompts, new_tokens, engine) -> tuple[float, dict]:
    real = torch_engine.TorchTarget
    torch_engine.TorchTarget = engine
    try:
        tic = time.perf_counter()
        out = dict(torch_engine.generate(model, prompts, new_tokens, [], slots=64, max_prompt_tokens=512))
        return sum(len(r) for r in out.values()) / (time.perf_counter() - tic), out
    finally:
        torch_engine.TorchTarget = real


def main(n: int, new_tokens: int) -> None:
    model, _ = load_target(None, "float32")
    samples = [s for s in read_shards("runs/smollm2/data-384") if not s.heldout]
    rng = np.random.default_rng(0)
    prompts = [samples[i].tokens[: samples[i].prompt_len].tolist() for i in rng.permutation(len(samples))[:n]]
    print(f"{n} prompts of {np.mean([len(p) for p in prompts]):.0f} tokens on average, {new_tokens} new tokens each")
    rates, outs = {"float32 cache": [], "bfloat16 cache": []}, {}
    for name in ["float32 cache", "bfloat16 cache", "bfloat16 cache", "float32 cache"]:
        rate, out = run(model, prompts, new_tokens, Float32Cache if name.startswith("float32") else real_engine)
        rates[name].append(rate)
        outs[name] = out
        print(f"{name}: {rate:.1f} tokens/s", flush=True)
    a, b = outs["float32 cache"], outs["bfloat16 cache"]
    same = sum(a[i] == b[i] for i in a)
    first = [next((j for j, (x, y) in enumerate(zip(a[i], b[i])) if x != y), len(a[i])) for i in a]
    print(
        f"bfloat16 / float32 cache: {np.mean(rates['bfloat16 cache']) / np.mean(rates['float32 cache']):.2f}x; "
        f"same response {same} of {len(a)}; first difference at token {np.median(first):.0f} (median)"
    )


real_engine = torch_engine.TorchTarget

if __name__ == "__main__":
    restart_with_openblas(sys.argv)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64, int(sys.argv[2]) if len(sys.argv) > 2 else 96)
