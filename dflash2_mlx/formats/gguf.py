"""GGUF targets (llama.cpp files) as mlx-lm models, without torch.

`mx.load` reads the tensors and metadata; Q4_0 / Q4_1 / Q8_0 tensors arrive as MLX quantized triples
(weight, scales, biases; group 32). Files with other quantizations (K-quants, Q5_0, ...) are read with
llama.cpp's own reader (`gguf` on PyPI) and dequantized. This module maps llama.cpp tensor names to mlx-lm's
(Hugging Face) names, undoes the Q/K row permutation llama.cpp applies to llama-architecture models, keeps the
quantized tensors quantized or dequantizes them, and rebuilds the tokenizer and chat template from the metadata.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
GROUP_SIZE = 32  # llama.cpp's block size for Q4_0 / Q4_1 / Q8_0

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer regexes, as llama.cpp names them in `tokenizer.ggml.pre` (the same ones the models'
# Hugging Face tokenizer.json files use).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _meta(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        value = value.item() if value.size == 1 else value.tolist()
    return value


# The tensor types MLX's own GGUF reader decodes right: it keeps Q4_0/Q4_1/Q8_0 as affine triples and
# reads floats as they are; every other type it converts to float16 through gguflib, whose Q4_K decoder is
# wrong (max abs error 1.9 on weights of magnitude 2 in Qwen2.5-Coder-1.5B's Q4_K_M file: the model
# babbles). Files with any other type are dequantized by llama.cpp's own reference code (gguf-py).
MLX_READS_RIGHT = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}


def read(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """(tensors, metadata). Q4_0/Q4_1/Q8_0 tensors come as MLX quantized triples when MLX reads every
    tensor of the file right (see MLX_READS_RIGHT); otherwise every tensor comes dequantized to float32."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise ValueError(f"could not read GGUF file {path} ({e}): the file is truncated or not a GGUF file") from e
    if {t.tensor_type.name for t in reader.tensors} <= MLX_READS_RIGHT:
        return mx.load(str(path), return_metadata=True)
    return _read_dequantized(reader)


def _read_dequantized(reader) -> tuple[dict[str, mx.array], dict]:
    from gguf.quants import dequantize

    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {t.name} is {t.tensor_type.name}, which gguf-py cannot dequantize; "
                "requantize the file to Q8_0, Q4_0 or a K-quant with llama.cpp"
            ) from e
        tensors[t.name] = mx.array(data.reshape(tuple(int(d) for d in reversed(t.shape))).astype("float32"))
    return tensors, meta


def model_config(meta: dict, tensors: dict[str, mx.array]) -> dict:
    """The mlx-lm (Hugging Face) config.json equivalent of the GGUF metadata."""
    arch = _meta(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key, default=None):
        return _meta(meta, f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": get("vocab_size", len(tokens) if tokens else None),
        "tie_word_embeddings": "output.weight" not in tensors,
        "head_dim": get("rope.dimension_count", hidden // heads),
    }
    missing = [k for k, v in config.items() if v is None]
    if missing:
        raise ValueError(f"GGUF metadata lacks the fields for {missing}")
    eos = _meta(meta, "tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = eos
    return config


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's RoPE row order for q/k: rows (h, 2, d/2) were stored as (h, d/2, 2). Rows are
    permuted whole, so packed quantized weights, scales and biases are unpermuted alike."""
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def mlx_weights(tensors: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """Tensors under mlx-lm names, q/k rows back in Hugging Face order."""
    out = {}
    for name, value in tensors.items():
        base, suffix = name.rsplit(".", 1)
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            new = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
            if config["model_type"] == "llama" and parts[2] in ("attn_q", "attn_k"):
                heads = config["num_attention_heads" if parts[2] == "attn_q" else "num_key_value_heads"]
                value = _unpermute_rows(value, heads)
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        elif base == "rope_freqs":
            continue  # llama 3 rope scaling factors, recomputed by mlx-lm from the config
        else:
            raise ValueError(f"unexpected tensor {name!r} in a {config['model_type']} GGUF file")
        out[f"{new}.{suffix}"] = value
    return out


def _bits(weights: dict[str, mx.array], base: str) -> int:
    return weights[f"{base}.weight"].shape[-1] // weights[f"{base}.scales"].shape[-1]


def build_model(weights: dict[str, mx.array], config: dict, dtype: str | None) -> nn.Module:
    """dtype None keeps Q4_0/Q4_1/Q8_0 tensors quantized (other tensors as stored); a float dtype
    dequantizes everything to it."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    if dtype is None:
        nn.quantize(
            model,
            class_predicate=lambda path, _: (
                {"group_size": GROUP_SIZE, "bits": _bits(weights, path)} if path in quantized else False
            ),
        )
    else:
        target = getattr(mx, dtype)
        for base in quantized:
            bits = _bits(weights, base)
            w, s, b = (weights.pop(f"{base}.{x}") for x in ("weight", "scales", "biases"))
            weights[f"{base}.weight"] = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits)
        weights = {k: v.astype(target) for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def build_tokenizer(meta: dict):
    """A Hugging Face fast tokenizer (byte-level BPE) with the file's special tokens and chat template,
    wrapped for mlx-lm's streaming detokenizer."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _meta(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = _meta(meta, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def split(pattern):
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    pre_tokenizer = {
        "default": [split(_GPT2), byte_level],
        "gpt2": [split(_GPT2), byte_level],
        "smollm": [pre_tokenizers.Digits(individual_digits=True), split(_GPT2), byte_level],
        "qwen2": [split(_QWEN2), byte_level],
        "llama-bpe": [split(_LLAMA3), byte_level],
    }.get(pre)
    if pre_tokenizer is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    bpe.pre_tokenizer = pre_tokenizers.Sequence(pre_tokenizer)
    bpe.decoder = decoders.ByteLevel()
    types = _meta(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]  # control and user-defined
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key):
        i = _meta(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
    )
    fast.chat_template = _meta(meta, "tokenizer.chat_template")
    if _meta(meta, "tokenizer.ggml.add_bos_token", False) and token("bos") is not None:
        bos = token("bos")
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    eos = _meta(meta, "tokenizer.ggml.eos_token_id")
    return TokenizerWrapper(
        fast, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=[eos] if eos is not None else None
    )


def load_gguf(path: str | Path, dtype: str | None = None):
    """(model, tokenizer) from a GGUF file; see `build_model` for dtype (a file read dequantized runs in
    bfloat16 when no dtype is given)."""
    tensors, meta = read(path)
    if dtype is None and not any(k.endswith(".scales") for k in tensors):
        dtype = "bfloat16"
    config = model_config(meta, tensors)
    model = build_model(mlx_weights(tensors, config), config, dtype)
    return model, build_tokenizer(meta)


def convert_gguf(path: str | Path, mlx_path: str | Path, dtype: str | None = None) -> Path:
    """A GGUF target -> an mlx-lm model folder (config, safetensors, tokenizer), once, so that later
    loads skip the GGUF decoding. dtype None keeps Q4_0/Q4_1/Q8_0 tensors quantized (mlx-lm's format)."""
    from mlx_lm.utils import save_config, save_model

    tensors, meta = read(path)
    config = model_config(meta, tensors)
    weights = mlx_weights(tensors, config)
    if dtype is None:
        layers = {
            k[: -len(".scales")]: {"group_size": GROUP_SIZE, "bits": _bits(weights, k[: -len(".scales")])}
            for k in weights
            if k.endswith(".scales")
        }
        if layers:
            config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4, **layers}
    model = build_model(weights, config, dtype)
    out = Path(mlx_path)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    build_tokenizer(meta)._tokenizer.save_pretrained(out)
    return out
