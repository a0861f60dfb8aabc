"""What a deeper drafter or a wider draft vocabulary costs per cycle on this machine: the bundled DFlash 2 drafter's
config at 2, 3 and 4 layers (fresh weights, which the cost does not depend on; its 3,072-token draft vocabulary), or
with VOCAB given, at 2 layers over draft vocabularies of those sizes (the data's most frequent tokens);
`measure_costs` for each in rounds of a-b-c-c-b-a-a-b-c (the fastest of each), against the default target's plain
step and its forward over 8 tokens.

    .venv/bin/python runs/smollm2/layer_costs.py [VOCAB,VOCAB,...]

A drafter is worth its cost at block size 8 when its tau exceeds the first drafter's times the ratio of their cycles
(`cycle/plain` below): the tau a deeper or wider drafter must add to break even.
"""

from __future__ import annotations

import sys

from dflash2_apps.openblas import restart_with_openblas
from dflash2_mlx.costs import measure_costs
from dflash2_mlx.drafter import DFlashDraftModel
from dflash2_mlx.formats.vocab import most_frequent, token_counts
from dflash2_mlx.loading import bind_drafter, load_drafter, load_target
from dflash2_mlx.train.settings import deepened

BUNDLED = "dflash2_mlx/assets/drafters/smollm2-135m-dflash2-b8"
DATA = "runs/smollm2/data-384"


def main(vocab_sizes: list[int] | None) -> None:
    restart_with_openblas(sys.argv)
    model, _ = load_target()
    bundled = load_drafter(BUNDLED)
    if vocab_sizes:
        counts = token_counts(DATA, model.args.vocab_size)
        shapes = {f"2 layers, {n:,} tokens": (2, most_frequent(counts, n, model.args.vocab_size)) for n in vocab_sizes}
    else:  # the bundled drafter's 2 layers, and more as `--layers` grows it; its 3,072-token LM head
        shapes = {f"{n} layers": (n, bundled.draft_vocab) for n in (2, 3, 4)}
    pairs = {}
    for name, (layers, vocab) in shapes.items():
        drafter = DFlashDraftModel.from_config(deepened(bundled.config, layers))
        drafter.draft_vocab = vocab
        pairs[name] = (bind_drafter(drafter, model), drafter)
    names = list(pairs)
    timed = {name: [] for name in names}
    for name in names + names[::-1] + names:
        costs = measure_costs(*pairs[name], block_max=8)
        timed[name].append((costs.draft_s[8 - 2], costs.verify_s[0], costs.verify_s[8 - 1]))
    every = [r for rows in timed.values() for r in rows]
    plain, verify = min(r[1] for r in every), min(r[2] for r in every)  # the target's: the same in every round
    print(f"target: plain step {plain * 1e3:.1f} ms, forward over 8 tokens {verify / plain:.3f} plain steps")
    base = None
    for name, rows in timed.items():
        draft = min(r[0] for r in rows)
        cycle = (draft + verify) / plain
        base = base or cycle
        print(
            f"{name}: drafter pass (B = 8) {draft * 1e3:.1f} ms = {draft / plain:.3f} plain steps; "
            f"cycle {cycle:.3f} plain steps; tau needed vs {names[0]} x{cycle / base:.3f}"
        )


if __name__ == "__main__":
    main([int(n) for n in sys.argv[1].split(",")] if len(sys.argv) > 1 else None)
