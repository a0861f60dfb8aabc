"""Training levers: anchors drawn without replacement, and the expected-accepted-length (chain) loss, each
against a count or formula computed here; the held-out evaluation is the same blocks whatever the lever."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_target

import dflash2_mlx.train.evaluate as evaluate_module
from dflash2_mlx.train.batches import anchor_positions, make_batch
from dflash2_mlx.train.data import Sample, write_shard
from dflash2_mlx.train.loss import NO_SOFT, Soft, expected_accepted, gold_predecessors, loss_fn
from dflash2_mlx.train.settings import TrainSettings
from dflash2_mlx.train.trainer import Trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny target and random samples (responses of 6 to 60 tokens; one in five held out)."""
    folder = tmp_path_factory.mktemp("levers")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(20):
        prompt, response = int(rng.integers(4, 10)), int(rng.integers(6, 60))
        tokens = rng.integers(6, 250, size=prompt + response).astype(np.int32)
        samples.append(Sample(str(i), tokens, prompt, i % 5 == 0))
    write_shard(folder / "shard-00000.npz", samples)
    return make_target("qwen3", seed=3), folder


def settings(folder, **kw) -> TrainSettings:
    base = dict(data=str(folder), block_size=4, layers=1, steps=2, sequences_per_step=4, anchors_per_sequence=16)
    return TrainSettings(**{**base, "architecture": "dflash2", "selector_rank": 16, "cache_features": False, **kw})


def test_distinct_anchors_cover_each_position_once_before_any_twice():
    rng = np.random.default_rng(1)
    for first, last, count in [(5, 100, 16), (5, 20, 16), (3, 6, 10), (7, 7, 3)]:
        a = anchor_positions(rng, first, last, count, distinct=True)
        assert len(a) == count and a.min() >= first and a.max() <= last
        positions = last - first + 1
        if positions >= count:
            assert len(set(a.tolist())) == count  # no anchor twice
        else:
            assert set(a.tolist()) == set(range(first, last + 1))  # every position, the rest drawn again
    drawn = anchor_positions(np.random.default_rng(2), 5, 100, 64, distinct=False)
    assert len(set(drawn.tolist())) < 64  # with replacement, 64 of 96 positions repeat some (p > 0.99999)


def test_distinct_anchors_in_batches_and_the_same_evaluation(data, tmp_path, monkeypatch):
    model, folder = data
    plain = Trainer(model, tmp_path / "a", settings(folder))
    spread = Trainer(model, tmp_path / "b", settings(folder, distinct_anchors=True))
    batch = make_batch(spread.train_samples, 0, spread.settings, 0)
    for row, i in enumerate(batch.picked):
        s = spread.train_samples[i]
        anchors = np.array(batch.where.anchors[row]).tolist()
        if len(s.tokens) - 1 - s.prompt_len >= len(anchors):
            assert len(set(anchors)) == len(anchors)
    evaluated, real = [], evaluate_module.make_batch

    def recorded(*args, **kw):
        batch = real(*args, **kw)
        evaluated.append(np.array(batch.where.anchors))
        return batch

    monkeypatch.setattr(evaluate_module, "make_batch", recorded)
    spread.evaluate(), plain.evaluate()  # the held-out blocks: the same whatever the lever
    half = len(evaluated) // 2
    assert half and all(np.array_equal(a, b) for a, b in zip(evaluated[:half], evaluated[half:]))


def test_expected_accepted_is_the_product_of_gold_probabilities():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 3, 7)).astype(np.float32) * 2
    gold = rng.integers(0, 7, size=(5, 3))
    valid = np.ones((5, 3), bool)
    valid[1, 2] = valid[2, 1:] = valid[3, :] = False  # rows past a sequence's end
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    pg = np.take_along_axis(p, gold[..., None], -1)[..., 0]
    want = [sum(np.prod(pg[n, : k + 1]) if valid[n, : k + 1].all() else 0.0 for k in range(3)) for n in range(5)]
    got = expected_accepted(mx.array(logits), mx.array(gold), mx.array(valid))
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-7)


def test_the_chain_loss_subtracts_the_expected_accepted_drafts(data, tmp_path):
    model, folder = data
    trainer = Trainer(model, tmp_path / "t", settings(folder, chain_loss=0.5))
    batch = make_batch(trainer.train_samples, 0, trainer.settings, trainer.drafter.config.mask_token_id)
    context = trainer.context(batch, "train")
    labels = trainer._loss_labels(batch.labels)
    args = (trainer.drafter, batch.blocks, context, batch.where, labels, trainer.weights, gold_predecessors(batch))
    args += (trainer.vocab, trainer.head_rows, Soft(*NO_SOFT, 0.0))
    plain, chained = loss_fn(*args).item(), loss_fn(*args, chain=0.5).item()
    hidden = trainer.drafter.hidden(batch.blocks, context, None, batch.where)[:, 1:]
    logits = np.array(trainer.drafter.logits(hidden, trainer.head_rows)).astype(np.float64)
    lab = np.array(labels)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pg = np.where(lab >= 0, np.take_along_axis(p, np.maximum(lab, 0)[..., None], -1)[..., 0], 0.0)
    expected = np.cumprod(pg, axis=1).sum()
    w = (np.array(trainer.weights)[None, :] * (lab >= 0)).sum()
    np.testing.assert_allclose(chained, plain - 0.5 * expected / w, rtol=1e-4)
    assert expected > 0
    trainer.run(progress=False)  # and a run with it trains
    assert np.isfinite(trainer.log[-1]["loss"])
