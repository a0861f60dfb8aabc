"""Logits -> tokens, and the acceptance rule that keeps speculative decoding lossless.

Everything here stays on the device: the decode loop reads back one small array per cycle.
`sample` is mlx-lm's sampler (`mlx_lm.sample_utils.make_sampler`) and `probabilities` the distribution it
draws from. Both the drafter and the target go through them, so rejection sampling reproduces exactly
the distribution mlx-lm's own sampler draws from the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
from mlx_lm import sample_utils
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
    min_tokens_to_keep: int = 1  # min-p keeps at least this many tokens

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.min_tokens_to_keep, int) or self.min_tokens_to_keep < 1:
            raise ValueError(f"min_tokens_to_keep must be an integer >= 1, got {self.min_tokens_to_keep!r}")

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
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Row-wise distribution [..., V] (float32) that `sample` draws from at T > 0."""
    return mx.softmax(_sampling_logits(logits, params).astype(mx.float32), axis=-1)


def log_softmax(logits: mx.array) -> mx.array:
    """Row-wise log-probabilities in the logits' dtype, as mlx-lm computes its `logprobs` (lazy, like any op)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# mlx-lm's sampler: log-probabilities [..., V] -> tokens [...]
Sampler = Callable[[mx.array], mx.array]


class SamplerWithParams:
    """What `make_sampler` returns: mlx-lm's own sampler for the same arguments (calling it is calling that),
    carrying the distribution it draws from as `params` (`SamplingParams`), which speculative decoding needs
    for its acceptance test. `params` is None where no `SamplingParams` describes it (XTC sampling)."""

    def __init__(self, sampler: Sampler, params: SamplingParams | None, why: str = ""):
        self.sampler, self.params, self.why = sampler, params, why

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.sampler(logprobs)

    def __repr__(self) -> str:
        return f"SamplerWithParams({self.params or self.why})"


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: list[int] | None = None,
) -> SamplerWithParams:
    """`mlx_lm.sample_utils.make_sampler` with the same arguments and meaning (top_p, min_p, top_k: 0 or out of
    range = off), returning its sampler with the parameters attached (`SamplerWithParams`), so that
    `stream_generate(..., sampler=make_sampler(...))` speculates exactly: rejection sampling needs the
    distribution, which a bare callable does not tell. XTC (`xtc_probability` > 0) removes a random set of
    tokens per draw, a law this module does not reproduce: such a sampler (`params` None) runs plain decoding,
    with mlx-lm's XTC sampler itself."""
    sampler = sample_utils.make_sampler(
        temp, top_p, min_p, min_tokens_to_keep, top_k, xtc_probability, xtc_threshold, xtc_special_tokens
    )
    if xtc_probability > 0 and temp != 0:
        return SamplerWithParams(
            sampler,
            None,
            "XTC sampling (xtc_probability > 0) draws from a random subset of "
            "tokens, a distribution speculative decoding cannot test drafts against",
        )
    params = SamplingParams(
        temperature=temp,
        top_p=top_p if 0 < top_p < 1 else 1.0,
        top_k=max(top_k, 0),
        min_p=min_p,
        min_tokens_to_keep=min_tokens_to_keep,
    )
    return SamplerWithParams(sampler, params)


def sampler_params(sampler: Sampler) -> SamplingParams | None:
    """The distribution a sampler draws from, where it is known: `make_sampler`'s, and mlx-lm's greedy sampler
    (which mlx-lm's `make_sampler` returns for temp 0); None for any other callable."""
    if sampler is sample_utils.greedy_sampler:
        return SamplingParams()
    return getattr(sampler, "params", None) if isinstance(sampler, SamplerWithParams) else None


def sample(logits: mx.array, params: SamplingParams) -> mx.array:
    """One token per row of `logits` [..., V]: the argmax at T = 0, else what mlx-lm's sampler draws
    (the same draw for the same random state)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(_sampling_logits(logits, params))


# mlx-lm's logits processor: (the tokens before a position, its logits [1, V]) -> processed logits [1, V]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class Processing:
    """mlx-lm's logits processors (`mlx_lm.sample_utils.make_logits_processors`: logit bias, repetition penalty,
    ...) applied as its `generate_step` applies them: to each next-token row, as [1, V], with `tokens` [n]
    (uint32), the whole prompt and every token generated before that row, in the listed order.

    `tokens` holds the prompt and the committed tokens, the current anchor included (`commit`). In a verify
    pass over [anchor, d_1 .. d_n], row i (the target's logits for the token after d_i) is processed with
    `tokens` + d_1 .. d_i: what plain decoding would have shown the processors had d_1 .. d_i been accepted,
    so acceptance (greedy or sampled) against the processed rows commits exactly the processed target's
    tokens. Everything stays lazy: no host read."""

    def __init__(self, processors: Sequence[LogitsProcessor], prompt: mx.array):
        self.processors = list(processors)
        self.tokens = prompt.astype(mx.uint32).reshape(-1)

    def row(self, logits: mx.array, after: mx.array | None = None) -> mx.array:
        """One processed row [V]: the logits [V] of the position after `tokens`, then `after` (drafts) if given."""
        tokens = self.tokens if after is None or after.size == 0 else mx.concatenate([self.tokens, after])
        out = logits[None]
        for processor in self.processors:
            out = processor(tokens, out)
        return out[0]

    def rows(self, logits: mx.array, drafts: mx.array) -> mx.array:
        """The verify rows [n+1, V] of [anchor, drafts[:n]], row i processed after drafts[:i]."""
        drafts = drafts.astype(mx.uint32)
        return mx.stack([self.row(logits[i], drafts[:i]) for i in range(logits.shape[0])])

    def commit(self, tokens: mx.array | list[int]) -> None:
        """Tokens committed (on the device, or read already): the rows after them see them."""
        new = mx.array(tokens, mx.uint32) if isinstance(tokens, list) else tokens.astype(mx.uint32).reshape(-1)
        self.tokens = mx.concatenate([self.tokens, new])


def processing(processors: Sequence[LogitsProcessor] | None, prompt: mx.array) -> Processing | None:
    """A `Processing` of `prompt`, or None (the loops' unprocessed path, unchanged) for no processors."""
    return Processing(processors, prompt) if processors else None


class Proposal(NamedTuple):
    """A drafter's block: its n draft tokens and, at T > 0, the distribution each was drawn from, given
    sparsely: row i puts probability probs[i, j] on token candidates[i, j] (ids unique within a row) and
    none on any other token. A dense q is candidates = arange(V) on every row."""

    tokens: mx.array  # [n] draft tokens
    candidates: mx.array | None  # [n, k] token ids of each row's draft distribution (T > 0 only)
    probs: mx.array | None  # [n, k] their probabilities (T > 0 only)
    finite: mx.array  # scalar bool: False when the draft logits hold NaN or inf
    # [n] each row's largest probability (the softmax of its draft logits, untempered): how sure the drafter
    # is of that row whatever was drawn from it, so a choice made on it (how many drafts to verify) keeps the
    # acceptance rule exact; set by `propose`, lazy (computed only if read)
    confidence: mx.array | None = None

    def first(self, n: int) -> Proposal:
        """Its first n drafts, a proposal of their own: every row is drawn from its distribution given the
        drafts before it (a DFlash 2 path walked row by row, v1's independent rows), never from later rows, so
        the prefix is what a block of n drafts drawn the same way would be. At T = 0 any prefix is exact."""
        if n >= self.tokens.shape[0]:
            return self

        def cut(a):
            return None if a is None else a[:n]

        return Proposal(self.tokens[:n], cut(self.candidates), cut(self.probs), self.finite, cut(self.confidence))


def accept(
    proposal: Proposal, target_logits: mx.array, params: SamplingParams, metal: bool = False
) -> tuple[mx.array, mx.array]:
    """The acceptance step of one cycle: (accepted count, bonus token), both scalars on the device.

    target_logits [n+1, V] are the verify rows of [anchor, drafts]. The committed tokens are the first
    `accepted` drafts and then the bonus; they follow the target's distribution exactly (its argmax at
    T = 0). A proposal with non-finite draft logits is rejected outright, so the cycle commits the
    target's own token at row 0, which is what the rule draws for row 0 anyway: no extra work.
    `metal`: greedy acceptance as one Metal kernel (the drafter's kernels setting, `drafter.metal_kernels`).
    """
    if params.greedy:
        # No argmax equals V: a non-finite proposal gets accepted = 0 and row 0's argmax.
        drafts = mx.where(proposal.finite, proposal.tokens, target_logits.shape[-1])
        return accept_greedy(drafts, target_logits, metal)
    if proposal.probs is None:
        raise ValueError(
            "sampling (T > 0) needs the proposal's draft distribution (candidates and probs); "
            "propose the drafts with the same SamplingParams"
        )
    return accept_sampled(proposal, target_logits, params)


def accept_greedy(drafts: mx.array, target_logits: mx.array, metal: bool = False) -> tuple[mx.array, mx.array]:
    """T = 0: accept the longest prefix of `drafts` [B-1] equal to the target's argmax; the bonus
    token is the target's argmax right after it. Returns (accepted count, bonus), both scalars.
    With `metal`: one Metal dispatch that reads the rows only up to the first rejection."""
    if metal:
        return kernels.accept_greedy(drafts, target_logits)
    choice = mx.argmax(target_logits, axis=-1)
    accepted = mx.sum(mx.cumprod((drafts == choice[:-1]).astype(mx.int32)))
    return accepted, choice[accepted]


def accept_sampled(proposal: Proposal, target_logits: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array]:
    """T > 0: speculative rejection sampling (Leviathan et al. / Chen et al.) against a sparse q.

    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); the first rejected row is resampled
    from normalize(max(p - q, 0)), where q is non-zero only at the row's candidates, and if every draft
    is kept the bonus comes from the last target row. The committed tokens then follow p exactly.
    A non-finite proposal keeps nothing and counts as q = 0, so row 0's residual is p itself.
    """
    p = probabilities(target_logits, params)  # [n+1, V]
    drafts, ids = proposal.tokens, proposal.candidates
    q = mx.where(proposal.finite, proposal.probs, 0)  # [n, k]
    p_d = mx.take_along_axis(p[:-1], drafts[:, None], axis=-1)[:, 0]
    q_d = mx.sum(mx.where(ids == drafts[:, None], q, 0), axis=-1)
    keep = proposal.finite & (mx.random.uniform(shape=q_d.shape) * q_d < p_d)
    accepted = mx.sum(mx.cumprod(keep.astype(mx.int32)))
    at_ids = mx.maximum(mx.take_along_axis(p[:-1], ids, axis=-1) - q, 0)
    residual = mx.put_along_axis(p[:-1], ids, at_ids, axis=-1)  # p - q, where q is zero off its ids
    mass = mx.sum(residual, axis=-1, keepdims=True)
    # A zero residual (p == q on the support) can only be reached by rounding; p itself is then exact.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:-1])
    candidates = mx.random.categorical(mx.log(mx.concatenate([residual, p[-1:]])))
    return accepted, candidates[accepted]


def draft_acceptance(proposal: Proposal, tokens: mx.array, target_logits: mx.array, params: SamplingParams) -> mx.array:
    """How a block of drafts would have fared, judged by plain decoding instead of a verify pass (adaptive
    mode's shadow probes): [2, m], m = min(drafts, tokens).

    tokens [n]: what plain steps committed after the block's anchor; target_logits [n, V]: the rows they were
    drawn from (row j the target's logits before tokens[j]). Row 0 of the result estimates P(drafts 1..i all
    accepted) for i = 1..m, row 1 the acceptance at each position on its own. At T = 0 both are exact: the
    drafts' leading matches with the tokens, and each position's match. At T > 0 row 1 is sum(min(p_i, q_i)),
    what a draft drawn from q_i keeps against p_i, and row 0 weights it by prod_{j<i} min(1, q_j(t_j) /
    p_j(t_j)): over the tokens' own law t ~ p that is exactly P(drafts 1..i accepted) when each q_j does not
    depend on the drafts before it (v1 drafters); for a DFlash 2 path its rows are those of the drawn path.
    Non-finite draft logits accept nothing. Only committed tokens and the drafter's outputs are read."""
    m = min(proposal.tokens.shape[0], tokens.shape[0])
    drafts, tokens = proposal.tokens[:m], tokens[:m].astype(proposal.tokens.dtype)
    if params.greedy:
        match = (drafts == tokens).astype(mx.float32)
        rows = mx.stack([mx.cumprod(match), match])
        return mx.where(proposal.finite, rows, 0.0)
    if proposal.probs is None:
        raise ValueError(
            "scoring sampled drafts (T > 0) needs the proposal's draft distribution; propose the "
            "drafts with the same SamplingParams"
        )
    p = probabilities(target_logits[:m], params)  # [m, V]
    ids, q = proposal.candidates[:m], proposal.probs[:m].astype(mx.float32)
    overlap = mx.sum(mx.minimum(mx.take_along_axis(p, ids, axis=-1), q), axis=-1)
    p_t = mx.take_along_axis(p, tokens[:, None], axis=-1)[:, 0]
    q_t = mx.sum(mx.where(ids == tokens[:, None], q, 0), axis=-1)
    weight = mx.minimum(1.0, q_t / mx.maximum(p_t, 1e-30))
    before = mx.cumprod(mx.concatenate([mx.ones((1,), mx.float32), weight[:-1]]))
    return mx.where(proposal.finite, mx.stack([before * overlap, overlap]), 0.0)
