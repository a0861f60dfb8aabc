"""Held-out tau of drafter folders on a data folder's held-out samples: all of them, those whose response is not in
a loop, those whose prompt no bundled drafter trained on (not a training prompt of `runs/smollm2/data`), and per
domain (`dflash2_mlx.domains`: chat, code, math) with their mean.

    .venv/bin/python runs/smollm2/heldout_tau.py runs/smollm2/data-384 FOLDER [FOLDER ...]

Teacher-forced, T = 0, each folder's card settings; every held-out block is drafted once and each subset's tau is
the mean over its samples' blocks (`evaluate_folder`: block size, anchors, draft vocabulary size
taken from the data folder's training responses). Prints one markdown row per folder.
"""

from __future__ import annotations

import sys

import numpy as np

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.domains import DOMAINS, prompt_domain
from dflash2_mlx.loading import load_target
from dflash2_mlx.train.data import prompt_key, read_shards
from dflash2_mlx.train.evaluate import summary
from dflash2_mlx.train.folder_eval import folder_trainer

BUNDLED_DATA = "runs/smollm2/data"


def main(data: str, folders: list[str]) -> None:
    restart_with_openblas(sys.argv)
    model, tokenizer = load_target()
    seen = {prompt_key(s) for s in read_shards(BUNDLED_DATA, heldout=False)}
    print(
        "| drafter | all held-out | not in a loop | prompt unseen by the bundled drafters | both | "
        + " | ".join(DOMAINS)
        + " | mean of the domains |"
    )
    print("|---|---|---|---|---|" + "---|" * (len(DOMAINS) + 1))
    for folder in folders:
        with folder_trainer(model, data, folder, eval_samples=10**6) as trainer:
            heldout = trainer.heldout
            accepted = trainer.accepted_blocks()  # every held-out block once; the subsets are rows of it
            loop_free = list(trainer.loop_free_rows())
            unseen = [prompt_key(s) not in seen for s in heldout]
            domain = [prompt_domain(tokenizer.decode(s.tokens[: s.prompt_len].tolist())) for s in heldout]
            subsets = {
                "all": [True] * len(heldout),
                "loop-free": loop_free,
                "unseen": unseen,
                "both": [a and b for a, b in zip(loop_free, unseen)],
            } | {d: [x == d for x in domain] for d in DOMAINS}
            cells, taus = [], {}
            for name, keep in subsets.items():
                taus[name] = summary(accepted[np.array(keep, bool)], trainer.settings.block_size).tau
                cells.append(f"{taus[name]:.4f} ({sum(keep)})")
            cells.append(f"{sum(taus[d] for d in DOMAINS) / len(DOMAINS):.4f}")
        print(f"| {folder} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
