"""oMLX's runtime settings: draft quantization specs, the drafter's dtype guard, model_settings.json."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import make_dflash2_drafter, make_drafter, make_target, save_drafter

from dflash2_mlx import generate, load_drafter
from dflash2_mlx.formats.quantize import DraftQuant, quantize_drafter
from dflash2_mlx.loading import bind_drafter, drafter_dtype
from dflash2_mlx.omlx_settings import from_omlx


@pytest.mark.parametrize(
    "spec, expected",
    [("w4a16:gs64", (4, 16, 64)), ("w8a32:gs32", (8, 32, 32)), ("W2A16:GS128", (2, 16, 128)), ("w4", (4, 16, 64))],
)
def test_quant_spec(spec, expected):
    q = DraftQuant.parse(spec)
    assert (q.bits, q.activation_bits, q.group_size) == expected
    assert DraftQuant.parse(str(q)) == q


@pytest.mark.parametrize("spec", ["4bit", "w4a8:gs64", "w7a16", "w4a16:gs48", "w4a16 gs64"])
def test_bad_quant_specs(spec):
    with pytest.raises(ValueError, match="draft quantization"):
        DraftQuant.parse(spec)


@pytest.mark.parametrize("spec", ["w4a16:gs32", "w8a32:gs64"])
def test_quantized_dflash2_drafter_stays_lossless(spec, tokenizer):
    model = make_target("qwen3", seed=6)
    drafter = make_dflash2_drafter(model, block_size=8)
    quant = DraftQuant.parse(spec)
    n = quantize_drafter(drafter, quant, min_size=0)
    layer = drafter.layers[0]
    assert isinstance(layer.mlp.up_proj, nn.QuantizedLinear) and layer.mlp.up_proj.bits == quant.bits
    assert isinstance(drafter.fc, nn.QuantizedLinear)
    assert isinstance(layer.attention_conv.base_kernel, mx.array)  # conv base kernels stay full precision
    assert layer.input_layernorm.weight.dtype == quant.compute_dtype and n >= 8
    bind_drafter(drafter, model)
    plain = generate(model, tokenizer, [9, 9, 4], None, verify_mode="off", max_tokens=16, eos_token_ids=[])
    spec_run = generate(model, tokenizer, [9, 9, 4], drafter, max_tokens=16, eos_token_ids=[])
    assert spec_run.tokens == plain.tokens


def test_small_tensors_stay_full_precision():
    drafter = make_drafter(make_target("qwen3"))
    assert quantize_drafter(drafter, DraftQuant(4, 16, 64)) == 0  # every tensor here is < 65536 values


def test_float16_is_refused_or_upcast(tmp_path):
    with pytest.raises(ValueError, match="float16 drafters are refused"):
        drafter_dtype(mx.bfloat16, "float16")
    assert drafter_dtype(mx.bfloat16, "bfloat16") == mx.bfloat16
    model = make_target("qwen3")
    drafter = make_drafter(model)
    drafter.set_dtype(mx.float16)
    folder = save_drafter(tmp_path / "fp16", drafter)
    loaded = load_drafter(str(folder))
    assert loaded.norm.weight.dtype != mx.float16
    with pytest.raises(ValueError, match="float16 drafters are refused"):
        load_drafter(str(folder), dtype="float16")


def omlx_file(tmp_path, **entry):
    path = tmp_path / "model_settings.json"
    path.write_text(json.dumps({"version": 1, "models": {"my/model": entry}}))
    return path


def test_omlx_recipe(tmp_path):
    """oMLX's published DFlash 2 recipe."""
    path = omlx_file(
        tmp_path,
        dflash_enabled=True,
        dflash_draft_model="incoai/Qwen3.8-27B-DFlash2",
        dflash_draft_quant_enabled=True,
        dflash_draft_quant_weight_bits=4,
        dflash_draft_quant_activation_bits=32,
        dflash_draft_quant_group_size=64,
        dflash_block_size=5,
        dflash_verify_mode="dflash",
        dflash_max_ctx=8192,
        dflash_draft_window_size=1024,
    )
    s = from_omlx(path, "my/model")
    assert (s.verify_mode, s.draft_model, s.block_size, s.max_context) == (
        "dflash",
        "incoai/Qwen3.8-27B-DFlash2",
        5,
        8192,
    )
    assert str(s.draft_quant) == "w4a32:gs64"
    assert s.notes == ["dflash_draft_window_size is not supported and was ignored"]


def test_omlx_defaults_and_errors(tmp_path):
    s = from_omlx(omlx_file(tmp_path, dflash_enabled=True, dflash_block_size=""), "my/model")
    assert s.verify_mode == "adaptive" and s.block_size is None and s.notes == []  # oMLX's default mode
    assert from_omlx(omlx_file(tmp_path, dflash_enabled=False), "my/model").verify_mode == "off"
    assert (
        from_omlx(omlx_file(tmp_path, dflash_enabled=True, dflash_verify_mode="ddtree"), "my/model").verify_mode
        == "ddtree"
    )
    with pytest.raises(ValueError, match="'tree' is not supported"):
        from_omlx(omlx_file(tmp_path, dflash_enabled=True, dflash_verify_mode="tree"), "my/model")
    with pytest.raises(ValueError, match="no entry for 'other/model'"):
        from_omlx(omlx_file(tmp_path), "other/model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_omlx(tmp_path / "nope.json", "my/model")


def test_max_context_falls_back_and_says_so(tokenizer):
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    r = generate(model, tokenizer, list(range(10, 30)), drafter, max_context=16, max_tokens=8, eos_token_ids=[])
    assert r.verify_mode == "off" and r.cycles == 0
    r = generate(model, tokenizer, list(range(10, 20)), drafter, max_context=16, max_tokens=8, eos_token_ids=[])
    assert r.verify_mode == "adaptive" and r.cycles + r.shadow_probes > 0  # the speculative loop ran


@pytest.mark.parametrize("mode", ["auto", "conservative", "aggressive", "off"])
def test_omlx_copyspec_mode(tmp_path, mode):
    """dflash-mlx's `copyspec_mode` values are read as `--copyspec-mode`; unset it is the default; others are
    refused."""
    assert from_omlx(omlx_file(tmp_path, dflash_enabled=True, copyspec_mode=mode), "my/model").copyspec_mode == mode
    assert from_omlx(omlx_file(tmp_path, dflash_enabled=True), "my/model").copyspec_mode is None
    with pytest.raises(ValueError, match="copyspec_mode 'always' of 'my/model' is not one of"):
        from_omlx(omlx_file(tmp_path, dflash_enabled=True, copyspec_mode="always"), "my/model")
