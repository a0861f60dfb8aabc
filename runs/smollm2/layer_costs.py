"""What a deeper drafter costs per cycle on this machine: the bundled DFlash 2 drafter's config at 2, 3 and 4 layers
(fresh weights, which the cost does not depend on; its draft vocabulary), `measure_costs` for each in rounds of
2-3-4-4-3-2-2-3-4 (the fastest of each), against the default target's plain step and its forward over 8 tokens.

    .venv/bin/python runs/smollm2/layer_costs.py

A drafter with L layers is worth its cost at block size 8 when its tau exceeds the 2-layer drafter's times the ratio of
their cycles (`cycle/plain` below): the tau a deeper drafter must add to break even.
"""

from __future__ import annotations

import sys

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.costs import measure_costs
from dflash2_mlx.drafter import DFlashDraftModel
from dflash2_mlx.loading import bind_drafter, load_drafter, load_target
from dflash2_mlx.train.settings import deepened

BUNDLED = "dflash2_mlx/assets/drafters/smollm2-135m-dflash2-b8"
ROUNDS = (2, 3, 4, 4, 3, 2, 2, 3, 4)


def main() -> None:
    restart_with_openblas(sys.argv)
    model, _ = load_target()
    bundled = load_drafter(BUNDLED)
    config = bundled.config
    pairs = {}
    for layers in sorted(set(ROUNDS)):
        deeper = deepened(config, layers)  # the bundled drafter's 2, and more as `--layers` grows it
        drafter = DFlashDraftModel.from_config(deeper)
        drafter.draft_vocab = bundled.draft_vocab  # its 3,072-token LM head, as the bundled drafter drafts
        pairs[layers] = (bind_drafter(drafter, model), drafter)
    timed = {layers: [] for layers in pairs}
    for layers in ROUNDS:
        costs = measure_costs(*pairs[layers], block_max=8)
        timed[layers].append((costs.draft_s[8 - 2], costs.verify_s[0], costs.verify_s[8 - 1]))
    every = [r for rows in timed.values() for r in rows]
    plain, verify = min(r[1] for r in every), min(r[2] for r in every)  # the target's: the same in every round
    print(f"target: plain step {plain * 1e3:.1f} ms, forward over 8 tokens {verify / plain:.3f} plain steps")
    base = None
    for layers, rows in timed.items():
        draft = min(r[0] for r in rows)
        cycle = (draft + verify) / plain
        base = base or cycle
        print(
            f"{layers} layers: drafter pass (B = 8) {draft * 1e3:.1f} ms = {draft / plain:.3f} plain steps; "
            f"cycle {cycle:.3f} plain steps; tau needed vs 2 layers x{cycle / base:.3f}"
        )


if __name__ == "__main__":
    main()
