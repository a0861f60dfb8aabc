"""The held-out evaluation's batched greedy walk: N blocks walked at once draft what the block-by-block walk
drafts (checked against a NumPy walk written from the definition, and against `choose` block by block)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_dflash2_drafter, make_drafter, make_target

from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.selector import walk_greedy_blocks


def numpy_greedy(scores: np.ndarray) -> list[int]:
    """The greedy walk of one lattice [T, k, k] from its definition: prev = the anchor (row 0's scores are
    the same for every predecessor), then the argmax of S_t(prev, .), row by row."""
    path, prev = [], 0
    for row in scores:
        prev = int(np.argmax(row[prev]))
        path.append(prev)
    return path


@pytest.mark.parametrize("shape", [(1, 1, 4), (7, 5, 3), (33, 15, 16)])
def test_the_batched_greedy_walk_is_the_greedy_walk_of_each_block(shape):
    N, T, k = shape
    rng = np.random.default_rng(N * 100 + T)
    scores = rng.normal(size=(N, T, k, k)).astype(np.float32)
    # rows whose best successor depends on the predecessor: a walk that ignores its previous pick goes wrong
    scores[:, 1:] += 3 * rng.normal(size=(N, T - 1, k, 1)).astype(np.float32) * (T > 1)
    got = walk_greedy_blocks(mx.array(scores)).tolist()
    assert got == [numpy_greedy(s) for s in scores]


def test_the_batched_walk_follows_the_predecessor():
    """A lattice where following the pick of row t-1 and following candidate 0 part ways: the batched walk
    must take the row of its own previous pick."""
    scores = np.zeros((2, 3, 2, 2), np.float32)
    scores[:, 0, :, 1] = 1  # row 0: candidate 1
    scores[:, 1, 1, 0] = 1  # from 1: candidate 0
    scores[:, 1, 0, 1] = 1  # (from 0 it would be 1)
    scores[:, 2, 0, 1] = 1  # from 0: candidate 1
    scores[:, 2, 1, 0] = 1
    assert walk_greedy_blocks(mx.array(scores)).tolist() == [[1, 0, 1]] * 2 == [numpy_greedy(scores[0])] * 2


@pytest.mark.parametrize("dflash2", [False, True])
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_greedy_drafts_of_many_blocks_are_choose_block_by_block(dflash2, draft_vocab):
    target = make_target()
    drafter = (make_dflash2_drafter if dflash2 else make_drafter)(target, block_size=8)
    if draft_vocab:
        drafter.draft_vocab = np.sort(np.random.default_rng(1).choice(256, 40, replace=False)).astype(np.int32)
        bind_drafter(drafter, target)
    N, D = 24, drafter.config.hidden_size
    mx.random.seed(3)
    hidden = 3 * mx.random.normal((N, 7, D))
    logits = drafter.draft_logits(hidden)
    anchors = mx.array(np.random.default_rng(2).integers(0, 256, N).astype(np.int32))
    got = drafter.greedy_drafts(hidden, logits, anchors).tolist()
    want = [drafter.choose(hidden[n], logits[n], anchors[n], SamplingParams()).tokens.tolist() for n in range(N)]
    assert got == want
    assert len({tuple(w) for w in want}) > N // 2  # blocks that differ: a mix-up of blocks would show
