"""Teacher-forced acceptance of tree verification (`--verify-mode ddtree`) on held-out data, per tree budget:
the gain of a tree is known before its cost is paid.

With greedy-regenerated data a response IS the target's greedy continuation, so at every anchor of a
response (every position with B-1 response tokens after it) what a T = 0 verification would accept is
known without the target: the linear drafts' leading matches with the next B-1 tokens, and for a tree the
longest root path whose tokens are those tokens (`Tree.walk` with the gold token as every node's choice).
The drafter sees the target's features of everything before the anchor, as in decoding; one target pass
per sample gives them all, and one drafter pass per sample drafts every anchor's block, and one greedy walk
walks them all.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..drafter import DFlashDraftModel, TrainingBlocks
from ..target import Target
from ..tree import V1_TOP_K, build_tree, draft_log_probs
from .data import Sample


def simulate_tree_acceptance(
    target: Target, drafter: DFlashDraftModel, samples: list[Sample], budgets: list[int], block_size: int | None = None
) -> dict:
    """{"blocks": anchors evaluated, "linear": accepted drafts per anchor of the linear greedy path,
    "tree": {budget: accepted per anchor}}; tau = mean(accepted) + 1."""
    B = block_size or drafter.config.block_size
    mask_id = drafter.config.mask_token_id
    linear, tree = [], {b: [] for b in budgets}
    for s in samples:
        tokens = np.asarray(s.tokens, np.int32)
        anchors = np.arange(s.prompt_len, len(tokens) - B + 1)  # a response token with B-1 response tokens after it
        if anchors.size == 0:
            continue
        context = target.sequence_features(mx.array(tokens[None]))
        blocks = np.full((anchors.size, B), mask_id, np.int32)
        blocks[:, 0] = tokens[anchors]
        hidden = drafter.hidden(mx.array(blocks), context, None, TrainingBlocks(mx.array(anchors[None])))[:, 1:]
        logits = drafter.draft_logits(hidden)
        greedy = np.array(drafter.greedy_drafts(hidden, logits, mx.array(blocks[:, 0])))  # every anchor's at once
        for n, p in enumerate(anchors):
            gold = tokens[p + 1 : p + B].tolist()
            drafts = greedy[n].tolist()
            linear.append(next((i for i, (d, g) in enumerate(zip(drafts, gold)) if d != g), B - 1))
            lattice = drafter.tree_lattice(hidden[n], logits[n], mx.array(blocks[n, 0]), V1_TOP_K)
            candidates, logq = np.array(lattice.candidates), np.array(draft_log_probs(lattice))
            for b in budgets:
                t = build_tree(int(blocks[n, 0]), candidates, logq, b)
                choices = [gold[d] if d < len(gold) else -1 for d in t.depths]  # the leaves' choice: no child
                tree[b].append(len(t.walk(choices)[0]) - 1)
    return {"blocks": len(linear), "linear": linear, "tree": tree}
