"""Drafter weights on disk: safetensors files (one, or shards with `model.safetensors.index.json`) in either
naming: Hugging Face / PyTorch (names with or without a `model.` prefix, Muse's `encoder.fc` /
`encoder.output_norm_enc`, DFlash 2 codebooks stored without `.weight`) or this package's module names."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import make_shards

from .config import DraftConfig
from .vocab import DRAFT_VOCAB_FILE

INDEX = "model.safetensors.index.json"
_READ_RENAMES = (("model.", ""), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_MUSE_NAMES = (("fc.", "encoder.fc."), ("hidden_norm.", "encoder.output_norm_enc."))
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
MAX_SHARD_GB = 5


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder: those its index names, else every *.safetensors."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index ({e})") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are not there: {missing}")
        return files
    files = [Path(f) for f in sorted(glob.glob(str(path / "*.safetensors"))) if Path(f).name != DRAFT_VOCAB_FILE]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in drafter folder {path}")
    return files


def read_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor of a drafter folder (either layout), under this package's module names."""
    weights = {}
    for f in safetensors_files(path):
        try:
            tensors = mx.load(str(f))
        except Exception as e:
            raise ValueError(f"could not read {f} ({e}): the file is truncated or not safetensors") from e
        for name, value in tensors.items():
            for old, new in _READ_RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
            weights[name + ".weight" if name in _CODEBOOKS else name] = value
    return weights


def hf_names(weights: dict[str, mx.array], config: DraftConfig) -> dict[str, mx.array]:
    """This package's names -> the Hugging Face layout of `config`'s architecture."""
    out = {}
    for name, value in weights.items():
        if name.removesuffix(".weight") in _CODEBOOKS:
            name = name.removesuffix(".weight")
        if config.architecture == "MuseGlimmerAssistantModel":
            for old, new in _MUSE_NAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
        out[name] = value
    return out


def write_weights(path: Path, weights: dict[str, mx.array], fmt: str = "mlx") -> None:
    """safetensors files of at most MAX_SHARD_GB each, with an index when there are several. `fmt` is the
    files' `format` metadata ("pt" for folders PyTorch engines load)."""
    shards = make_shards(weights, MAX_SHARD_GB)
    if len(shards) == 1:
        mx.save_safetensors(str(path / "model.safetensors"), shards[0], metadata={"format": fmt})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(path / name), shard, metadata={"format": fmt})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.nbytes for v in weights.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
