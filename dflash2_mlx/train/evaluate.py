"""Held-out evaluation, teacher-forced: with greedy-regenerated data the response IS the target's greedy
continuation, so the leading matches of each block's greedy drafts are exactly what verification would
accept. The blocks of a few sequences are drafted in one drafter pass and walked in one greedy walk."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..drafter import DFlashDraftModel
from ..formats.shards import Sample
from .batches import Batch, make_batch
from .settings import TrainSettings

EVAL_STEP = 2**31 - 1  # the anchors of the held-out evaluation: the same at every evaluation
EVAL_SEQUENCES = 4  # sequences per drafter pass (each with `anchors_per_sequence` blocks)


class Evaluation(NamedTuple):
    tau: float  # mean committed tokens per block, bonus included
    first_draft: float  # fraction of blocks whose first draft is right
    by_position: tuple[float, ...] = ()  # P(draft i accepted | the drafts before it accepted), i = 1..B-1


def accepted_drafts(drafts: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per block, how many leading drafts [N, B-1] match their labels (-1: past the sequence's end, never
    a match): what a T = 0 verification accepts."""
    match = (drafts == labels) & (labels >= 0)
    return np.cumprod(match, axis=1).sum(axis=1)


def acceptance_by_position(accepted: Sequence[int], block_size: int) -> tuple[float, ...]:
    """P(draft i accepted | drafts 1..i-1 accepted) for i = 1..B-1, from each block's count of accepted drafts
    (0.0 where no block got that far): what adaptive mode starts from (the card's `ACCEPTANCE_FIELD`)."""
    accepted = np.asarray(accepted)
    reached = [int(np.sum(accepted >= i)) for i in range(block_size)]
    return tuple(round(reached[i + 1] / reached[i], 4) if reached[i] else 0.0 for i in range(block_size - 1))


def evaluate(
    drafter: DFlashDraftModel,
    samples: list[Sample],
    indices: Sequence[int],
    settings: TrainSettings,
    context: Callable[[Batch], mx.array],
    peers=None,
) -> Evaluation:
    """tau = mean(accepted + 1), first_draft = how often draft 1 is right and the acceptance by position,
    over `settings`'s anchors (the same at every evaluation) in `samples[i]` for i in `indices`;
    `context(batch)` gives the drafter's context rows of a batch (whose `picked` are indices into `samples`).
    With `peers` (the ranks of a data-parallel run, each holding the same drafter) each rank drafts one in N of
    the chunks and the ranks sum their counts: every rank gets the numbers of the whole evaluation."""
    if not indices:
        return Evaluation(float("nan"), float("nan"), ())
    B = settings.block_size
    same_anchors = replace(settings, distinct_anchors=False)  # every run is evaluated on the same blocks
    counts = np.zeros(B + 1, np.int64)  # blocks with 0..B-1 accepted drafts, then blocks with draft 1 right
    starts = range(0, len(indices), EVAL_SEQUENCES)
    for start in starts[peers.rank :: peers.size] if peers else starts:
        chunk = [samples[i] for i in indices[start : start + EVAL_SEQUENCES]]
        batch = make_batch(chunk, EVAL_STEP, same_anchors, drafter.config.mask_token_id, sequences=len(chunk))
        batch.picked = [indices[start + i] for i in batch.picked]  # indices into `samples`
        hidden = drafter.hidden(batch.blocks, context(batch), None, batch.where)[:, 1:]
        drafts = drafter.greedy_drafts(hidden, drafter.draft_logits(hidden), batch.blocks[:, 0])
        drafts, labels = np.array(drafts), np.array(batch.labels)
        counts[:B] += np.bincount(accepted_drafts(drafts, labels), minlength=B)
        counts[B] += int(np.sum((drafts[:, 0] == labels[:, 0]) & (labels[:, 0] >= 0)))
    if peers:
        counts = np.array(peers.sum(mx.array(counts.astype(np.int32)), "the evaluation"), np.int64)
    blocks = int(counts[:B].sum())
    accepted = np.repeat(np.arange(B), counts[:B])
    return Evaluation(float(np.mean(accepted) + 1), float(counts[B] / blocks), acceptance_by_position(accepted, B))
