"""The drafter borrows the target's output projection and input embedding: its logits of a hidden state must
be what the target's own forward makes of it, for every kind of target (tied, untied, under
`language_model`, quantized, and targets that scale or softcap their logits or scale their embeddings),
and its block embeddings what the target's decoder feeds its first layer."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import HIDDEN, make_drafter, make_hybrid, make_model, make_target, save_drafter

from dflash2_mlx.loading import bind_drafter, load_drafter
from dflash2_mlx.target import Target

TOKENS = mx.array([[5, 9, 33, 2, 200, 17, 250, 64]])
_COMMON = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=256,
)
# llama4_text calls its untied head `output`
_LLAMA4 = dict(
    model_type="llama4_text",
    head_dim=16,
    intermediate_size_mlp=128,
    rope_theta=10000.0,
    no_rope_layers=[1, 1, 1, 0],
    use_qk_norm=False,
)
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, rope_theta=10000.0)
# Targets whose own __call__ transforms the logits or the embeddings (mlx-lm computes these inside __call__).
SCALED = {
    # embeddings * sqrt(64)
    "gemma": dict(model_type="gemma", head_dim=16, rope_theta=10000.0),
    # logits: tanh(x / 5) * 5; embeddings * sqrt(64)
    "gemma2": dict(model_type="gemma2", final_logit_softcapping=5.0, attn_logit_softcapping=50.0, **_GEMMA),
    # embeddings * bfloat16(sqrt(64)); its own head, untied
    "gemma3_text": dict(model_type="gemma3_text", sliding_window_pattern=2, **_GEMMA),
    # logits / 4, embeddings * 3
    "granite": dict(
        model_type="granite",
        logits_scaling=4.0,
        embedding_multiplier=3.0,
        attention_multiplier=0.25,
        residual_multiplier=0.5,
        max_position_embeddings=4096,
        attention_bias=False,
        mlp_bias=False,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    # logits * 0.5
    "cohere": dict(model_type="cohere", logit_scale=0.5, layer_norm_eps=1e-5),
    # tanh(logits * 0.3 / 4) * 4, untied
    "muse_glimmer": dict(
        model_type="muse_glimmer",
        head_dim=16,
        output_multiplier=0.3,
        final_logit_softcapping=4.0,
        sliding_window=8,
        tie_word_embeddings=False,
    ),
    # untied: lm_head(h / (64 / 16)); embeddings * 2
    "minicpm": dict(
        model_type="minicpm",
        dim_model_base=16,
        scale_emb=2.0,
        scale_depth=1.4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


def quantized(model):
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def tied_gemma3():
    """gemma3_text ties its head the way mlx-lm's loader does: `sanitize` of weights without lm_head."""
    model = make_model({**_COMMON, **SCALED["gemma3_text"]}, seed=3)
    model.sanitize({})
    return model


TARGETS = {
    **{
        f"{arch}-{'tied' if tied else 'untied'}": (lambda arch=arch, tied=tied: make_target(arch, tied=tied))
        for arch in ("qwen3", "qwen2", "llama", "llama_swa")
        for tied in (True, False)
    },
    **{
        f"{arch}-{'tied' if tied else 'untied'}": (lambda arch=arch, tied=tied: make_hybrid(arch, tied=tied))
        for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
        for tied in (True, False)
    },
    **{
        f"llama4_text-{'tied' if tied else 'untied'}": (
            lambda tied=tied: make_model({**_COMMON, **_LLAMA4, "tie_word_embeddings": tied}, seed=3)
        )
        for tied in (True, False)
    },
    "qwen3-quantized-tied": lambda: quantized(make_target("qwen3", tied=True)),
    "qwen3-quantized-untied": lambda: quantized(make_target("qwen3", tied=False)),
    "qwen3_5-quantized-untied": lambda: quantized(make_hybrid("qwen3_5", tied=False)),
    **{arch: (lambda arch=arch: make_model({**_COMMON, **SCALED[arch]}, seed=3)) for arch in SCALED},
    "gemma3_text-tied": tied_gemma3,
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
    if kind in ("gemma2", "granite", "cohere", "muse_glimmer", "minicpm"):
        # the logit transform matters here: the bare head is far from the target's logits
        raw = np.array(Target(model).lm_head(hidden).astype(mx.float32))
        assert np.abs(raw - expected).max() > 0.1
    ids = mx.array([3, 17, 64, 200, 255])
    reduced = drafter.logits(hidden, Target(model).head_rows(ids)).astype(mx.float32)
    np.testing.assert_allclose(np.array(reduced), expected[..., np.array(ids)], atol=1e-4, rtol=1e-5)


class _FirstLayerInput:
    """Stands in for a decoder's first layer, recording what the decoder feeds it."""

    def __init__(self, layer):
        self.layer, self.seen = layer, None

    def __getattr__(self, name):  # the decoder may read the layer's attributes (llama: use_sliding)
        return getattr(self.layer, name)

    def __call__(self, h, *args, **kwargs):
        self.seen = h
        return self.layer(h, *args, **kwargs)


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_drafter_embeddings_are_the_targets_own(kind):
    """The block's embeddings are the rows the target's decoder feeds its first layer (embedding scale
    included); the drafter's config `input_embedding_scale` multiplies them."""
    model = TARGETS[kind]()
    layers = decoder(model).layers
    spy = layers[0] = _FirstLayerInput(layers[0])
    try:
        decoder(model)(TOKENS)
    finally:
        layers[0] = spy.layer
    seen = spy.seen
    if kind == "muse_glimmer":
        # Muse Glimmer RMS-normalizes its embeddings (no scale to borrow); the authors' reference feeds its
        # drafters the plain rows, and so do we.
        assert np.abs(np.array(seen) - np.array(decoder(model).embed_tokens(TOKENS))).max() > 0.1
        seen = decoder(model).embed_tokens(TOKENS)
    drafter, doubled = make_drafter(model), make_drafter(model, input_embedding_scale=2.0)
    for d, factor in ((drafter, 1.0), (doubled, 2.0)):
        got = d._target.embed(TOKENS) * d._target.embed_scale
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)), factor * np.array(seen.astype(mx.float32)), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("kind", ["gemma2", "muse_glimmer"])
def test_the_drafters_own_logit_settings_win(kind):
    """Settings the drafter's config sets are its own; only unset ones are the target's."""
    model = TARGETS[kind]()
    hidden = decoder(model)(TOKENS)
    raw = np.array(bind_drafter(make_drafter(model), model).lm_head(hidden))
    own = make_drafter(model, output_multiplier=0.5, final_logit_softcapping=3.0)
    np.testing.assert_allclose(np.array(own.logits(hidden)), np.tanh(raw * 0.5 / 3.0) * 3.0, atol=1e-5)
    # multiplier set, softcap unset: the target's cap (5 for gemma2, 4 for muse_glimmer) on the drafter's scale
    cap = SCALED[kind]["final_logit_softcapping"]
    half = make_drafter(model, output_multiplier=0.5)
    np.testing.assert_allclose(np.array(half.logits(hidden)), np.tanh(raw * 0.5 / cap) * cap, atol=1e-5)


def test_unset_logit_settings_stay_unset_through_save_and_load(tmp_path):
    """A drafter saved without logit settings is written without them, and loads to use the target's."""
    model = TARGETS["gemma2"]()
    folder = save_drafter(tmp_path / "d", make_drafter(model))
    written = json.loads((folder / "config.json").read_text())["dflash_config"]
    assert "output_multiplier" not in written and "final_logit_softcapping" not in written
    loaded = load_drafter(str(folder))
    assert loaded.config.output_multiplier is None and loaded.config.final_logit_softcapping is None
    bind_drafter(loaded, model)
    hidden = decoder(model)(TOKENS)
    np.testing.assert_allclose(np.array(loaded.logits(hidden)), np.array(model(TOKENS)), atol=1e-4, rtol=1e-5)
