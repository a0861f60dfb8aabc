"""Logits -> tokens, and the acceptance rules that keep speculative decoding lossless.

Everything here stays on the device: the decode loop reads back one small array per cycle.
Both the drafter and the target go through `probabilities`, so temperature, top-k and top-p shape both
sides the same way and rejection sampling reproduces the target's *filtered* distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Row-wise sampling distribution [..., V] after temperature, top-k and top-p (float32)."""
    scores = logits.astype(mx.float32) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.partition(scores, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        scores = mx.where(scores >= kth, scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1)
    if params.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        desc = -mx.sort(-probs, axis=-1)
        before = mx.cumsum(desc, axis=-1) - desc
        cutoff = mx.min(mx.where(before < params.top_p, desc, mx.inf), axis=-1, keepdims=True)
        probs = mx.where(probs >= cutoff, probs, 0)
        probs = probs / mx.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(logits: mx.array, params: SamplingParams) -> mx.array:
    """One token per row of `logits` [..., V]."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(mx.log(probabilities(logits, params)))


def accept_greedy(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """T = 0: accept the longest prefix of `drafts` [B-1] equal to the target's argmax; the bonus
    token is the target's argmax right after it. Returns (accepted count, bonus), both scalars.
    With kernels on: one Metal dispatch that reads the rows only up to the first rejection."""
    if kernels.metal_enabled():
        return kernels.accept_greedy(drafts, target_logits)
    choice = mx.argmax(target_logits, axis=-1)
    accepted = mx.sum(mx.cumprod((drafts == choice[:-1]).astype(mx.int32)))
    return accepted, choice[accepted]


def accept_sampled(
    drafts: mx.array, draft_probs: mx.array, target_logits: mx.array, params: SamplingParams
) -> tuple[mx.array, mx.array]:
    """T > 0: speculative rejection sampling (Leviathan et al. / Chen et al.).

    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); the first rejected row is resampled
    from normalize(max(p - q, 0)), and if every draft is kept the bonus comes from the last target row.
    The committed tokens then follow the target's distribution p exactly.
    """
    p = probabilities(target_logits, params)  # [B, V]
    rows = mx.arange(drafts.shape[0])
    p_d, q_d = p[rows, drafts], draft_probs[rows, drafts]
    keep = mx.random.uniform(shape=q_d.shape) * q_d < p_d
    accepted = mx.sum(mx.cumprod(keep.astype(mx.int32)))
    residual = mx.maximum(p[:-1] - draft_probs, 0)
    mass = mx.sum(residual, axis=-1, keepdims=True)
    # A zero residual (p == q on the support) can only be reached by rounding; p itself is then exact.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:-1])
    candidates = mx.random.categorical(mx.log(mx.concatenate([residual, p[-1:]])))
    return accepted, candidates[accepted]
