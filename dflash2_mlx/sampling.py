"""Logits -> tokens, and the acceptance rules that keep speculative decoding lossless.

Everything here stays on the device: the decode loop reads back one small array per cycle.
`sample` is mlx-lm's sampler (`mlx_lm.sample_utils.make_sampler`) and `probabilities` the distribution it
draws from. Both the drafter and the target go through them, so rejection sampling reproduces exactly
the distribution mlx-lm's own sampler draws from the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from . import kernels


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler settings. As in `make_sampler`, top-p, then min-p, then top-k filter the
    untempered log-probabilities, and temperature scales what they leave."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off; a top_k of at least the vocabulary keeps every token
    min_p: float = 0.0  # 0 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _sampling_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """What mlx-lm's sampler feeds `mx.random.categorical` (T > 0): the log-probabilities, in the logits'
    dtype, with what top-p, then min-p (keeping at least one token), then top-k remove set to -inf,
    times 1 / temperature. The filters are mlx-lm's own functions, so ties and thresholds match."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Row-wise distribution [..., V] (float32) that `sample` draws from at T > 0."""
    return mx.softmax(_sampling_logits(logits, params).astype(mx.float32), axis=-1)


def sample(logits: mx.array, params: SamplingParams) -> mx.array:
    """One token per row of `logits` [..., V]: the argmax at T = 0, else what mlx-lm's sampler draws
    (the same draw for the same random state)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(_sampling_logits(logits, params))


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
