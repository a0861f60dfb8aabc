"""The target wrapper: features from the verify pass itself, chunked prefill, rollback."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_target
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
    with target.capture() as tap:
        logits, feats = tap.forward(tokens, target.make_cache())
    outs, final = manual_layer_outputs(model, tokens)
    # Hugging Face's hidden_states[i + 1] is layer i's output; the last one is taken after the final norm.
    expected = mx.concatenate([outs[0], outs[2], final], axis=-1)
    np.testing.assert_allclose(np.array(feats), np.array(expected), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(logits), np.array(model(tokens[None])[0]), atol=1e-4)


def test_a_model_is_captured_by_one_generation_at_a_time():
    """A second capture of the same model (another Target on it) is refused while the first is open; the
    first keeps working, and the model can be captured again once it closes."""
    model = make_target("qwen3")
    first, second = Target(model, (1, 3)), Target(model, (1,))
    tokens = mx.array([5, 9, 33, 2])
    with first.capture() as tap:
        with pytest.raises(RuntimeError, match="already being captured"):
            with second.capture():
                pass
        _, feats = tap.forward(tokens, first.make_cache())
    outs, final = manual_layer_outputs(model, tokens)
    np.testing.assert_allclose(np.array(feats), np.array(mx.concatenate([outs[1], final], -1)), atol=1e-4)
    with second.capture() as tap:
        assert tap.forward(tokens, second.make_cache())[1].shape == (4, 64)


def test_capture_restores_the_model_even_on_error():
    model = make_target("llama")
    target = Target(model, (0, 3))
    before = [type(layer) for layer in model.layers]
    keys_before = sorted(k for k, _ in model.parameters().items())
    with pytest.raises(KeyError):
        with target.capture():
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
    with target.capture() as tap:
        ref_logits, ref_feats = tap.prefill(prompt, target.make_cache(), step_size=4096)
        logits, feats = tap.prefill(prompt, target.make_cache(), step_size=step)
    np.testing.assert_allclose(
        np.array(target.prefill(prompt, target.make_cache(), step)), np.array(ref_logits), atol=1e-4, rtol=1e-4
    )
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
    with target.capture() as tap:
        for _ in range(12):
            block = [int(t) for t in rng.integers(6, 250, size=8)]
            keep = int(rng.integers(1, 9))
            tap.rollback(cache, tap.verify(mx.array(block), cache), keep)
            history += block[:keep]
            probe = int(rng.integers(6, 250))
            fresh = target.make_cache()
            target.prefill(mx.array(history), fresh)
            expected = target(mx.array([probe]), fresh)
            probed = tap.verify(mx.array([probe]), cache)
            tap.rollback(cache, probed, 0)
            np.testing.assert_allclose(np.array(probed.logits), np.array(expected), atol=2e-4, rtol=1e-4)
    assert all(c.offset == len(history) for c in cache)


def test_rollback_takes_only_the_last_pass():
    """A rollback undoes the verify pass it is given, and refuses one that other tokens followed."""
    target = Target(make_target("llama"))
    cache = target.make_cache()
    target.prefill(mx.array([3, 4, 5]), cache)
    with target.capture() as tap:
        older = tap.verify(mx.array([6, 7]), cache)
        newer = tap.verify(mx.array([8, 9, 10]), cache)
        with pytest.raises(RuntimeError, match="cache moved"):
            tap.rollback(cache, older, 1)
        with pytest.raises(ValueError, match="cannot keep 4 rows"):
            tap.rollback(cache, newer, 4)
        tap.rollback(cache, newer, 1)
    assert [c.offset for c in cache] == [6] * len(cache)


def test_unrollable_cache_is_named():
    """LFM2's short-conv layers keep state no recorder knows how to rebuild: refused by name."""
    from mlx_lm.models import lfm2

    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=64,
        layer_types=["conv", "full_attention"],
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
    np.testing.assert_allclose(np.array(tied.lm_head(h)), np.array(tied.embed_tokens.as_linear(h)), atol=1e-5)
