"""The DFlash v1 drafter: KV injection bookkeeping, block attention, sliding context, logits, loading."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import DFLASH2, drafter_config, make_dflash2_drafter, make_drafter, make_target, save_drafter
from mlx.utils import tree_flatten

from dflash2_mlx import DFlashDraftModel, DraftConfig, load_drafter
from dflash2_mlx.drafter import DFlash2DecoderLayer, DFlash2DraftModel, TrainingBlocks
from dflash2_mlx.formats.config import default_target_layer_ids
from dflash2_mlx.loading import bind_drafter

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


def features(n: int, seed: int = 0, k: int = 2) -> mx.array:
    return mx.random.normal((1, n, k * 64), key=mx.random.key(seed))


def block(anchor: int, B: int, mask: int = 255) -> mx.array:
    return mx.array([[anchor] + [mask] * (B - 1)])


def test_incremental_context_equals_all_at_once(target):
    """Context K/V are cached across cycles: feeding rows in pieces gives the same drafts as feeding
    them at once, because only context (never block) rows enter the cache."""
    drafter = make_drafter(target, block_size=8)
    ctx = features(23)
    cache = drafter.make_cache()
    drafter(block(7, 8), ctx[:, :10], cache)
    drafter(block(9, 5), ctx[:, 10:17], cache)
    got = drafter(block(11, 8), ctx[:, 17:], cache)
    expected = drafter(block(11, 8), ctx, drafter.make_cache())
    assert all(c.offset == 23 for c in cache)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)


def test_a_call_without_new_context_rows_reads_the_cached_ones(target):
    """No new context rows (e.g. a second draft from the same position): the block attends to exactly the
    rows the cache holds, also after a trim left stale rows in its buffer."""
    drafter = make_drafter(target, block_size=8)
    ctx = features(12)
    cache = drafter.make_cache()
    drafter(block(7, 8), ctx, cache)
    for c in cache:
        c.trim(3)  # rows 9..11 stay in the buffer, past the offset
    got = drafter(block(11, 8), ctx[:, :0], cache)
    expected = drafter(block(11, 8), ctx[:, :9], drafter.make_cache())
    assert all(c.offset == 9 for c in cache)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_direction(target, causal):
    drafter = make_drafter(target, block_size=6, is_causal=causal)
    ctx = features(5)
    a = drafter.hidden(mx.array([[7, 255, 255, 255, 255, 255]]), ctx, drafter.make_cache())
    b = drafter.hidden(mx.array([[7, 255, 255, 255, 255, 40]]), ctx, drafter.make_cache())
    changed = np.abs(np.array(a - b)).max(axis=-1)[0]
    assert changed[-1] > 1e-3
    if causal:
        assert changed[:-1].max() < 1e-6  # earlier rows cannot see the last one
    else:
        assert changed[:-1].min() > 1e-4  # bidirectional: every row sees every other


def test_sliding_window_context(target):
    """Block row j (position P+j) sees context position k only when P+j-k < window."""
    W, P, B = 6, 20, 4
    drafter = make_drafter(target, block_size=B, sliding_window=W, layers=1)  # one hop of attention
    ctx = features(P)
    ref = np.array(drafter.hidden(block(7, B), ctx, drafter.make_cache()))

    def perturbed(row):
        noise = mx.zeros_like(ctx).at[:, row].add(5.0)
        return np.array(drafter.hidden(block(7, B), ctx + noise, drafter.make_cache()))

    def changed(row):
        return np.abs(perturbed(row) - ref).max(axis=-1)[0] > 1e-5

    assert not changed(P - W).any()  # outside every row's window
    assert changed(P - W + 1).tolist() == [True] + [False] * (B - 1)  # only row 0 still sees it
    assert changed(P - 1).all()


@pytest.mark.parametrize("kind", ["bidirectional", "causal", "sliding", "dflash2"])
def test_training_blocks_equal_decoding(target, kind):
    """Training drafts all blocks of a sequence in one attention; each block must get exactly what
    decoding gives it: the context rows before its anchor, its own rows, nothing of the other blocks."""
    kw = {"causal": {"is_causal": True}, "sliding": {"sliding_window": 5}}.get(kind, {})
    make = make_dflash2_drafter if kind == "dflash2" else make_drafter
    drafter = make(target, block_size=4, **kw)
    S, L, B = 2, 12, 4
    ctx = mx.random.normal((S, L, 2 * 64), key=mx.random.key(3))
    anchors = mx.array([[2, 9, 5], [11, 0, 7]])
    blocks = mx.array([[10 + n] + [255] * (B - 1) for n in range(6)])
    got = np.array(drafter.hidden(blocks, ctx, None, TrainingBlocks(anchors)))
    for n, (s, a) in enumerate([(seq, a) for seq in range(S) for a in anchors[seq].tolist()]):
        expected = drafter.hidden(blocks[n : n + 1], ctx[s : s + 1, :a], drafter.make_cache())
        np.testing.assert_allclose(got[n], np.array(expected[0]), atol=1e-4, rtol=1e-4)


def test_decoding_reads_the_current_weights(target):
    """Decoding runs compiled halves of each layer: weights replaced after the first call (an optimizer step
    before an eval, a checkpoint loaded) must be the ones used, as the uncompiled training path uses them."""
    drafter = make_dflash2_drafter(target, block_size=4)
    ctx = mx.random.normal((1, 6, 2 * 64), key=mx.random.key(4))
    block = mx.array([[10, 255, 255, 255]])
    before = np.array(drafter.hidden(block, ctx, drafter.make_cache()))
    layer = drafter.layers[-1]
    layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 3.0
    layer.mlp_conv.kernel_projection.weight = (
        mx.random.normal(layer.mlp_conv.kernel_projection.weight.shape, key=mx.random.key(5)) * 0.1
    )
    after = np.array(drafter.hidden(block, ctx, drafter.make_cache()))
    training = np.array(drafter.hidden(block, ctx, None, TrainingBlocks(mx.array([[6]]))))
    assert not np.allclose(after, before, atol=1e-3)
    np.testing.assert_allclose(after, training, atol=1e-4, rtol=1e-4)


def test_logit_transform(target):
    drafter = make_drafter(target, output_multiplier=0.5, final_logit_softcapping=3.0)
    h = mx.random.normal((1, 3, 64), key=mx.random.key(1))
    raw = np.array(bind_drafter(drafter, target).lm_head(h))
    np.testing.assert_allclose(np.array(drafter.logits(h)), np.tanh(raw * 0.5 / 3.0) * 3.0, atol=1e-5)


def test_input_embedding_scale(target):
    plain = make_drafter(target, seed=3)
    scaled = make_drafter(target, seed=3, input_embedding_scale=2.0)
    probe = mx.array([[5, 6]])
    tgt = bind_drafter(plain, target)
    assert np.allclose(
        np.array(scaled._target.embed(probe) * scaled._target.embed_scale),
        np.array(tgt.embed_tokens(probe) * 2.0),
    )


@pytest.mark.parametrize("prefix", ["", "model."])
def test_save_and_load_round_trip(target, tmp_path, prefix):
    drafter = make_drafter(target, block_size=8, sliding_window=16)
    folder = save_drafter(tmp_path / "d", drafter, prefix=prefix)
    loaded = load_drafter(str(folder))
    bind_drafter(loaded, target)
    assert loaded.config == drafter.config
    ctx = features(9)
    np.testing.assert_array_equal(
        np.array(loaded(block(3, 8), ctx, loaded.make_cache())),
        np.array(drafter(block(3, 8), ctx, drafter.make_cache())),
    )


def test_muse_layout_loads(target, tmp_path):
    """Muse-style v1: DFlash fields at the top level, `encoder.fc` / `encoder.output_norm_enc` names."""
    drafter = make_drafter(target, block_size=8, sliding_window=32)
    cfg = drafter.config.to_hf_dict()
    dflash = cfg.pop("dflash_config")
    cfg.update(
        architectures=["MuseGlimmerAssistantModel"],
        target_layer_ids=dflash["target_layer_ids"],
        mask_token_id=dflash["mask_token_id"],
    )
    folder = tmp_path / "muse"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    renames = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    weights = {}
    for k, v in tree_flatten(drafter.parameters()):
        for old, new in renames.items():
            if k.startswith(old):
                k = new + k[len(old) :]
        weights[k] = v
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    loaded = load_drafter(str(folder))
    assert loaded.config.is_causal is False  # bidirectional despite sliding layer_types
    bind_drafter(loaded, target)
    ctx = features(4)
    np.testing.assert_allclose(
        np.array(loaded(block(3, 8), ctx, loaded.make_cache())),
        np.array(
            make_drafter(target, block_size=8, sliding_window=32, is_causal=False)(
                block(3, 8), ctx, drafter.make_cache()
            )
        ),
        atol=1e-5,
    )


def test_published_configs_parse():
    muse = DraftConfig.from_hf_dict(json.loads((FIXTURES / "muse-v1-assistant-config.json").read_text()))
    assert muse.block_size == 16 and muse.target_layer_ids == (1, 13, 25, 37, 49)
    assert muse.mask_token_id == 201818 and muse.sliding_window == 2048
    assert muse.rope_theta == 500000.0 and muse.head_dim == 128 and muse.is_causal is False
    v2 = DraftConfig.from_hf_dict(json.loads((FIXTURES / "dflash2-config.json").read_text()))
    assert v2.is_dflash2 and v2.block_size == 16 and v2.target_layer_ids == (1, 13, 25, 37, 49)
    assert (v2.conv_kernel_size, v2.conv_group_size, v2.selector_rank, v2.selector_top_k) == (2, 16, 256, 16)
    assert v2.final_logit_softcapping == 20.0 and v2.output_multiplier == pytest.approx(0.196116135)
    assert v2.is_causal is False and v2.vocab_size == 202048 and v2.num_target_layers == 52


def test_default_layer_ids():
    assert default_target_layer_ids(36) == (1, 9, 17, 25, 33)  # Qwen3-8B, as published


def test_missing_tensor_is_named(target, tmp_path):
    folder = save_drafter(tmp_path / "d", make_drafter(target))
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["layers.1.mlp.up_proj.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load_drafter(str(folder))


def test_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a hub id"):
        load_drafter(str(tmp_path / "nowhere" / "deep"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="could not fetch 'someone/missing-drafter'"):
        load_drafter("someone/missing-drafter")  # the hub is unreachable (and HF_HUB_OFFLINE is set)


def test_unknown_architecture():
    cfg = drafter_config(make_target("qwen3")).to_hf_dict()
    cfg["architectures"] = ["EagleDraftModel"]
    with pytest.raises(ValueError, match="unknown drafter architecture 'EagleDraftModel'"):
        DraftConfig.from_hf_dict(cfg)


def test_drafter_must_fit_its_target(target):
    other = make_target("llama", vocab=128)
    drafter = DFlashDraftModel.from_config(drafter_config(target))
    with pytest.raises(ValueError, match=r"vocabulary \(256\) differs from the target's \(128\)"):
        bind_drafter(drafter, other)
    with pytest.raises(ValueError, match="mask_token_id 999 is outside"):
        bind_drafter(DFlashDraftModel.from_config(drafter_config(target, mask_token_id=999)), target)
    with pytest.raises(ValueError, match="hidden size 32 does not match the target's 64"):
        bind_drafter(DFlashDraftModel.from_config(drafter_config(target, hidden_size=32)), target)
    with pytest.raises(ValueError, match=r"reads target layers \[7\]"):
        bind_drafter(DFlashDraftModel.from_config(drafter_config(target, target_layer_ids=(1, 7))), target)
    with pytest.raises(RuntimeError, match="not bound"):
        drafter(block(1, 4), features(2), drafter.make_cache())


def test_each_architecture_is_its_own_class():
    """A config builds its architecture's class: v1 layers carry no convolution and the model no selector
    (so its weights hold none), DFlash 2 has both; only DFlash 2 accepts the selector's walks."""
    target = make_target()
    v1 = DFlashDraftModel.from_config(drafter_config(target))
    v2 = DFlashDraftModel.from_config(drafter_config(target, **DFLASH2))
    assert type(v1) is DFlashDraftModel and type(v2) is DFlash2DraftModel
    assert not any(isinstance(layer, DFlash2DecoderLayer) for layer in v1.layers)
    assert all(isinstance(layer, DFlash2DecoderLayer) for layer in v2.layers)

    def names(m):
        return {k.split(".")[-2] for k, _ in tree_flatten(m.parameters()) if "." in k}

    assert not names(v1) & {"attention_conv", "mlp_conv", "candidate_selector"}
    assert {"kernel_projection"} <= names(v2) and any(
        k.startswith("candidate_selector.") for k, _ in tree_flatten(v2.parameters())
    )
    with pytest.raises(ValueError, match="needs a DFlash 2 drafter"):
        v1.check_walk("viterbi")
    v2.check_walk("viterbi")


@pytest.mark.parametrize(
    "kw",
    [{}, DFLASH2, {**DFLASH2, "sliding_window": 6}, {"is_causal": True}],
    ids=["v1", "dflash2", "sliding", "causal"],
)
def test_one_pass_over_several_requests_drafts_as_a_pass_each(kw):
    """Three requests whose contexts differ in length (one with no new rows), over two passes each: one batched
    pass gives every request the hidden rows, drafts and confidences its own pass gives, and leaves its cache as
    its own pass does."""
    from dflash2_mlx.sampling import SamplingParams

    model = make_target("qwen3", seed=4)
    drafter = make_drafter(model, seed=3, block_size=8, **kw)
    features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    rng = np.random.default_rng(0)
    alone, together = [drafter.make_cache() for _ in range(3)], [drafter.make_cache() for _ in range(3)]
    for lengths, anchors in (((5, 12, 1), (7, 8, 9)), ((3, 0, 9), (20, 21, 22))):
        contexts = [mx.array(rng.normal(size=(1, n, features)).astype(np.float32)) for n in lengths]
        blocks = mx.concatenate([drafter.input_block(mx.array(a, mx.uint32), 8) for a in anchors])
        want = [drafter.propose(blocks[i : i + 1], contexts[i], alone[i], SamplingParams()) for i in range(3)]
        got = drafter.propose_batch(blocks, contexts, together, [SamplingParams()] * 3)
        for w, g in zip(want, got):
            assert g.tokens.tolist() == w.tokens.tolist()
            np.testing.assert_allclose(np.array(g.confidence), np.array(w.confidence), rtol=1e-4, atol=1e-5)
        for a, t in zip(alone, together):
            assert [c.offset for c in a] == [c.offset for c in t]
    hidden = drafter.hidden_batch(blocks, [contexts[0][:, :0]] * 3, together)
    for i in range(3):
        want = drafter.hidden(blocks[i : i + 1], contexts[0][:, :0], alone[i])
        np.testing.assert_allclose(np.array(hidden[i]), np.array(want[0]), rtol=1e-4, atol=1e-4)
