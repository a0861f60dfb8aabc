"""One conversion path with the CUDA engines: convert / export round trips, NumPy-reference parity, quantized
drafters, and a clear error for each kind of bad input."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import LAYOUTS, make_target, synthetic_checkpoint

from dflash2_mlx import generate, load_drafter
from dflash2_mlx.assets import default_drafter
from dflash2_mlx.convert import convert, export
from dflash2_mlx.formats.quantize import DraftQuant
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.prompts import load_suite
from dflash2_mlx.reference import draft_logits, load_checkpoint


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", layers=6, seed=8)


def hf_tensors(folder) -> dict[str, mx.array]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shards, prefix", [(1, ""), (3, "model.")])
def test_convert_load_generate_export(tmp_path, target, tokenizer, layout, shards, prefix):
    src = synthetic_checkpoint(tmp_path / "hf", layout, shards=shards, prefix=prefix)
    mlx_dir = convert(str(src), tmp_path / "mlx")
    record = json.loads((mlx_dir / "config.json").read_text())["mlx"]
    assert record["dtype"] == "bfloat16" and "quantization" not in record
    drafter = load_drafter(str(mlx_dir))
    plain = generate(target, tokenizer, [3, 4, 5, 6], None, verify_mode="off", max_tokens=16, eos_token_ids=[])
    spec = generate(target, tokenizer, [3, 4, 5, 6], drafter, block_size=6, max_tokens=16, eos_token_ids=[])
    assert spec.tokens == plain.tokens
    out = export(str(mlx_dir), tmp_path / "back")
    original, back = hf_tensors(src), hf_tensors(out)
    assert sorted(back) == sorted(k.removeprefix(prefix) for k in original)  # same names (prefix dropped)
    for name, value in original.items():
        exported = back[name.removeprefix(prefix)]
        assert exported.dtype == value.dtype and mx.array_equal(exported, value).item(), name  # bit-exact
    assert load_drafter(str(out)).config == load_drafter(str(src)).config


@pytest.mark.parametrize("layout", ["v1", "dflash2"])
@pytest.mark.parametrize("dtype, atol", [("float32", 2e-4), pytest.param("bfloat16", 0.15, marks=pytest.mark.slow)])
def test_logits_match_the_numpy_reference(tmp_path, target, layout, dtype, atol):
    """The MLX drafter and the independent NumPy forward (the CUDA side's stand-in) agree."""
    src = synthetic_checkpoint(tmp_path / "hf", layout)
    cfg, tensors = load_checkpoint(src)
    drafter = load_drafter(str(src), dtype=dtype)
    bind_drafter(drafter, target)
    embed = np.array(target.model.embed_tokens.weight, np.float64)
    context = np.random.default_rng(0).normal(size=(11, 5 * 64))
    block = [17] + [250] * 7
    want = draft_logits(cfg, tensors, embed, embed, block, context)
    got = drafter(mx.array([block]), mx.array(context[None], dtype=mx.float32), drafter.make_cache())[0]
    got = np.array(got.astype(mx.float32))
    err = np.abs(got - want)
    rel = err.max() / np.abs(want).max()
    print(f"{layout} {dtype}: max abs {err.max():.2e}, max rel {rel:.2e}")
    assert err.max() < atol
    # and the drafts a greedy pass proposes agree wherever the reference's choice is clear
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 4 * atol
    assert (got.argmax(-1)[clear] == want.argmax(-1)[clear]).all()


@pytest.fixture(scope="module")
def smollm2_chat(smollm2):
    """A held-out chat prompt for the default target, and plain decoding's 32 tokens after it."""
    model, tokenizer = smollm2
    text = load_suite("chat", 2)[1]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return prompt, generate(model, tokenizer, prompt, None, verify_mode="off", max_tokens=32).tokens


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafters_stay_lossless(smollm2, smollm2_chat, bits):
    """The bundled DFlash 2 drafter quantized at load (oMLX's --draft-quant path) still accepts drafts on
    its target (a random drafter accepts ~nothing), and its output is plain decoding's."""
    model, tokenizer = smollm2
    prompt, plain = smollm2_chat
    drafter = load_drafter(str(default_drafter("dflash2")), quant=DraftQuant(bits, 32, 64))
    assert isinstance(drafter.layers[0].mlp.up_proj, nn.QuantizedLinear)
    bind_drafter(drafter, model)
    r = generate(model, tokenizer, prompt, drafter, verify_mode="dflash", block_size=8, max_tokens=32)
    assert r.tokens == plain
    print(f"w{bits}: tau {r.tau:.3f} over {r.cycles} cycles")
    assert sum(r.accepted) > 0, r.accepted


def test_quantization_error_shrinks_with_bits(tmp_path):
    from dflash2_mlx.formats.quantize import quantize_drafter

    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    block, ctx = mx.array([[5] + [250] * 7]), mx.random.normal((1, 9, 320), key=mx.random.key(1))
    target = make_target("qwen3", layers=6)
    full = load_drafter(str(src))
    bind_drafter(full, target)
    reference = np.array(full(block, ctx, full.make_cache()))
    errors = {}
    for bits in (4, 8):
        q = load_drafter(str(src))
        quantize_drafter(q, DraftQuant(bits, 32, 32), min_size=0)
        bind_drafter(q, target)
        out = np.array(q(block, ctx, q.make_cache()))
        errors[bits] = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    print(f"relative logit error: w4 {errors[4]:.4f}, w8 {errors[8]:.4f}")
    assert errors[8] < errors[4] / 4 and errors[8] < 0.1


def test_quantized_convert_round_trip(tmp_path, target, tokenizer):
    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    with pytest.raises(ValueError, match="no tensor of this drafter is large enough"):
        convert(str(src), tmp_path / "q8", quant=DraftQuant(8, 32, 32))  # all below the default size
    mlx_dir = convert(str(src), tmp_path / "q8", quant=DraftQuant(8, 32, 32), min_quantized_size=0)
    config = json.loads((mlx_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8} and config["mlx"]["quantization"] == "w8a32:gs32"
    drafter = load_drafter(str(mlx_dir))
    assert type(drafter.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert drafter.norm.weight.dtype == mx.float32  # a32
    plain = generate(target, tokenizer, [2, 3], None, verify_mode="off", max_tokens=12, eos_token_ids=[])
    assert generate(target, tokenizer, [2, 3], drafter, max_tokens=12, eos_token_ids=[]).tokens == plain.tokens
    out = export(str(mlx_dir), tmp_path / "back")
    config = json.loads((out / "config.json").read_text())
    assert "dequantized from a w8a32:gs32" in config["dflash2_mlx_note"] and "quantization" not in config
    back, original = hf_tensors(out), hf_tensors(src)
    assert sorted(back) == sorted(original)
    w, w0 = back["layers.0.mlp.up_proj.weight"], original["layers.0.mlp.up_proj.weight"]
    assert w.dtype == mx.bfloat16 and mx.abs(w.astype(mx.float32) - w0.astype(mx.float32)).max().item() < 0.01


# -- bad input: one clear error per case ---------------------------------------------------------------------


def edit_weights(folder, fn):
    path = folder / "model.safetensors"
    weights = dict(mx.load(str(path)))
    fn(weights)
    mx.save_safetensors(str(path), weights)


def test_missing_tensor(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    edit_weights(src, lambda w: w.pop("layers.2.mlp_conv.base_kernel"))
    with pytest.raises(ValueError, match=r"missing \['layers.2.mlp_conv.base_kernel'\]"):
        load_drafter(str(src))


def test_extra_tensor(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    edit_weights(src, lambda w: w.update({"lm_head.weight": mx.zeros((256, 64))}))
    with pytest.raises(ValueError, match=r"unexpected \['lm_head.weight'\]"):
        load_drafter(str(src))


def test_shape_mismatch(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    edit_weights(src, lambda w: w.update({"fc.weight": mx.zeros((64, 256))}))
    with pytest.raises(ValueError, match=r"fc.weight \(64, 256\) \(config: \(64, 320\)\)"):
        load_drafter(str(src))


def test_unknown_architecture(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["Eagle3DraftModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown drafter architecture 'Eagle3DraftModel'"):
        load_drafter(str(src))


def test_truncated_safetensors(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="truncated or not safetensors"):
        load_drafter(str(src))


def test_missing_shard(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1", shards=2)
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names shard files that are not there"):
        load_drafter(str(src))


def test_vocabulary_mismatch(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    with pytest.raises(ValueError, match=r"vocabulary \(256\) differs from the target's \(128\)"):
        bind_drafter(load_drafter(str(src)), make_target("qwen3", vocab=128, layers=6))


def test_hidden_size_mismatch(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    target = make_target("qwen3", layers=6)
    bind_drafter(load_drafter(str(src)), target)  # the same drafter fits a target of its width
    target.model.embed_tokens.weight = mx.zeros((256, 32))  # a target of another width
    with pytest.raises(ValueError, match="hidden size 64 does not match the target's 32"):
        bind_drafter(load_drafter(str(src)), target)


def test_layer_ids_beyond_the_target(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    with pytest.raises(ValueError, match=r"reads target layers \[5\].*only 4 layers"):
        bind_drafter(load_drafter(str(src)), make_target("qwen3"))


def test_mask_token_outside_the_embedding(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 4000
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id 4000 is outside the target's embedding table"):
        bind_drafter(load_drafter(str(src)), make_target("qwen3", layers=6))


def test_float16_conversion_refused(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    with pytest.raises(ValueError, match="float16 drafters overflow to NaN"):
        convert(str(src), tmp_path / "fp16", dtype="float16")
    out = convert(str(src), tmp_path / "fp16", dtype="float16", force_float16=True)
    assert json.loads((out / "config.json").read_text())["mlx"]["dtype"] == "float16"


def test_output_folder_is_not_the_input(tmp_path):
    src = synthetic_checkpoint(tmp_path / "hf", "v1")
    with pytest.raises(ValueError, match="is the input folder"):
        convert(str(src), src)


def test_load_checks_the_drafter_against_its_target(tmp_path, tiny_pair):
    from dflash2_mlx import load

    target_dir, _ = tiny_pair
    src = synthetic_checkpoint(tmp_path / "hf", "v1")  # made for a 6-layer target; tiny_pair has 4
    with pytest.raises(ValueError, match=r"reads target layers \[5\]"):
        load(str(target_dir), str(src))
    shutil.rmtree(src)
