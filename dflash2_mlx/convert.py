"""One conversion path between the drafter checkpoints the CUDA engines use (Hugging Face / PyTorch
layout: DFlash v1, DFlash 2, Muse-style v1) and this package's MLX folders.

Hugging Face side: config.json in the drafter's own layout, one or more safetensors files (with or without
`model.safetensors.index.json`), names with or without a `model.` prefix, Muse's `encoder.fc` /
`encoder.output_norm_enc`, DFlash 2 codebooks stored without `.weight`.
MLX side: the same config.json plus an `mlx` record of what was done (dtype, quantization in mlx-lm's
format), tensors under this package's module names (quantized ones as weight/scales/biases triples).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .formats.quantize import MIN_QUANTIZED_SIZE, DraftQuant, quantize_drafter
from .formats.vocab import COUNTS_FILE, write_draft_vocab
from .formats.weights import INDEX, hf_names, write_weights
from .loading import load_drafter, resolve_path


def _fresh_folder(path: Path, source: Path) -> None:
    if path.resolve() == source.resolve():
        raise ValueError(f"the output folder {path} is the input folder; choose another")
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("*.safetensors"), path / INDEX, path / COUNTS_FILE]:
        old.unlink(missing_ok=True)


def convert(
    hf_path: str,
    mlx_path: str | Path,
    dtype: str = "bfloat16",
    quant: DraftQuant | None = None,
    force_float16: bool = False,
    min_quantized_size: int = MIN_QUANTIZED_SIZE,
    draft_vocab: int | None = None,
    vocab_counts: str | Path | None = None,
) -> Path:
    """A Hugging Face drafter (folder or hub id) -> an MLX folder that `load_drafter` reads. With
    `quant`, tensors of at least `min_quantized_size` values are quantized; with `draft_vocab` N, the N most
    frequent tokens of `vocab_counts` become its draft vocabulary (see `load_drafter`)."""
    if dtype == "float16" and not force_float16:
        raise ValueError(
            "float16 drafters overflow to NaN (DFlash 2 logits); convert to bfloat16 or float32, "
            "or pass --force-float16 if you know this drafter is safe"
        )
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype must be bfloat16, float32 or float16, got {dtype!r}")
    source = resolve_path(hf_path, allow_patterns=["*.json", "*.safetensors", "*.npy"])
    # checks names and shapes against the config
    drafter = load_drafter(str(source), dtype="float32", draft_vocab=draft_vocab, vocab_counts=vocab_counts)
    drafter.set_dtype(getattr(mx, dtype))
    record = {"dtype": dtype, "converted_from": str(hf_path)}
    if quant is not None:
        if quantize_drafter(drafter, quant, min_quantized_size) == 0:
            raise ValueError(
                f"no tensor of this drafter is large enough to quantize ({quant}); convert it unquantized"
            )
        record["quantization"] = str(quant)
    out = Path(mlx_path)
    _fresh_folder(out, source)
    config = json.loads((source / "config.json").read_text())
    config["mlx"] = record
    config.pop("quantization", None)
    if quant is not None:
        config["quantization"] = {"group_size": quant.group_size, "bits": quant.bits}  # mlx-lm's key
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(out, dict(tree_flatten(drafter.parameters())))
    _carry_vocab(drafter, source, out)
    return out


def _carry_vocab(drafter, source: Path, out: Path) -> None:
    """The draft vocabulary (and the frequency table it came from, if the source has one) go along."""
    if drafter.draft_vocab is not None:
        write_draft_vocab(out, drafter.draft_vocab)
    if (source / COUNTS_FILE).is_file():
        shutil.copy(source / COUNTS_FILE, out / COUNTS_FILE)


def dequantized(drafter: nn.Module) -> dict[str, mx.array]:
    """The drafter's tensors with every quantized weight expanded back to a dense matrix."""
    weights = dict(tree_flatten(drafter.parameters()))
    for path, module in drafter.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            prefix = f"{path}." if path else ""
            w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
            weights[f"{prefix}weight"] = w
            del weights[f"{prefix}scales"], weights[f"{prefix}biases"]
    return weights


def export(mlx_path: str, hf_path: str | Path, dtype: str = "bfloat16") -> Path:
    """An MLX folder -> the Hugging Face layout the CUDA engines load (bf16 by default). A quantized
    drafter is written dequantized, and its config says so."""
    source = resolve_path(mlx_path)
    drafter = load_drafter(str(source), dtype="float32")
    config = json.loads((source / "config.json").read_text())
    mlx_record = config.pop("mlx", {})
    config.pop("quantization", None)
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in dequantized(drafter).items()}
    if "quantization" in mlx_record:
        config["dflash2_mlx_note"] = (
            f"dequantized from a {mlx_record['quantization']} MLX drafter: the weights carry its "
            "quantization error"
        )
    config["dtype"] = dtype
    out = Path(hf_path)
    _fresh_folder(out, source)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(out, hf_names(weights, drafter.config))
    _carry_vocab(drafter, source, out)
    for extra in ("README.md", "LICENSE"):
        if (source / extra).is_file():
            shutil.copy(source / extra, out / extra)
    return out
