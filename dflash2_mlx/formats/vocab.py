"""Draft vocabularies: the token ids a drafter may propose (frequency-ranked drafting, as FR-Spec and the
pruned-vocabulary drafters of SpecForge do).

The drafter's LM head is the target's, and over a full vocabulary (49k rows for SmolLM2, 152k for Qwen3) it
is most of the drafter's pass. Restricted to the tokens a target actually says, it is a fraction of that,
and tokens training never showed can no longer win a draft. Verification keeps the full vocabulary: a token
outside the draft vocabulary is simply never drafted (at T > 0 its draft probability is zero, and the
acceptance test uses that same distribution, so sampling stays exact).

On disk: `draft_vocab.safetensors` in the drafter folder, one int32 tensor `token_ids` (sorted, unique).
Frequency tables: a `dflash2 data` folder (counted over its training responses) or a `.npy` of counts per
token id.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from .shards import read_shards

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
COUNTS_FILE = "token_counts.npy"


def read_draft_vocab(folder: str | Path) -> np.ndarray | None:
    """The draft vocabulary stored in a drafter folder, or None (the whole vocabulary)."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    try:
        ids = np.array(mx.load(str(path))["token_ids"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path} is not a draft vocabulary (a safetensors file with an int32 'token_ids')") from e
    return check_ids(ids, where=str(path))


def write_draft_vocab(folder: str | Path, ids) -> Path:
    path = Path(folder) / DRAFT_VOCAB_FILE
    mx.save_safetensors(str(path), {"token_ids": mx.array(check_ids(np.asarray(ids), where="draft vocabulary"))})
    return path


def check_ids(ids: np.ndarray, where: str, vocab_size: int | None = None) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: a draft vocabulary is a non-empty 1-D list of token ids")
    ids = ids.astype(np.int32)
    if np.any(np.diff(ids) <= 0) or ids[0] < 0:
        raise ValueError(f"{where}: draft vocabulary token ids must be sorted, unique and non-negative")
    if vocab_size is not None and ids[-1] >= vocab_size:
        raise ValueError(f"{where}: draft vocabulary holds token id {ids[-1]}, outside the target's {vocab_size}")
    return ids


def token_counts(folder: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """How often each token id occurs in the training responses of a `dflash2 data` folder."""
    samples = read_shards(folder, heldout=False)
    if not samples:
        raise FileNotFoundError(f"{folder} holds no `dflash2 data` training samples to count tokens in")
    return response_counts(samples, vocab_size)


def response_counts(samples, vocab_size: int | None = None) -> np.ndarray:
    """How often each token id occurs in the responses of `samples` (`shards.Sample`s)."""
    responses = np.concatenate([s.tokens[s.prompt_len :] for s in samples])
    return np.bincount(responses, minlength=vocab_size or 0)


def read_counts(source: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """A frequency table: a `dflash2 data` folder (its saved `token_counts.npy`, else counted now) or a `.npy`
    file of counts per token id."""
    source = Path(source)
    path = source / COUNTS_FILE if source.is_dir() else source
    if path.is_file():
        counts = np.load(path)
        if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.number):
            raise ValueError(f"{path}: a frequency table is a 1-D array of counts per token id")
        return counts
    if source.is_dir():
        return token_counts(source, vocab_size)
    raise FileNotFoundError(f"frequency table {source} is neither a `dflash2 data` folder nor a .npy file")


def most_frequent(counts: np.ndarray, n: int, vocab_size: int, always=()) -> np.ndarray:
    """The n most frequent token ids (ties: lower ids first), plus `always` (e.g. EOS), sorted."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"--draft-vocab must be between 1 and the target's vocabulary ({vocab_size}), got {n}")
    counts = np.asarray(counts, np.float64)[:vocab_size]
    counts = np.pad(counts, (0, vocab_size - counts.size))
    if not np.any(counts > 0):
        raise ValueError("the frequency table counts no token of this target's vocabulary")
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, descending; then by id
    keep = set(order[:n].tolist()) | {int(t) for t in always if 0 <= int(t) < vocab_size}
    return np.array(sorted(keep), np.int32)
