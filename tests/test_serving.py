"""`dflash2 export --for sglang|vllm`: the folders SGLang and vLLM serve as DFlash / DFlash 2 drafters.

The layout expected here is written out from the engines' loaders (see `dflash2_mlx/formats/serving.py` for
where each name comes from), not taken from the export code: architecture names, `dflash_config` fields,
tensor names and shapes (the selector's tables over the whole vocabulary, no `.weight`), bfloat16, no draft
vocabulary, no embedding or LM head. The exported weights are run through the NumPy reference (which
shares no code with the MLX model) and give the bundled drafter's logits and drafts."""

from __future__ import annotations

import json
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from helpers import FIXTURES, make_target, synthetic_checkpoint

from dflash2_apps.cli import main
from dflash2_mlx import load_drafter
from dflash2_mlx.assets import default_drafter
from dflash2_mlx.convert import convert, export_for
from dflash2_mlx.formats import serving
from dflash2_mlx.formats.quantize import DraftQuant
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.reference import draft_hidden, head_logits, load_checkpoint, read_safetensors, selector_walk
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target

ENGINES = ("sglang", "vllm")
# From the engines' registries (SGLang models/dflash.py EntryClass, vLLM registry.py)
ARCH = {"v1": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# dflash_config fields their parsers read (SGLang parse_dflash_draft_config, vLLM qwen3_dflash[2].py)
V1_FIELDS = {"mask_token_id", "target_layer_ids", "block_size"}
DFLASH2_FIELDS = V1_FIELDS | {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
SMOLLM2_VOCAB = 49152


def header(path) -> dict:
    """name -> {dtype, shape, ...} of a safetensors file (read here, not with the package's reader)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    out = json.loads(data[8 : 8 + n])
    out.pop("__metadata__", None)
    return out


def want_shapes(cfg: dict) -> dict[str, tuple]:
    """Every tensor a DFlash (2) drafter of `cfg` has in the engines' loaders, with its shape."""
    d, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dc = cfg["dflash_config"]
    out = {"fc.weight": (d, d * len(dc["target_layer_ids"])), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for n in range(cfg["num_hidden_layers"]):
        layer = {
            "input_layernorm.weight": (d,),
            "post_attention_layernorm.weight": (d,),
            "self_attn.q_proj.weight": (q, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, q),
            "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,),
            "mlp.gate_proj.weight": (i, d),
            "mlp.up_proj.weight": (i, d),
            "mlp.down_proj.weight": (d, i),
        }
        if "conv_kernel_size" in dc:
            for conv in ("attention_conv", "mlp_conv"):
                layer[f"{conv}.base_kernel"] = (2, dc["conv_kernel_size"], d)
                layer[f"{conv}.kernel_projection.weight"] = (2 * dc["conv_kernel_size"] * d // dc["conv_group_size"], d)
        out.update({f"layers.{n}.{k}": v for k, v in layer.items()})
    if "selector_rank" in dc:
        r, v = dc["selector_rank"], cfg["vocab_size"]
        out.update(
            {
                "candidate_selector.hidden_projection.weight": (r, d),
                "candidate_selector.predecessor_codebook": (v, r),
                "candidate_selector.successor_codebook": (v, r),
            }
        )
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2):
    """The bundled drafters exported for both engines (DFlash 2 with its target, v1 without one)."""
    model, _ = smollm2
    root = tmp_path_factory.mktemp("serving")
    return {
        (kind, engine): export_for(
            str(default_drafter(kind)), root / f"{kind}-{engine}", engine, model if kind == "dflash2" else None
        )
        for kind in ("dflash2", "v1")
        for engine in ENGINES
    }


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["dflash2", "v1"])
def test_bundled_drafter_exports_the_engines_layout(exported, engine, kind):
    out = exported[kind, engine]
    source = json.loads((default_drafter(kind) / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    dc = cfg["dflash_config"]
    assert cfg["architectures"] == [ARCH[kind]] and cfg["model_type"] == "qwen3"
    assert set(dc) >= (DFLASH2_FIELDS if kind == "dflash2" else V1_FIELDS)
    for field in DFLASH2_FIELDS - {"block_size"}:  # the values are the drafter's
        if field in dc:
            assert dc[field] == source["dflash_config"][field], field
    assert dc["block_size"] == cfg["block_size"] == 8
    assert dc["input_embedding_scale"] == 1.0 and dc["sample_from_anchor"] is False
    assert cfg["vocab_size"] == SMOLLM2_VOCAB and cfg["hidden_act"] == "silu" and cfg["is_causal"] is False
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    text = json.dumps(cfg)
    assert "selector_factorized" not in text and '"mlx"' not in text and "quantization" not in cfg
    # the card says what changed on the way
    readme = (out / "README.md").read_text()
    assert readme.startswith((default_drafter(kind) / "README.md").read_text().rstrip("\n"))
    for said in (readme, cfg["dflash2_mlx_note"]):
        assert "draft vocabulary (3072 tokens) dropped" in said
        assert ("factorised selector expanded" in said) == (kind == "dflash2")
    # no draft vocabulary, no frequency table, one weights file
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    tensors = header(out / "model.safetensors")
    assert {n: tuple(t["shape"]) for n, t in tensors.items()} == want_shapes(cfg)
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    assert serving.check_folder(engine, out) == []


def test_the_expected_layout_is_the_published_checkpoints():
    """The names and shapes expected above (and the package's own spec) are those of a published DFlash 2
    checkpoint (its safetensors header: 5 layers, selector tables over its 202048-token vocabulary, no
    embedding or LM head); and its v1 part without conv and selector."""
    cfg = json.loads((FIXTURES / "dflash2-config.json").read_text())
    published = {
        n: tuple(t["shape"]) for n, t in json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text()).items()
    }
    assert want_shapes(cfg) == published == serving.expected_tensors(cfg)
    v1 = {**cfg, "dflash_config": {k: cfg["dflash_config"][k] for k in V1_FIELDS}}
    v1_names = {n: s for n, s in published.items() if "_conv." not in n and "candidate_selector" not in n}
    assert want_shapes(v1) == v1_names == serving.expected_tensors(v1)


def test_both_engines_get_the_same_weights(exported):
    for kind in ("dflash2", "v1"):
        a, b = (exported[kind, e] / "model.safetensors" for e in ENGINES)
        assert a.read_bytes() == b.read_bytes()


PROMPT = [{"role": "user", "content": "Write a short poem about the sea and the ships that sail on it."}]


def real_block(smollm2, cfg, anchor_at: int = 24):
    """Target features of a real chat prompt's first `anchor_at` rows and the block drafted after them."""
    model, tokenizer = smollm2
    tokens = mx.array([tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)])
    assert tokens.shape[1] > anchor_at
    features = np.array(Target(model, cfg.target_layer_ids).sequence_features(tokens)[0], np.float64)
    block = [int(tokens[0, anchor_at])] + [cfg.mask_token_id] * (cfg.block_size - 1)
    return features[:anchor_at], block


@pytest.mark.parametrize("kind", ["dflash2", "v1"])
def test_exported_weights_give_the_drafters_logits(exported, smollm2, kind):
    """Our drafter (as bundled, bf16 weights, run in float32) and the NumPy reference over the exported
    folder: the same logits within 1e-3, over the whole vocabulary and over the bundled draft vocabulary."""
    model, _ = smollm2
    cfg_np, tensors = load_checkpoint(exported[kind, "vllm"])
    embed = np.array(Target(model).embed_tokens.weight, np.float64)  # SmolLM2 ties its head to it
    for vocab in (False, True):
        drafter = load_drafter(str(default_drafter(kind)), dtype="float32")
        ids = drafter.draft_vocab
        if not vocab:
            drafter.draft_vocab = None
        bind_drafter(drafter, model)
        context, block = real_block(smollm2, drafter.config)
        want = head_logits(cfg_np, draft_hidden(cfg_np, tensors, embed, block, context)[1:], embed)
        got = np.array(drafter(mx.array([block]), mx.array(context[None], mx.float32), drafter.make_cache())[0])
        if vocab:
            want = want[:, ids]
        err = np.abs(got - want).max()
        print(
            f"{kind} {'draft' if vocab else 'whole'} vocabulary: max |logit| {np.abs(want).max():.2f}, "
            f"max abs error {err:.2e}"
        )
        assert got.shape == want.shape and err < 1e-3


@pytest.mark.slow
def test_expanded_selector_tables_are_the_factorised_codes(exported, smollm2):
    """The exported tables hold embed(token) @ projection.T for every token, to bf16 rounding (relative 2^-8;
    NumPy, float64)."""
    model, _ = smollm2
    source = read_safetensors(default_drafter("dflash2") / "model.safetensors")
    tensors = read_safetensors(exported["dflash2", "sglang"] / "model.safetensors")
    embed = np.array(Target(model).embed_tokens.weight, np.float64)
    for side in ("predecessor", "successor"):
        exact = embed @ source[f"candidate_selector.{side}_projection.weight"].T
        table = tensors[f"candidate_selector.{side}_codebook"]
        rel = np.abs(table - exact) / (np.abs(exact) + 1e-30)
        print(
            f"{side}: max relative error {rel[np.abs(exact) > 1e-3].max():.2e} over entries above 1e-3 "
            f"(bf16's rounding bound 2^-8 = {2**-8:.2e})"
        )
        assert np.all(np.abs(table - exact) <= 2**-8 * np.abs(exact) + 1e-6)


@pytest.mark.slow
def test_reference_walk_over_the_export_drafts_what_the_drafter_drafts(exported, smollm2):
    """T = 0: the selector's reference walk over the exported tables (NumPy) picks our drafter's drafts
    (whole vocabulary), block after block."""
    model, _ = smollm2
    cfg_np, tensors = load_checkpoint(exported["dflash2", "sglang"])
    embed = np.array(Target(model).embed_tokens.weight, np.float64)
    drafter = load_drafter(str(default_drafter("dflash2")), dtype="float32")
    drafter.draft_vocab = None
    bind_drafter(drafter, model)
    for anchor_at in (12, 20, 24, 28):
        context, block = real_block(smollm2, drafter.config, anchor_at)
        hidden = draft_hidden(cfg_np, tensors, embed, block, context)[1:]
        want, _, _ = selector_walk(cfg_np, tensors, hidden, head_logits(cfg_np, hidden, embed), block[0])
        got = drafter.propose(
            mx.array([block]),
            mx.array(context[None], mx.float32),
            drafter.make_cache(),
            SamplingParams(temperature=0.0),
        )
        assert np.array(got.tokens).tolist() == want.tolist(), anchor_at


# -- fixtures in the published layouts, without a target -----------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", ["v1", "dflash2"])
def test_published_layout_fixtures_export_unchanged(tmp_path, engine, layout):
    """A published-layout drafter (converted to MLX) comes back with its tensors bit for bit, the
    engine's names, and every dflash_config field of the published DFlash 2 checkpoint."""
    src = synthetic_checkpoint(tmp_path / "hf", layout)
    out = export_for(str(convert(str(src), tmp_path / "mlx")), tmp_path / "out", engine)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [ARCH[layout]]
    published = json.loads((src / "config.json").read_text())["dflash_config"]
    assert set(cfg["dflash_config"]) >= set(published)
    assert {k: cfg["dflash_config"][k] for k in published} == published
    original, back = read_safetensors(src / "model.safetensors"), read_safetensors(out / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(np.array_equal(back[k], original[k]) for k in original)
    assert {t["dtype"] for t in header(out / "model.safetensors").values()} == {"BF16"}
    assert serving.check_folder(engine, out) == []


def test_muse_and_quantized_drafters_export(tmp_path):
    """A Muse-style v1 drafter is served as a DFlashDraftModel (its `encoder.*` names the plain ones, its block
    bidirectional as its engines run it); a quantized MLX drafter is written dequantized, and says so."""
    src = synthetic_checkpoint(tmp_path / "muse", "muse")
    out = export_for(str(src), tmp_path / "muse-out", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["is_causal"] is False
    assert cfg["dflash_config"]["mask_token_id"] == json.loads((src / "config.json").read_text())["mask_token_id"]
    original, back = read_safetensors(src / "model.safetensors"), read_safetensors(out / "model.safetensors")
    assert np.array_equal(back["fc.weight"], original["encoder.fc.weight"])
    assert np.array_equal(back["hidden_norm.weight"], original["encoder.output_norm_enc.weight"])
    assert serving.check_folder("vllm", out) == []
    quantized = convert(
        str(synthetic_checkpoint(tmp_path / "hf", "dflash2")),
        tmp_path / "q8",
        quant=DraftQuant(8, 32, 32),
        min_quantized_size=0,
    )
    out = export_for(str(quantized), tmp_path / "q8-out", "sglang")
    note = json.loads((out / "config.json").read_text())["dflash2_mlx_note"]
    assert "dequantized from a w8a32:gs32 MLX drafter" in note
    assert serving.check_folder("sglang", out) == []


def test_the_folder_check_finds_each_breach(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    out = export_for(str(src), tmp_path / "out", "vllm")
    assert serving.check_folder("vllm", out) == []
    path = out / "model.safetensors"
    weights = dict(mx.load(str(path)))
    cases = {
        "missing tensor candidate_selector.successor_codebook": lambda w: w.pop(
            "candidate_selector.successor_codebook"
        ),
        "unexpected tensor lm_head.weight": lambda w: w.update({"lm_head.weight": mx.zeros((256, 64), mx.bfloat16)}),
        "norm.weight is F32": lambda w: w.update({"norm.weight": w["norm.weight"].astype(mx.float32)}),
        "fc.weight has shape (64, 256)": lambda w: w.update({"fc.weight": mx.zeros((64, 256), mx.bfloat16)}),
    }
    for problem, edit in cases.items():
        changed = dict(weights)
        edit(changed)
        mx.save_safetensors(str(path), changed)
        assert any(problem in p for p in serving.check_folder("vllm", out)), problem
    mx.save_safetensors(str(path), weights)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]["selector_top_k"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert serving.check_folder("vllm", out) == ["dflash_config lacks selector_top_k"]


# -- refused: what the engines would run differently -------------------------------------------------------


def edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("engine", ENGINES)
def test_anchor_sampling_drafters_are_refused(tmp_path, engine):
    src = edit_config(
        synthetic_checkpoint(tmp_path / "hf", "dflash2"), lambda c: c["dflash_config"].update(sample_from_anchor=True)
    )
    with pytest.raises(
        ValueError,
        match=r"draft from block rows 1\.\.B-1 \(sample_from_anchor false\).*"
        r"vllm/pull/54154 \(open\).*`dflash2 serve`",
    ):
        export_for(str(src), tmp_path / "out", engine)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_v1_drafters_with_their_own_logit_settings_are_refused(tmp_path, engine):
    src = edit_config(
        synthetic_checkpoint(tmp_path / "hf", "v1"), lambda c: c["dflash_config"].update(output_multiplier=0.5)
    )
    with pytest.raises(
        ValueError,
        match="with the target's own head and settings, but this drafter sets its own "
        r"\(output_multiplier 0\.5",
    ):
        export_for(str(src), tmp_path / "out", engine)


def test_an_embedding_scale_only_vllm_dflash2_reads(tmp_path):
    src = edit_config(
        synthetic_checkpoint(tmp_path / "hf", "dflash2"), lambda c: c["dflash_config"].update(input_embedding_scale=2.0)
    )
    with pytest.raises(
        ValueError,
        match=r"SGLang feeds a DFlash2DraftModel the target's unscaled token embeddings, "
        r"but this drafter scales them by 2 .*export it --for vllm",
    ):
        export_for(str(src), tmp_path / "sglang", "sglang")
    out = export_for(str(src), tmp_path / "vllm", "vllm")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["input_embedding_scale"] == 2.0
    v1 = edit_config(
        synthetic_checkpoint(tmp_path / "hf1", "v1"), lambda c: c["dflash_config"].update(input_embedding_scale=2.0)
    )
    with pytest.raises(ValueError, match="vLLM feeds a DFlashDraftModel the target's unscaled token embeddings"):
        export_for(str(v1), tmp_path / "v1", "vllm")


def test_what_needs_the_target_asks_for_it(tmp_path):
    with pytest.raises(ValueError, match="selector is factorised .* pass the target with --model"):
        export_for(str(default_drafter("dflash2")), tmp_path / "out", "vllm")
    src = edit_config(synthetic_checkpoint(tmp_path / "hf", "v1"), lambda c: c.pop("vocab_size"))
    with pytest.raises(ValueError, match="does not name its vocabulary size.*pass the target with --model"):
        export_for(str(src), tmp_path / "out", "sglang")
    out = export_for(str(src), tmp_path / "out", "sglang", make_target("qwen3", layers=6))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 256
    with pytest.raises(ValueError, match="unknown serving engine 'tgi'"):
        export_for(str(src), tmp_path / "out", "tgi")


def test_the_cli(tmp_path, capsys):
    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    assert main(["export", "--mlx-path", str(src), "--hf-path", str(tmp_path / "out"), "--for", "vllm"]) == 0
    err = capsys.readouterr().err
    assert '"method": "dflash"' in err and '"num_speculative_tokens": 15' in err and str(tmp_path / "out") in err
    assert (
        main(
            [
                "export",
                "--mlx-path",
                str(src),
                "--hf-path",
                str(tmp_path / "o2"),
                "--for",
                "sglang",
                "--dtype",
                "float32",
            ]
        )
        == 2
    )
    assert "--for sglang writes bfloat16" in capsys.readouterr().err
    assert main(["export", "--mlx-path", str(src), "--hf-path", str(tmp_path / "o3"), "--model", "x"]) == 2
    assert "--model is for --for sglang|vllm exports" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "out")
