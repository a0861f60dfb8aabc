"""What a draft vocabulary caps: the share of held-out response tokens it holds, per domain, and the tau a drafter
could reach at all with it (a drafted token outside the vocabulary is never drafted, so the block stops there).

    .venv/bin/python runs/smollm2/vocab_ceiling.py runs/smollm2/data-384 [SIZES]

SIZES (comma-separated, default 3072,4096,8192,16384 and the whole vocabulary): draft vocabularies of the N most
frequent tokens of the data folder's training responses, as `dflash2 train --draft-vocab N` takes them. For every
block of 8 anchored at each position of each held-out response, tau = 1 + the drafts accepted when each draft inside
the vocabulary is accepted with probability q (q = 1: a perfect drafter, the ceiling), the first draft outside it
stopping the block; the mean over all blocks. Prints a markdown table.
"""

from __future__ import annotations

import sys

import numpy as np

from dflash2_mlx.domains import DOMAINS, prompt_domain
from dflash2_mlx.formats.vocab import most_frequent, response_counts
from dflash2_mlx.loading import load_target
from dflash2_mlx.train.data import distinct_prompts, read_shards

BLOCK = 8
ACCEPTANCE = (1.0, 0.6, 0.5)


def block_taus(inside: np.ndarray, q: float) -> np.ndarray:
    """The tau of each block anchored at a position of one response; `inside[i]`: response token i is in the
    vocabulary."""
    n = max(0, len(inside) - BLOCK)
    run = np.zeros(n, int)  # drafts inside the vocabulary before the first one outside it, up to BLOCK - 1
    alive = np.ones(n, bool)
    for j in range(1, BLOCK):
        alive &= inside[j : j + n]
        run += alive
    return 1 + np.array([sum(q**i for i in range(1, r + 1)) for r in run])


def main(data: str, sizes: list[int] | None) -> None:
    _, tokenizer = load_target()
    sizes = sizes or [3072, 4096, 8192, 16384, tokenizer.vocab_size]
    heldout = read_shards(data, heldout=True)
    counts = response_counts(distinct_prompts(read_shards(data, heldout=False), heldout), tokenizer.vocab_size)
    domain = [prompt_domain(tokenizer.decode(s.tokens[: s.prompt_len].tolist())) for s in heldout]
    print(
        "| draft vocabulary | held-out tokens inside | "
        + " | ".join(f"{d} inside" for d in DOMAINS)
        + " | "
        + " | ".join(f"tau at q = {q:g}" for q in ACCEPTANCE)
        + " |"
    )
    print("|---|---|" + "---|" * (len(DOMAINS) + len(ACCEPTANCE)))
    for size in sizes:
        inside_vocab = np.zeros(tokenizer.vocab_size, bool)
        inside_vocab[most_frequent(counts, size, tokenizer.vocab_size)] = True
        inside = [inside_vocab[s.tokens[s.prompt_len :]] for s in heldout]
        share = {d: np.concatenate([x for x, k in zip(inside, domain) if k == d]).mean() for d in DOMAINS}
        taus = [np.concatenate([block_taus(x, q) for x in inside]).mean() for q in ACCEPTANCE]
        print(
            f"| {size:,} | {np.concatenate(inside).mean():.1%} | "
            + " | ".join(f"{share[d]:.1%}" for d in DOMAINS)
            + " | "
            + " | ".join(f"{t:.3f}" for t in taus)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else None)
