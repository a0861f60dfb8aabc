"""Drafter quantization in mlx-lm's format, named the way oMLX names it: `w{bits}a{act}:gs{group}`.

Weights of the large linear maps (and selector codebooks) are quantized; norms, the conv base kernels and
any tensor too small to benefit stay in full precision. The activation bits choose the compute dtype:
a16 = bfloat16, a32 = float32 (4-bit drafters lose most of their acceptance with 16-bit activations on
some Macs; 32-bit activations restore it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

_SPEC = re.compile(r"^w(?P<bits>\d+)(?:a(?P<act>\d+))?(?::gs(?P<group>\d+))?$")
MIN_QUANTIZED_SIZE = 1 << 16  # smaller tensors gain nothing from quantization


@dataclass(frozen=True)
class DraftQuant:
    bits: int = 4
    activation_bits: int = 16
    group_size: int = 64

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"draft quantization: {self.bits}-bit weights are not supported (2, 3, 4, 5, 6 or 8)")
        if self.activation_bits not in (16, 32):
            raise ValueError(f"draft quantization: activation bits must be 16 or 32, got {self.activation_bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"draft quantization: group size must be 32, 64 or 128, got {self.group_size}")

    @classmethod
    def parse(cls, spec: str) -> DraftQuant:
        """`w4a16:gs64`, `w8a32:gs32`, `w4` (a16, gs64 by default)."""
        m = _SPEC.match(spec.strip().lower())
        if m is None:
            raise ValueError(
                f"bad draft quantization spec {spec!r}: expected w{{bits}}a{{act}}:gs{{group}}, e.g. w4a16:gs64"
            )
        return cls(int(m["bits"]), int(m["act"] or 16), int(m["group"] or 64))

    @property
    def compute_dtype(self) -> mx.Dtype:
        return mx.float32 if self.activation_bits == 32 else mx.bfloat16

    def __str__(self) -> str:
        return f"w{self.bits}a{self.activation_bits}:gs{self.group_size}"


def quantize_drafter(drafter: nn.Module, quant: DraftQuant, min_size: int = MIN_QUANTIZED_SIZE) -> int:
    """Quantize `drafter` in place; returns how many tensors were quantized."""
    drafter.set_dtype(quant.compute_dtype)
    count = 0

    def eligible(_, module) -> bool:
        nonlocal count
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return False
        w = module.weight
        ok = w.shape[-1] % quant.group_size == 0 and w.size >= min_size
        count += ok
        return ok

    nn.quantize(drafter, group_size=quant.group_size, bits=quant.bits, class_predicate=eligible)
    mx.eval(drafter.parameters())
    return count
