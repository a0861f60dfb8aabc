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


def accepted_blocks(
    drafter: DFlashDraftModel,
    samples: list[Sample],
    indices: Sequence[int],
    settings: TrainSettings,
    context: Callable[[Batch], mx.array],
    peers=None,
) -> np.ndarray:
    """The accepted drafts [len(indices), anchors] of each block drafted from `settings`'s anchors (the same at
    every evaluation) in `samples[i]`, row by row of `indices`; `context(batch)` gives the drafter's context rows of
    a batch (whose `picked` are indices into `samples`). With `peers` (the ranks of a data-parallel run, each
    holding the same drafter) each rank drafts one in N of the chunks and the ranks sum their rows: every rank gets
    the whole evaluation's."""
    A = settings.anchors_per_sequence
    if not len(indices):  # every rank alike: no collective sum to wait on
        return np.zeros((0, A), np.int32)
    same_anchors = replace(settings, distinct_anchors=False)  # every run is evaluated on the same blocks
    accepted = np.zeros((len(indices), A), np.int32)
    starts = range(0, len(indices), EVAL_SEQUENCES)
    for start in starts[peers.rank :: peers.size] if peers else starts:
        chunk = [samples[i] for i in indices[start : start + EVAL_SEQUENCES]]
        batch = make_batch(chunk, EVAL_STEP, same_anchors, drafter.config.mask_token_id, sequences=len(chunk))
        rows = [start + i for i in batch.picked]  # rows of `indices`
        batch.picked = [indices[row] for row in rows]  # indices into `samples`
        hidden = drafter.hidden(batch.blocks, context(batch), None, batch.where)[:, 1:]
        drafts = drafter.greedy_drafts(hidden, drafter.draft_logits(hidden), batch.blocks[:, 0])
        accepted[rows] = accepted_drafts(np.array(drafts), np.array(batch.labels)).reshape(len(rows), A)
    if peers:
        accepted = np.array(peers.sum(mx.array(accepted), "the evaluation"), np.int32)
    return accepted


def summary(accepted: np.ndarray, block_size: int) -> Evaluation:
    """The evaluation of blocks with `accepted` drafts each (any shape; `accepted_blocks`, or some of its rows): tau =
    mean(accepted + 1), first_draft = how often draft 1 is right, and the acceptance by position."""
    if not accepted.size:
        return Evaluation(float("nan"), float("nan"), ())
    accepted = accepted.reshape(-1)
    return Evaluation(
        float(np.mean(accepted) + 1), float(np.mean(accepted >= 1)), acceptance_by_position(accepted, block_size)
    )
