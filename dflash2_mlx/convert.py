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
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .formats import serving
from .formats.quantize import MIN_QUANTIZED_SIZE, DraftQuant, quantize_drafter
from .formats.vocab import COUNTS_FILE, write_draft_vocab
from .formats.weights import INDEX, hf_names, write_weights
from .loading import bind_drafter, load_drafter, load_target, resolve_path

logger = logging.getLogger(__name__)


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
            raise ValueError(f"no tensor of this drafter is large enough to quantize ({quant}); convert it unquantized")
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
            f"dequantized from a {mlx_record['quantization']} MLX drafter: the weights carry its quantization error"
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


def export_for(mlx_path: str, hf_path: str | Path, engine: str, target=None) -> Path:
    """A drafter folder -> the folder `engine` ("sglang" or "vllm") serves as a DFlash / DFlash 2 drafter
    (layout: `formats/serving.py`): its architecture names and `dflash_config` fields, bfloat16, the whole
    vocabulary (a draft vocabulary is dropped: the engine drafts from every token), a factorised selector
    expanded into the V x R tables the engines load, no embedding or LM head. What the engine would run
    differently is refused with the reason and the way out.

    `target` (an mlx-lm model or a path / hub id) is what the drafter is bound to: needed to expand a
    factorised selector, and where the drafter's config leaves its vocabulary, embedding scale or logit
    settings to the target's."""
    serving.engine(engine)
    source = resolve_path(mlx_path)
    drafter = load_drafter(str(source), dtype="float32")
    config, raw = drafter.config, json.loads((source / "config.json").read_text())
    notes = []
    if drafter.draft_vocab is not None:
        logger.warning(
            "the drafter's draft vocabulary (%d tokens) is dropped: %s drafts from every token",
            len(drafter.draft_vocab),
            serving.engine(engine).name,
        )
        notes.append(
            f"its draft vocabulary ({len(drafter.draft_vocab)} tokens) dropped: drafts come from the whole vocabulary"
        )
        drafter.draft_vocab = None
    bound = None
    if target is not None:
        if isinstance(target, (str, Path)):
            target = load_target(str(target), dtype="float32")[0]
        bound = bind_drafter(drafter, target)  # checks the pair (width, vocabulary, layers)
    resolved = _resolve(config, bound)
    serving.check_supported(engine, config, raw, resolved)
    weights = dequantized(drafter)
    if config.selector_factorized:
        if bound is None:
            raise ValueError(
                "this DFlash 2 drafter's selector is factorised (rank-R maps of the target's embeddings); the "
                "engines load V x R tables: pass the target with --model to expand them"
            )
        notes.append("its factorised selector expanded into vocabulary x rank tables over the target's embeddings")
        for side in ("predecessor", "successor"):
            projection = weights.pop(f"candidate_selector.{side}_projection.weight")
            weights[f"candidate_selector.{side}_codebook.weight"] = _expanded(projection, bound.embed_tokens)
    if config.is_dflash2 and not resolved.logits_known:
        logger.warning(
            "no target given: where the drafter leaves its logit multiplier or softcap to the target, the "
            "export assumes the target has none"
        )
    if "quantization" in raw.get("mlx", {}):
        notes.append(
            f"dequantized from a {raw['mlx']['quantization']} MLX drafter: the weights carry its quantization error"
        )
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    names = hf_names(weights, replace(config, architecture=serving.ARCHITECTURES[serving.kind(config)]))
    cfg = serving.serving_config(engine, config, resolved, note="; ".join(notes) or None)
    out = Path(hf_path)
    _fresh_folder(out, source)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_weights(out, names, fmt="pt")
    if (source / "LICENSE").is_file():
        shutil.copy(source / "LICENSE", out / "LICENSE")
    if (source / "README.md").is_file():  # what the card says, and what changed on the way
        changes = "".join(f"\n- {note}" for note in notes)
        (out / "README.md").write_text(
            (source / "README.md").read_text().rstrip("\n") + "\n\n## Exported for "
            f"{serving.engine(engine).name}\n\n- by `dflash2 export --for {engine}`: "
            f"bfloat16, the engine's names and config fields{changes}\n"
        )
    problems = serving.check_folder(engine, out)
    if problems:  # a bug here, never the user's input
        raise RuntimeError(f"the {engine} export in {out} breaks the engine's layout: {problems[:4]}")
    return out


def _resolve(config, bound) -> serving.Resolved:
    """The drafter's vocabulary, embedding scale and logit settings as it runs on its target (the config's
    own where it sets them, else the target's; without a target, what the config says)."""
    if bound is None:
        return serving.Resolved(
            config.vocab_size,
            config.num_target_layers,
            config.input_embedding_scale,
            config.output_multiplier,
            config.final_logit_softcapping,
            logits_known=None not in (config.output_multiplier, config.final_logit_softcapping),
        )
    multiplier = config.output_multiplier if config.output_multiplier is not None else bound.logit_multiplier
    softcap = config.final_logit_softcapping if config.final_logit_softcapping is not None else bound.logit_softcap
    return serving.Resolved(
        bound.vocab_size,
        config.num_target_layers or bound.num_layers,
        config.input_embedding_scale * bound.embed_scale,
        float(multiplier),
        softcap or None,
        logits_known=True,
    )


def _expanded(projection: mx.array, embed, rows: int = 8192) -> mx.array:
    """A factorised selector's codes of every token, `embed(ids) @ projection.T` [V, R] (float32), the
    table the engines index by token id. In slices of `rows` tokens (a V x D copy of the embedding is never
    made)."""
    vocab = embed.num_embeddings if isinstance(embed, nn.QuantizedEmbedding) else embed.weight.shape[0]
    parts = []
    for start in range(0, vocab, rows):
        ids = mx.arange(start, min(start + rows, vocab))
        parts.append(embed(ids).astype(mx.float32) @ projection.astype(mx.float32).T)
        mx.eval(parts[-1])
    return mx.concatenate(parts)
