"""Tree verification (`--verify-mode ddtree`): the drafter's proposal as a token tree, verified in one target pass.

Building: the lattice (`selector.Lattice`: candidates [T, k] and pair scores [T, k, k]; for v1 drafters each
row's top-k, whatever the predecessor) is read as a draft distribution, q_t(b | a) = softmax_b S_t(a, .), and
expanded best-first: the node with the highest path probability prod q joins the tree next, until the
budget (draft nodes, the anchor not counted) is spent. Siblings are distinct candidates of one row, so the
tree needs no deduplication; parents always come before their children.

Verifying: the anchor and the nodes in that order are fed to the target in one pass; each node sees the
context and its ancestors only (a boolean mask handed to the model through its caches' `make_mask`), at
position offset + depth (its attention layers' RoPE reads per-node positions), so each node's logits and
features are those of its path fed linearly. The target's KV caches then keep the accepted path's rows
(moved to the front of the pass, the rest rolled back as after a linear verify).

Accepting: one target choice per node (`sampling.sample`: the argmax at T = 0, an independent draw from
the target's sampling distribution at T > 0); from the anchor, descend into the child whose token is the
node's choice; the first choice no child holds is the bonus. At T > 0 this is SpecInfer's recursive
rejection over siblings for a deterministic tree: each sibling's draft distribution is a point mass, so
sibling i is kept with probability r_i(x_i) and r_{i+1} is r_i without x_i, renormalised; the bonus comes
from the last residual. One draw y ~ p, kept iff y is a child, has exactly that law, and the committed
tokens follow the target's distribution.
"""

from __future__ import annotations

import contextlib
import heapq
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from . import patches
from .sampling import Processing, SamplingParams, sample
from .selector import Lattice

V1_TOP_K = 8  # candidates per row for v1 drafters (DFlash 2 drafters use their selector's top-k)
# The default budget: the most draft nodes (at most TREE_BUDGET_MAX) whose cycle costs at most TREE_COST_SLACK
# more than the linear cycle at the same block size. Trees of 16 nodes raised teacher-forced tau 18-22% over
# the linear path even for weak drafters (runs/smollm2/tree-sim.md), so a 10% dearer cycle is
# repaid; where the verify curve is flat the whole 32 nodes are (expected on Apple silicon; not measured).
TREE_BUDGET_MAX = 32
TREE_COST_SLACK = 0.10


class Tree(NamedTuple):
    """Node 0 is the anchor; nodes 1..N the drafts, every parent before its children."""

    tokens: list[int]
    parents: list[int]  # -1 for the anchor
    depths: list[int]  # 0 for the anchor

    @property
    def size(self) -> int:
        return len(self.tokens)

    def ancestors(self) -> np.ndarray:
        """[N+1, N+1] bool: row i marks node i and its ancestors (what node i attends to inside the tree)."""
        n = self.size
        seen = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i] = seen[p]
            seen[i, i] = True
        return seen

    def walk(self, choices: list[int]) -> tuple[list[int], int]:
        """(the accepted path as node indices, anchor first; the bonus token) for the target's choice at each
        node: descend while a child holds the node's choice."""
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}
        path = [0]
        while (child := children.get((path[-1], choices[path[-1]]))) is not None:
            path.append(child)
        return path, choices[path[-1]]


def accept_tree(tree: Tree, target_logits: mx.array, params: SamplingParams) -> tuple[list[int], int]:
    """(accepted path as node indices, anchor first; bonus token) from the verify rows [N+1, V] of `tree`:
    the target's choice at every node (one read), then `Tree.walk`. Exact at T > 0 (see the module note)."""
    return tree.walk(sample(target_logits, params).tolist())


def process_tree_rows(tree: Tree, target_logits: mx.array, procs: Processing) -> mx.array:
    """The verify rows [N+1, V] of `tree` through mlx-lm's logits processors: node i's row after the drafts on
    its path (its ancestors below the anchor, and itself), what plain decoding shows them had that path been
    accepted (`sampling.Processing`)."""
    seen = tree.ancestors()
    return mx.stack(
        [
            procs.row(
                target_logits[i], mx.array([tree.tokens[j] for j in range(1, tree.size) if seen[i, j]], mx.uint32)
            )
            for i in range(tree.size)
        ]
    )


def default_budget(costs, block_size: int) -> int:
    """The default `--tree-budget` from this machine's measured costs (`costs.CostModel`, its verify curve
    reaching TREE_BUDGET_MAX + 1 tokens): the most draft nodes n whose cycle, drafter pass + target pass over
    the anchor and n nodes, costs at most (1 + TREE_COST_SLACK) x the linear cycle at block_size, and never
    fewer than the linear cycle's block_size - 1 drafts."""
    limit = (1 + TREE_COST_SLACK) * costs.passes_s(block_size)
    draft = costs.draft_s[block_size - 2]
    top = min(TREE_BUDGET_MAX, len(costs.verify_s) - 1)
    return max(
        (n for n in range(block_size - 1, top + 1) if draft + costs.verify_s[n] <= limit), default=block_size - 1
    )


def build_tree(anchor: int, candidates: np.ndarray, logq: np.ndarray, budget: int) -> Tree:
    """Best-first expansion of the lattice: candidates [T, k] token ids, logq [T, k, k] the draft
    log-probabilities log q_t(b | a) (row 0: whatever a); at most `budget` draft nodes."""
    T, k = candidates.shape
    tokens, parents, depths = [anchor], [-1], [0]
    frontier = [(-float(logq[0, 0, b]), 0, b, 0) for b in range(k)]  # (-log prob of the path, row, candidate, parent)
    heapq.heapify(frontier)
    while frontier and len(tokens) <= budget:
        neg, t, b, parent = heapq.heappop(frontier)
        node = len(tokens)
        tokens.append(int(candidates[t, b]))
        parents.append(parent)
        depths.append(t + 1)
        if t + 1 < T:
            for c in range(k):
                heapq.heappush(frontier, (neg - float(logq[t + 1, b, c]), t + 1, c, node))
    return Tree(tokens, parents, depths)


def draft_log_probs(lattice: Lattice) -> mx.array:
    """log q_t(b | a) [T, k, k] of a lattice's pair scores (float32)."""
    scores = lattice.scores.astype(mx.float32)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def check_target(target) -> None:
    """Tree mode needs attention layers whose RoPE can be given per-node positions, KV caches whose rows can
    be reordered, and no recurrent layers, in one process."""
    if getattr(target, "group", None) is not None:
        raise ValueError(
            "tree verification (--verify-mode ddtree) runs in one process; a target sharded over "
            "several verifies linear blocks: use --verify-mode dflash or adaptive"
        )
    if target.recurrent:
        raise ValueError(
            f"tree verification (--verify-mode ddtree) does not support hybrid targets ({target.model_type}: "
            f"GatedDeltaNet layers {sorted(target.recurrent)}): a recurrence cannot attend to a tree; "
            "use linear verification, --verify-mode dflash or adaptive"
        )
    missing = [i for i, layer in enumerate(target.layers) if _rope(layer) is None]
    if missing:
        raise ValueError(
            f"tree verification (--verify-mode ddtree) needs attention layers with a `self_attn.rope` "
            f"(mlx-lm's llama/qwen layout); {target.model_type} layers {missing} have none: "
            "use --verify-mode dflash or adaptive"
        )


def check_cache(cache: list) -> None:
    bad = {
        type(c).__name__
        for c in cache
        if type(c) not in (KVCache, RotatingKVCache) or (isinstance(c, RotatingKVCache) and c.keep)
    }
    if bad:
        raise ValueError(
            f"tree verification (--verify-mode ddtree) keeps the accepted path by reordering KV rows, which "
            f"{', '.join(sorted(bad))} caches do not allow (only KVCache and RotatingKVCache without kept "
            "tokens): use --verify-mode dflash or adaptive"
        )


def _rope(layer):
    attn = getattr(layer, "self_attn", None)
    return getattr(attn, "rope", None) if attn is not None else None


class _DepthRoPE:
    """A layer's RoPE at positions offset + depth of each node (node i of a [1, H, N+1, D] tensor)."""

    def __init__(self, rope, depths: mx.array):
        self.rope, self.depths, self.calls = rope, depths, 0

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        self.calls += 1
        # the nodes as a batch of one-row sequences, each with its own offset
        return self.rope(x.swapaxes(0, 2), offset=offset + self.depths).swapaxes(0, 2)


def _tree_mask(ancestors: mx.array, depths: mx.array, context: int, offset: int, window: int | None) -> mx.array:
    """[N+1, context + N+1] bool: each node sees the `context` cached rows before it (positions offset -
    context .. offset - 1) and its ancestors; with a sliding window, only keys fewer than `window` positions
    back."""
    n = depths.size
    pos = offset + depths[:, None]
    ctx = mx.broadcast_to(mx.array(True), (n, context))
    if window is not None:
        ctx = pos - (offset - context + mx.arange(context)[None]) < window
        ancestors = ancestors & (depths[:, None] - depths[None, :] < window)
    return mx.concatenate([ctx, ancestors], axis=1)


@contextlib.contextmanager
def tree_attention(target, cache: list, tree: Tree):
    """While open, one forward of the tree's N+1 tokens through `target.model` with `cache` attends as a tree:
    the caches hand the model the tree mask, the layers' RoPE the per-node positions."""
    depths = mx.array(tree.depths)
    ancestors = mx.array(tree.ancestors())

    masks = []

    def make_mask(c):
        def mask(N, return_array=False, window_size=None):
            masks.append(N)
            if N != tree.size:
                raise RuntimeError(f"a tree pass feeds {tree.size} tokens, the model fed {N}")
            context = min(c.offset, c.max_size - 1) if isinstance(c, RotatingKVCache) else c.offset
            return _tree_mask(ancestors, depths, context, c.offset, window_size)

        return mask

    layers = [layer.self_attn for layer in target.layers]
    restore = []
    try:
        restore += patches.set_attributes([(c, "make_mask", make_mask(c)) for c in cache])
        restore += patches.set_attributes([(attn, "rope", _DepthRoPE(attn.rope, depths)) for attn in layers])
        yield
        # A model that builds its mask or positions some other way would have verified a causal chain, not the
        # tree: refuse rather than commit tokens the target never chose.
        if not masks or any(attn.__dict__["rope"].calls == 0 for attn in layers):
            raise RuntimeError(
                f"the {target.model_type} model did not take the tree mask from its caches' make_mask or the "
                "node positions from its attention layers' rope: tree verification (--verify-mode ddtree) does "
                "not support it; use --verify-mode dflash or adaptive"
            )
    finally:
        patches.restore(restore)


def keep_path_first(cache: list, rows: int, path: list[int]) -> None:
    """Reorder the last `rows` KV rows of every cache (a tree pass) so the accepted path's rows come first, in
    path order: rolling back the rest (`Capture.rollback`, keep = len(path)) then leaves exactly the path."""
    if path == list(range(len(path))):
        return
    kept = set(path)
    order = mx.array(path + [i for i in range(rows) if i not in kept])
    for c in cache:
        # a multi-token update leaves a rotating cache in temporal order, its end at _idx
        end = c._idx if isinstance(c, RotatingKVCache) else c.offset
        start = end - rows
        c.keys[..., start:end, :] = c.keys[..., start:end, :][..., order, :]
        c.values[..., start:end, :] = c.values[..., start:end, :][..., order, :]
