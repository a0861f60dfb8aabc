"""Where a drafter's parameters are, per component (as the DFlash 2 write-up reports them), read from
the safetensors headers alone: no tensor is loaded, so it is instant even for multi-GB drafters. And the
Metal kernels' self-check on this machine (`dflash2 info --self-check`, for bug reports)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx

from . import kernel_check
from .formats.config import DraftConfig
from .formats.weights import safetensors_files
from .loading import resolve_path
from .machine import runtime_info

COMPONENTS = ("attention", "mlp", "norms", "fc", "conv", "selector")


def safetensors_header(path: str | Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file (bad header: {e})") from e
    header.pop("__metadata__", None)
    return header


def component(name: str) -> str:
    """The component a (Hugging Face) drafter tensor name belongs to."""
    if name.startswith("candidate_selector."):
        return "selector"
    if "_conv." in name:
        return "conv"
    if ".self_attn." in name and not name.endswith("_norm.weight"):
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if name.startswith(("fc.", "encoder.fc.")):
        return "fc"
    return "norms"


def parameter_counts(shapes: dict[str, list[int]], bits: int | None = None) -> dict[str, int]:
    """Parameters per component; with `bits`, quantized weights (packed in uint32, with scales and
    biases beside them) count as the dense matrices they stand for: MLX packs each row's values
    end to end, so a row of n uint32 words holds n * 32 / bits of them (3-, 5- and 6-bit values straddle
    words)."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, shape in shapes.items():
        base, _, suffix = name.rpartition(".")
        quantized = bits is not None and f"{base}.scales" in shapes
        if quantized and suffix in ("scales", "biases"):
            continue
        size = math.prod(shape[:-1]) * (shape[-1] * 32 // bits) if quantized else math.prod(shape)
        counts[component(name.removeprefix("model."))] += size
    counts = {k: v for k, v in counts.items() if v}
    counts["total"] = sum(counts.values())
    return counts


def drafter_info(path_or_repo: str) -> dict:
    path = resolve_path(path_or_repo, allow_patterns=["*.json", "*.safetensors"])
    config = DraftConfig.from_path(path)
    header = {}
    for f in safetensors_files(path):
        header.update(safetensors_header(f))
    raw = json.loads((path / "config.json").read_text())
    cfg = asdict(config)
    cfg.pop("extra")
    cfg["dtype"] = sorted({t["dtype"] for t in header.values()})
    cfg["quantization"] = raw.get("mlx", {}).get("quantization")
    bits = (raw.get("quantization") or {}).get("bits")
    return {
        "path": str(path),
        "config": cfg,
        "parameters": parameter_counts({k: v["shape"] for k, v in header.items()}, bits),
    }


def self_check_info() -> dict:
    """The Metal kernels' self-check here (`kernel_check`): the machine, and per kernel and dtype whether it
    passed and why not; without Metal, no checks and the pure-MLX path."""
    available = mx.metal.is_available()
    checked = kernel_check.results() if available else ()
    return {
        "metal_available": available,
        "device": mx.device_info().get("device_name", "unknown"),
        "runtime": runtime_info("auto"),  # its "kernels": what --kernels auto runs after the check
        "checks": [r._asdict() for r in checked],
    }


def format_self_check(record: dict) -> str:
    """`self_check_info` as plain text (what a bug report quotes)."""
    rt = record["runtime"]
    lines = [f"Metal kernels self-check: {record['device']}, {rt['machine']}, mlx {rt['mlx']}, python {rt['python']}"]
    if not record["metal_available"]:
        lines.append(
            "Metal is not available here (mx.metal.is_available() is False): nothing to check; "
            "--kernels auto runs the pure-MLX ops, --kernels metal is refused."
        )
        return "\n".join(lines)
    width = max(len(c["kernel"]) for c in record["checks"])
    for c in record["checks"]:
        detail = c["reason"] or ("max |diff| " + (f"{c['max_diff']:.3g}" if c["max_diff"] is not None else "-"))
        lines.append(f"  {c['kernel']:<{width}}  {c['dtype']:<8}  {'passed' if c['ok'] else 'FAILED'}  {detail}")
    lines.append(f"--kernels auto runs: {rt['kernels']}")
    if not all(c["ok"] for c in record["checks"]):
        lines.append(
            "failed kernels are switched off (their pure-MLX ops run, same results); --kernels mlx turns "
            "every kernel off"
        )
    return "\n".join(lines)
