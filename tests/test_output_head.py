"""The drafter borrows the target's output projection: its logits of a hidden state must be what the
target's own forward makes of it, for every kind of target (tied, untied, under `language_model`,
quantized)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import HIDDEN, make_drafter, make_hybrid, make_model, make_target

from dflash2_mlx.target import Target
from dflash2_mlx.train.trainer import lm_head_rows

TOKENS = mx.array([[5, 9, 33, 2, 200, 17, 250, 64]])
_COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256)
# llama4_text calls its untied head `output`
_LLAMA4 = dict(model_type="llama4_text", head_dim=16, intermediate_size_mlp=128, rope_theta=10000.0,
               no_rope_layers=[1, 1, 1, 0], use_qk_norm=False)


def quantized(model):
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


TARGETS = {
    **{f"{arch}-{'tied' if tied else 'untied'}": (lambda arch=arch, tied=tied: make_target(arch, tied=tied))
       for arch in ("qwen3", "qwen2", "llama", "llama_swa") for tied in (True, False)},
    **{f"{arch}-{'tied' if tied else 'untied'}": (lambda arch=arch, tied=tied: make_hybrid(arch, tied=tied))
       for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next") for tied in (True, False)},
    **{f"llama4_text-{'tied' if tied else 'untied'}":
       (lambda tied=tied: make_model({**_COMMON, **_LLAMA4, "tie_word_embeddings": tied}, seed=3))
       for tied in (True, False)},
    "qwen3-quantized-tied": lambda: quantized(make_target("qwen3", tied=True)),
    "qwen3-quantized-untied": lambda: quantized(make_target("qwen3", tied=False)),
    "qwen3_5-quantized-untied": lambda: quantized(make_hybrid("qwen3_5", tied=False)),
}


def decoder(model):
    """The decoder that ends in the final norm: model.model, or model.language_model.model."""
    return getattr(model, "language_model", model).model


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_drafter_logits_are_the_targets_own(kind):
    """The target's forward is the expected value: its logits of TOKENS against the drafter's projection
    of the normed hidden state its decoder computes on the way (float32, within 1e-4); training's
    reduced-vocabulary logits too."""
    model = TARGETS[kind]()
    hidden = decoder(model)(TOKENS)
    expected = np.array(model(TOKENS).astype(mx.float32))
    drafter = make_drafter(model)
    got = np.array(drafter.logits(hidden).astype(mx.float32))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5)
    ids = mx.array([3, 17, 64, 200, 255])
    reduced = drafter.logits(hidden, lm_head_rows(Target(model), ids)).astype(mx.float32)
    np.testing.assert_allclose(np.array(reduced), expected[..., np.array(ids)], atol=1e-4, rtol=1e-5)
