"""The training loss: cross-entropy of the B-1 drafts weighted by exp(-(k-1)/gamma), optionally mixed with
distillation to the target's top-k next tokens; for DFlash 2 plus the selector's K-way cross-entropy over
the top-K candidates (gold injected when missing, predecessor = the gold previous token)."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..drafter import DFlashDraftModel
from .batches import Batch


class Soft(NamedTuple):
    """Distillation targets: the target's top-k next tokens as indices into the training vocabulary
    [N, B-1, k] (-1: outside it) and their probabilities renormalized over the kept ones; `weight` of
    the soft loss (0: hard labels only, and k = 0)."""

    index: mx.array
    probs: mx.array
    weight: float


NO_SOFT = (mx.zeros((1, 1, 0), mx.int32), mx.zeros((1, 1, 0)))  # (index, probs) of hard labels only


def draft_weights(block_size: int, gamma: float) -> mx.array:
    """The loss weight of draft k = 1..B-1: exp(-(k-1)/gamma) (early drafts matter most: a wrong one ends
    the accepted run)."""
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / gamma)


def gold_predecessors(batch: Batch) -> mx.array:
    """The predecessor of each draft row's gold token: the anchor, then the gold drafts before it."""
    return mx.concatenate([batch.blocks[:, :1], mx.maximum(batch.labels[:, :-1], 0)], axis=1)


def loss_weight(labels: mx.array, weights: mx.array) -> mx.array:
    """The sum of the draft rows' loss weights (rows past a sequence's end weigh 0), at least 1: what the
    weighted loss is divided by."""
    return mx.maximum(mx.sum(weights[None, :] * (labels >= 0)), 1)


def expected_accepted(logits: mx.array, gold: mx.array, valid: mx.array) -> mx.array:
    """Per block, the drafts a verification would accept if each draft were drawn from the drafter's softmax:
    sum_k prod_{j<=k} p_j(gold_j) over the B-1 rows [N, B-1, n] (a row past the sequence's end ends the run).
    Its gradient weighs an early draft by everything after it, as acceptance does."""
    logp = -nn.losses.cross_entropy(logits, gold, reduction="none")
    logp = mx.where(valid, logp, -1e4)
    return mx.sum(mx.exp(mx.cumsum(logp, axis=1)), axis=1)


def loss_fn(
    drafter: DFlashDraftModel,
    blocks,
    context,
    where,
    labels,
    weights,
    prev_gold,
    vocab,
    head_rows,
    soft: Soft,
    denominator: mx.array | None = None,
    chain: float = 0.0,
):
    """Weighted draft cross-entropy (+ the selector's K-way cross-entropy for DFlash 2), over the training
    vocabulary `vocab` (token ids [n] with LM-head rows `head_rows`): the softmax over the 5-10k tokens a
    data set uses costs a fraction of one over the full vocabulary, and a token the data never shows
    gets no positive signal either way. `labels` are indices into `vocab`. With `soft.weight` w > 0 the
    draft loss is (1 - w) * the hard labels' cross-entropy + w * the cross-entropy to the target's own
    top-k distribution (forward KL up to a constant). `denominator`: what the weighted sums are divided by
    (default `loss_weight` of these labels); a data-parallel rank gives the whole batch's over the ranks'
    count, so that the ranks' averaged gradients are those of one process on the whole batch. `chain` > 0
    subtracts that weight times the blocks' `expected_accepted` drafts (over the same denominator)."""
    hidden = drafter.hidden(blocks, context, None, where)[:, 1:]
    logits = drafter.logits(hidden, head_rows).astype(mx.float32)  # [N, B-1, n]
    valid = labels >= 0
    gold = mx.maximum(labels, 0)
    w = weights[None, :] * valid
    ce = nn.losses.cross_entropy(logits, gold, reduction="none")
    if soft.weight:
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        soft_ce = -mx.sum(soft.probs * mx.take_along_axis(logp, mx.maximum(soft.index, 0), axis=-1), axis=-1)
        ce = (1 - soft.weight) * ce + soft.weight * soft_ce
    denominator = mx.maximum(mx.sum(w), 1) if denominator is None else denominator
    loss = mx.sum(ce * w) / denominator
    if chain:
        loss = loss - chain * mx.sum(expected_accepted(logits, gold, valid)) / denominator
    if not drafter.config.is_dflash2:
        return loss
    sel = drafter.candidate_selector
    k = min(sel.top_k, logits.shape[-1])
    cand = mx.stop_gradient(mx.argpartition(-logits, k - 1, axis=-1)[..., :k])
    has_gold = mx.any(cand == gold[..., None], axis=-1, keepdims=True)
    cand = mx.where(has_gold, cand, mx.concatenate([cand[..., :-1], gold[..., None]], axis=-1))  # inject gold
    unary = mx.take_along_axis(logits, cand, axis=-1)
    h = sel.hidden_projection(hidden).astype(mx.float32)
    pred = sel.predecessor_codes(prev_gold, drafter._target.embed)
    succ = sel.successor_codes(vocab[cand], drafter._target.embed)
    scores = unary + mx.sum((pred.astype(mx.float32) * h)[..., None, :] * succ.astype(mx.float32), axis=-1)
    target_index = mx.argmax(cand == gold[..., None], axis=-1)
    sel_ce = nn.losses.cross_entropy(scores, target_index, reduction="none")
    return loss + mx.sum(sel_ce * w) / denominator
