"""`dflash2 data`'s engines end to end, each run as a user runs it (its own `dflash2 data` process, ShareGPT's first
turns up to 256 tokens, a fresh folder), alternating in one run: MLX (float32, OpenBLAS preloaded), torch (its
machine dtype, no OpenBLAS), and torch with OpenBLAS preloaded (how `dflash2 data` ran it before it learned not
to), then the same in reverse. Prints a Markdown row per run (wall and CPU seconds, tokens/s, conversations a
minute), each engine's mean, and how many answers are token-identical to MLX's.

    .venv/bin/python runs/smollm2/data_engines.py [PROMPTS] [NEW_TOKENS] [BATCH]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash2_apps.openblas import openblas_library
from dflash2_mlx.formats.shards import read_shards

VARIANTS = {
    "mlx": ("mlx", {}),
    "torch": ("torch", {"DFLASH2_NO_OPENBLAS": ""}),
    "torch + OpenBLAS": ("torch", {"DFLASH2_NO_OPENBLAS": "1", "LD_PRELOAD": openblas_library() or ""}),
}


def run(folder: Path, variant: str, n: int, new_tokens: int, batch: int) -> dict:
    engine, env = VARIANTS[variant]
    command = [sys.executable, "-m", "dflash2_apps.cli", "data", "--out", str(folder), "--num-prompts", str(n)]
    command += ["--max-prompt-tokens", "256", "--max-new-tokens", str(new_tokens), "--batch-size", str(batch)]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([*command, "--engine", engine], env={**os.environ, **env}, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = json.loads((folder / "data.json").read_text())["runs"][-1]
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {**record, "wall": time.perf_counter() - start, "cpu": cpu}


def main(n: int, new_tokens: int, batch: int) -> None:
    order = [*VARIANTS, *reversed(VARIANTS)]
    rates, answers = {v: [] for v in VARIANTS}, {}
    print("| run | engine | wall s | CPU s | response tok/s | conversations / min |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(order):
            folder = Path(tmp) / f"{i}"
            r = run(folder, variant, n, new_tokens, batch)
            rates[variant].append(r["prompts_per_min"])
            answers[variant] = {s.id: s.tokens[s.prompt_len :].tolist() for s in read_shards(folder)}
            name = f"{variant} ({r.get('dtype', 'float32')})"
            print(
                f"| {i + 1} | {name} | {r['wall']:.0f} | {r['cpu']:.0f} | {r['tokens_per_s']} | "
                f"{r['prompts_per_min']} |",
                flush=True,
            )
    mean = {v: sum(r) / len(r) for v, r in rates.items()}
    for v in VARIANTS:
        same = sum(answers[v][k] == answers["mlx"].get(k) for k in answers[v])
        print(
            f"{v}: {mean[v]:.1f} conversations a minute, {mean[v] / mean['mlx']:.2f}x MLX; "
            f"{same} of {len(answers[v])} answers token-identical to MLX's"
        )


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] + [128, 128, 64][len(sys.argv) - 1 :]
    main(*args)
