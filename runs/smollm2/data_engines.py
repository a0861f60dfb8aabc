"""`dflash2 data`'s two engines end to end on the same prompts (ShareGPT's first turns, up to 256 tokens), in one
run (MLX, torch, torch, MLX), each at its batch size: conversations a minute, response tokens a second, and how many
answers are the same. (mlx-lm's batch prefill of prompts with long multi-turn contexts is too slow on this CPU for
MLX to be timed on them.)

    .venv/bin/python runs/smollm2/data_engines.py [PROMPTS] [NEW_TOKENS] [MLX_BATCH] [TORCH_BATCH]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.formats.shards import read_shards
from dflash2_mlx.loading import load_target
from dflash2_mlx.train.data import DataSettings, build


def main(n: int, new_tokens: int, batches: dict[str, int]) -> None:
    model, tokenizer = load_target(None, "float32")
    rates, answers = {"mlx": [], "torch": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, engine in enumerate(["mlx", "torch", "torch", "mlx"]):
            settings = DataSettings(None, n, 256, new_tokens, 0.0, 0, batches[engine], engine)
            out = build(Path(tmp) / f"{engine}-{i}", settings, model, tokenizer, progress=False)
            run = json.loads((out / "data.json").read_text())["runs"][-1]
            rates[engine].append(run)
            answers[engine] = {s.id: s.tokens[s.prompt_len :].tolist() for s in read_shards(out)}
            print(
                f"{engine}: {run['prompts_per_min']} conversations a minute, {run['tokens_per_s']} tokens/s", flush=True
            )
    mean = {e: sum(r["prompts_per_min"] for r in runs) / len(runs) for e, runs in rates.items()}
    same = sum(answers["mlx"][k] == answers["torch"].get(k) for k in answers["mlx"])
    print(
        f"torch / mlx: {mean['torch'] / mean['mlx']:.2f}x conversations a minute; same answer {same} of "
        f"{len(answers['mlx'])}"
    )


if __name__ == "__main__":
    restart_with_openblas(sys.argv)
    args = [int(a) for a in sys.argv[1:]] + [128, 128, 64, 128][len(sys.argv) - 1 :]
    main(args[0], args[1], {"mlx": args[2], "torch": args[3]})
