"""The target wrapper: features from the verify pass itself, chunked prefill, rollback."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_target
from mlx_lm.models.base import create_attention_mask

from dflash2_mlx.target import Target

ARCHS = ["qwen3", "llama", "qwen2", "llama_swa"]


def manual_layer_outputs(model, tokens):
    """Layer outputs by walking the decoder by hand (full attention, no cache)."""
    inner = model.model
    h = inner.embed_tokens(tokens[None])
    mask = create_attention_mask(h, None)
    outs = []
    for layer in inner.layers:
        h = layer(h, mask, cache=None)
        outs.append(h[0])
    return outs, inner.norm(h)[0]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_features_are_the_layer_outputs(arch):
    model = make_target(arch)
    target = Target(model, (0, 2, 3))
    tokens = mx.array([5, 9, 33, 2, 200, 17])
    with target.capturing():
        logits, feats = target(tokens, target.make_cache())
    outs, final = manual_layer_outputs(model, tokens)
    # Hugging Face's hidden_states[i + 1] is layer i's output; the last one is taken after the final norm.
    expected = mx.concatenate([outs[0], outs[2], final], axis=-1)
    np.testing.assert_allclose(np.array(feats), np.array(expected), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(logits), np.array(model(tokens[None])[0]), atol=1e-4)


def test_features_need_the_capture_block():
    target = Target(make_target("qwen3"), (1,))
    with pytest.raises(RuntimeError, match="capturing"):
        target(mx.array([1, 2]), target.make_cache())


def test_capture_restores_the_model_even_on_error():
    model = make_target("llama")
    target = Target(model, (0, 3))
    before = [type(layer) for layer in model.layers]
    keys_before = sorted(k for k, _ in model.parameters().items())
    with pytest.raises(KeyError):
        with target.capturing():
            assert type(model.layers[0]) is not before[0]
            assert isinstance(model.layers[0], before[0])  # a subclass: attributes unchanged
            raise KeyError("boom")
    assert [type(layer) for layer in model.layers] == before
    assert sorted(k for k, _ in model.parameters().items()) == keys_before
    # other instances of the same class were never touched
    assert type(make_target("llama").layers[0]) is before[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("step", [1, 3, 64])
def test_chunked_prefill_equals_one_pass(arch, step):
    model = make_target(arch)
    target = Target(model, (1, 2))
    prompt = mx.array(list(range(10, 31)))
    with target.capturing():
        ref_logits, ref_feats = target.prefill(prompt, target.make_cache(), step_size=4096)
        logits, feats = target.prefill(prompt, target.make_cache(), step_size=step)
    assert feats.shape == (21, 2 * 64)
    np.testing.assert_allclose(np.array(feats), np.array(ref_feats), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(logits), np.array(ref_logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_equals_fresh_prefill(arch):
    """Verify a block, keep a prefix, roll back the rest: the cache then behaves exactly like one
    prefilled with the kept tokens (also for rotating caches far past their window)."""
    model = make_target(arch)
    target = Target(model)
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(6, 250, size=20)]
    cache = target.make_cache()
    target.prefill(mx.array(history), cache)
    for cycle in range(12):
        block = [int(t) for t in rng.integers(6, 250, size=8)]
        target(mx.array(block), cache)
        keep = int(rng.integers(1, 9))
        target.rollback(cache, 8 - keep)
        history += block[:keep]
        probe = int(rng.integers(6, 250))
        fresh = target.make_cache()
        target.prefill(mx.array(history), fresh)
        expected, _ = target(mx.array([probe]), fresh)
        got, _ = target(mx.array([probe]), cache)
        target.rollback(cache, 1)
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-4, rtol=1e-4)
    assert all(c.offset == len(history) for c in cache)


def test_unrollable_cache_is_named():
    """LFM2's short-conv layers keep state no recorder knows how to rebuild: refused by name."""
    from mlx_lm.models import lfm2

    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=32, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        block_ff_dim=64, layer_types=["conv", "full_attention"],
    )
    target = Target(lfm2.Model(args))
    with pytest.raises(ValueError, match="'lfm2' keeps state that cannot be rolled back"):
        target.make_cache()


def test_layer_ids_beyond_the_target():
    with pytest.raises(ValueError, match=r"reads target layers \[4, 9\].*only 4 layers"):
        Target(make_target("qwen3"), (1, 4, 9))


def test_untied_head_is_used():
    model = make_target("llama", tied=False)
    target = Target(model)
    assert target.lm_head is model.lm_head
    tied = Target(make_target("llama"))
    h = mx.ones((1, 64))
    np.testing.assert_allclose(
        np.array(tied.lm_head(h)), np.array(tied.embed_tokens.as_linear(h)), atol=1e-5
    )
