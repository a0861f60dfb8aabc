"""What a measurement ran on: every reported number carries it."""

from __future__ import annotations

import platform
import sys

import mlx.core as mx

from .kernel_check import enabled
from .kernels import backend_name


def blas() -> str:
    """The BLAS serving MLX's CPU matmuls (on Linux: preloaded OpenBLAS or the wheel's own)."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open("/proc/self/maps") as maps:
            return "openblas" if "libopenblas" in maps.read() else "mlx-bundled reference BLAS"
    except OSError:
        return "unknown"


def runtime_info(kernels: str = "auto") -> dict:
    """The machine, MLX and BLAS, and what the `kernels` setting runs the DFlash 2 hot ops on here."""
    return {
        "mlx": mx.__version__,
        "backend": "metal" if mx.metal.is_available() else "cpu",
        "blas": blas(),
        "kernels": backend_name(enabled(kernels)),
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
    }
