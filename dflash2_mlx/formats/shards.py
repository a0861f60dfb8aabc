"""The training data on disk: `shard-NNNNN.npz` files of samples (prompt then response token ids), written
atomically by `dflash2 data` and read back whole or by split."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Sample:
    id: str
    tokens: np.ndarray  # prompt then response, int32
    prompt_len: int
    heldout: bool
    shard: str = ""  # the shard file's name without suffix ("shard-00012"), where its rows are cached
    start: int = 0  # its first token's row in that shard


def write_shard(path: Path, samples: list[Sample]) -> None:
    """Atomically (tmp + rename), so an interrupted run never leaves half a shard."""
    lengths = [len(s.tokens) for s in samples]
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        tokens=np.concatenate([s.tokens for s in samples]).astype(np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        prompt_lens=np.array([s.prompt_len for s in samples], np.int32),
        heldout=np.array([s.heldout for s in samples], bool),
        ids=np.array([s.id for s in samples]),
    )
    os.replace(tmp, path)


def read_shards(folder: str | Path, heldout: bool | None = None) -> list[Sample]:
    """Every sample in a data folder, optionally only one split."""
    samples = []
    for path in sorted(Path(folder).glob("shard-*.npz")):
        with np.load(path) as z:  # each z[name] reads and inflates that array again: once per shard
            ids, tokens, offsets, prompt_lens, held = (
                z[name] for name in ("ids", "tokens", "offsets", "prompt_lens", "heldout")
            )
        shard = path.name.removesuffix(".npz")
        for i, sid in enumerate(ids):
            if heldout is None or bool(held[i]) == heldout:
                start, end = int(offsets[i]), int(offsets[i + 1])
                samples.append(Sample(str(sid), tokens[start:end], int(prompt_lens[i]), bool(held[i]), shard, start))
    return samples
