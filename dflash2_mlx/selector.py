"""DFlash 2's path selector: pick one token per draft row from the top-k candidates, so that adjacent
picks are compatible.

For draft row t with normed hidden h_t and candidates b (top-k of the draft logits):
    S_t(a, b) = U_t(b) + <A[a] * H_t, B[b]>,   U_t = draft logits,  H_t = hidden_projection(h_t)
where A / B are the predecessor / successor codes of tokens (V x R tables, or, factorised, rank-R maps of
the target's embeddings). All adjacent pair scores form one lattice tensor [T, k, k]: row 0 holds the
anchor -> row 1 scores (the same for every `a`), row t the k x k scores between rows t-1 and t. Walks:
  - greedy: prev = anchor, take the argmax of S_t(prev, .), repeat (the reference walk);
  - viterbi: the path with the maximum total score (exact max-sum dynamic programming);
  - sampling (T > 0): draw from q_t = `sampling.probabilities(S_t(prev, .))` over the candidates (the
    sampler's filters, then temperature); q_t is the draft distribution the rejection step uses, so
    sampling stays lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import kernels
from .sampling import SamplingParams, probabilities

WALKS = ("greedy", "viterbi")


class Lattice(NamedTuple):
    candidates: mx.array  # [T, k] token ids, best draft logit first
    scores: mx.array  # [T, k, k]: scores[t, a, b] = S_t(candidate a of row t-1, candidate b of row t);
    # for t = 0 the predecessor is the anchor, whatever a


class LatticeInputs(NamedTuple):
    """What the pair scores are made of (all float32 but the candidates)."""

    candidates: mx.array  # [T, k]
    unary: mx.array  # [T, k]: the candidates' draft logits
    pred_rows: mx.array  # [T, k, R]: predecessor codes of row t-1's candidates (row 0: the anchor's)
    h: mx.array  # [T, R]: hidden_projection of the draft rows
    succ: mx.array  # [T, k, R]: successor codes of row t's candidates


class CandidateSelector(nn.Module):
    """Hugging Face names: `candidate_selector.{hidden_projection, predecessor_codebook, successor_codebook}`
    (the codebooks are stored without `.weight`; factorised selectors have `*_projection` maps instead)."""

    def __init__(self, dim: int, rank: int, top_k: int, vocab_size: int | None, factorized: bool = False):
        super().__init__()
        self.top_k = top_k
        self.factorized = factorized
        self.hidden_projection = nn.Linear(dim, rank, bias=False)
        if factorized:
            self.predecessor_projection = nn.Linear(dim, rank, bias=False)
            self.successor_projection = nn.Linear(dim, rank, bias=False)
        else:
            self.predecessor_codebook = nn.Embedding(vocab_size, rank)
            self.successor_codebook = nn.Embedding(vocab_size, rank)

    def predecessor_codes(self, ids: mx.array, embed=None) -> mx.array:
        """A[ids]; `embed` is the target's embedding (factorised selectors only)."""
        if self.factorized:
            return self.predecessor_projection(embed(ids))
        return self.predecessor_codebook(ids)

    def successor_codes(self, ids: mx.array, embed=None) -> mx.array:
        """B[ids]; `embed` as for `predecessor_codes`."""
        if self.factorized:
            return self.successor_projection(embed(ids))
        return self.successor_codebook(ids)

    def lattice_inputs(
        self, hidden: mx.array, logits: mx.array, anchor: mx.array, embed=None, ids: mx.array | None = None
    ) -> LatticeInputs:
        """hidden [T, D] normed draft rows; logits [T, V] their draft logits; anchor: scalar token id. With a
        draft vocabulary, logits [T, n] are over its token ids `ids` [n]. Blocks side by side: hidden
        [N, T, D], logits [N, T, V], anchors [N] give inputs with a leading N."""
        k = min(self.top_k, logits.shape[-1])
        top = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
        unary = mx.take_along_axis(logits, top, axis=-1)
        order = mx.argsort(-unary, axis=-1)  # best first: ties then break the same way on every backend
        candidates = mx.take_along_axis(top, order, axis=-1)
        if ids is not None:
            candidates = ids[candidates]
        unary = mx.take_along_axis(unary, order, axis=-1).astype(mx.float32)
        h = self.hidden_projection(hidden).astype(mx.float32)  # [T, R]
        # predecessors of row t: the anchor for t = 0 (whatever a), else the candidates of row t-1
        first = mx.broadcast_to(anchor[..., None, None], (*anchor.shape, 1, k))
        pred_ids = mx.concatenate([first, candidates[..., :-1, :]], axis=-2)
        pred_rows = self.predecessor_codes(pred_ids, embed).astype(mx.float32)  # [T, k, R]
        succ = self.successor_codes(candidates, embed).astype(mx.float32)  # [T, k, R]
        return LatticeInputs(candidates, unary, pred_rows, h, succ)

    def lattice(self, hidden: mx.array, logits: mx.array, anchor: mx.array, embed=None) -> Lattice:
        """The whole lattice (arguments as for `lattice_inputs`)."""
        return lattice_of(self.lattice_inputs(hidden, logits, anchor, embed))


def lattice_of(inputs: LatticeInputs) -> Lattice:
    """All pair scores S_t(a, b) = U_t(b) + <A[a] * H_t, B[b]> (pure MLX)."""
    scores = inputs.unary[..., None, :] + (inputs.pred_rows * inputs.h[..., None, :]) @ inputs.succ.swapaxes(-1, -2)
    return Lattice(inputs.candidates, scores)


def scored_path(inputs: LatticeInputs, walk: str, metal: bool = False) -> tuple[mx.array, mx.array]:
    """(scores [T, k, k], path [T]): the lattice and a T = 0 walk over it. With `metal` this is one
    Metal dispatch instead of an MLX op or two per draft row."""
    if metal:
        return kernels.scored_path(inputs.unary, inputs.pred_rows, inputs.h, inputs.succ, walk)
    lattice = lattice_of(inputs)
    return lattice.scores, (walk_viterbi if walk == "viterbi" else walk_greedy)(lattice)


def walk_greedy(lat: Lattice) -> mx.array:
    """Indices into each row's candidates [T] by the sequential argmax walk."""
    idx = [mx.argmax(lat.scores[0, 0])]
    for row in lat.scores[1:]:
        idx.append(mx.argmax(row[idx[-1]]))
    return mx.stack(idx)


def walk_greedy_blocks(scores: mx.array) -> mx.array:
    """`walk_greedy` of N blocks at once: scores [N, T, k, k] (lattices side by side), indices [N, T]; one
    MLX op or two per draft row for all the blocks."""
    idx = [mx.argmax(scores[:, 0, 0], axis=-1)]
    for t in range(1, scores.shape[1]):
        row = mx.take_along_axis(scores[:, t], idx[-1][:, None, None], axis=1)[:, 0]  # [N, k]: from the pick
        idx.append(mx.argmax(row, axis=-1))
    return mx.stack(idx, axis=1)


def walk_viterbi(lat: Lattice) -> mx.array:
    """Indices [T] of the path with the maximum total score sum_t S_t(path[t-1], path[t])."""
    best, back = lat.scores[0, 0], []
    for row in lat.scores[1:]:
        total = best[:, None] + row  # [from, to]
        back.append(mx.argmax(total, axis=0))
        best = mx.max(total, axis=0)
    idx = [mx.argmax(best)]
    for b in reversed(back):
        idx.append(b[idx[-1]])
    return mx.stack(idx[::-1])


def walk_sampled(lat: Lattice, params: SamplingParams) -> tuple[mx.array, mx.array]:
    """Sample the path row by row; returns (indices [T], draft probabilities q [T, k] of each row's
    candidates: the sparse q that acceptance takes with `lat.candidates`)."""
    idx, q_rows, prev = [], [], 0
    for t in range(lat.candidates.shape[0]):
        q = probabilities(lat.scores[t, prev], params)
        prev = mx.random.categorical(mx.log(q))
        idx.append(prev)
        q_rows.append(q)
    return mx.stack(idx), mx.stack(q_rows)


def path_score(lat: Lattice, idx: mx.array) -> mx.array:
    """Total score of a path given as candidate indices."""
    prev = mx.concatenate([mx.zeros((1,), idx.dtype), idx[:-1]])
    return mx.sum(lat.scores[mx.arange(idx.size), prev, idx])
