"""The training batches: a few sequences and many random anchors in their responses, each anchor a block
`[anchor, mask x (B-1)]` whose drafts should be the B-1 tokens after it; and the token ids the loss is over."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..drafter import TrainingBlocks
from ..formats.shards import Sample
from ..formats.vocab import most_frequent, response_counts
from .data import padded_tokens
from .settings import TrainSettings


@dataclass
class Batch:
    tokens: mx.array  # [S, L] padded sequences
    blocks: mx.array  # [N, B] anchor + masks
    labels: mx.array  # [N, B-1] the tokens the drafts should be; -1 past a sequence's end
    where: TrainingBlocks
    picked: list[int]  # the samples, one per sequence row


def anchor_positions(rng: np.random.Generator, first: int, last: int, count: int, distinct: bool) -> np.ndarray:
    """`count` anchors in [first, last]: drawn with replacement, or `distinct` (without replacement: every
    position once where there are fewer, the rest drawn again), which covers more of a response's tokens."""
    if not distinct:
        return rng.integers(first, last + 1, size=count)
    positions = last - first + 1
    if positions >= count:
        return first + rng.choice(positions, size=count, replace=False)
    return np.concatenate([np.arange(first, last + 1), rng.integers(first, last + 1, size=count - positions)])


def make_batch(
    samples: list[Sample], step: int, settings: TrainSettings, mask_id: int, sequences: int | None = None
) -> Batch:
    """The batch of `step`: a pure function of (seed, step), which makes resumed runs exact."""
    rng = np.random.default_rng([settings.seed, step])
    picked = rng.choice(len(samples), size=sequences or settings.sequences_per_step, replace=False)
    length = max(len(samples[i].tokens) for i in picked)
    length = int(math.ceil(length / 64) * 64)  # few distinct shapes, few recompilations
    tokens = padded_tokens(samples, picked, length)
    anchors, labels = [], []
    B = settings.block_size
    for i in picked:
        s = samples[i]
        first, last = s.prompt_len, len(s.tokens) - 2  # anchors are response tokens with a next token
        if last < first:
            first = last = max(len(s.tokens) - 2, 0)
        a = anchor_positions(rng, first, last, settings.anchors_per_sequence, settings.distinct_anchors)
        for anchor in a:
            nxt = s.tokens[anchor + 1 : anchor + B]
            labels.append(np.concatenate([nxt, -np.ones(B - 1 - len(nxt), np.int32)]))
        anchors.append(a)
    anchors = np.stack(anchors)  # [S, A]
    blocks = np.full((anchors.size, B), mask_id, np.int32)
    blocks[:, 0] = np.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    return Batch(
        mx.array(tokens),
        mx.array(blocks),
        mx.array(np.stack(labels)),
        TrainingBlocks(mx.array(anchors)),
        [int(i) for i in picked],
    )


def share(batch: Batch, rank: int, size: int) -> Batch:
    """Rank `rank`'s share of a step's batch over `size` data-parallel ranks: sequences rank, rank + size, ...
    with their blocks (padded to the whole batch's length, as one process pads them)."""
    S, A = batch.where.anchors.shape
    if S % size:
        raise ValueError(f"a batch of {S} sequences does not split over {size} ranks")
    seqs = np.arange(rank, S, size)
    rows = (seqs[:, None] * A + np.arange(A)).reshape(-1)
    seqs, rows = mx.array(seqs), mx.array(rows)
    return Batch(
        batch.tokens[seqs],
        batch.blocks[rows],
        batch.labels[rows],
        TrainingBlocks(batch.where.anchors[seqs]),
        [batch.picked[i] for i in range(rank, S, size)],
    )


def training_vocabulary(samples: list[Sample]) -> np.ndarray:
    """Every token id the training samples contain (prompts and responses), sorted."""
    return np.unique(np.concatenate([s.tokens for s in samples])).astype(np.int32)


def loss_vocabulary(samples: list[Sample], settings: TrainSettings, vocab_size: int) -> np.ndarray:
    """The token ids the loss's softmax is over (and the drafter then drafts from): the `draft_vocab` most
    frequent of the training responses (the loss ignores drafts of the rarer tokens: never drafted, never
    trained), else every token of the training data (`reduced_vocabulary`), else the whole vocabulary."""
    if settings.draft_vocab:
        return most_frequent(response_counts(samples), settings.draft_vocab, vocab_size)
    return training_vocabulary(samples) if settings.reduced_vocabulary else np.arange(vocab_size)
