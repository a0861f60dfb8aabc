"""OpenBLAS for MLX's CPU backend on Linux: MLX's wheel bundles the reference BLAS, which runs float32
matmuls ~50x slower, and a BLAS can only be swapped in at process start. Kept free of heavy imports: it
runs before anything else in the CLI and in the test suite."""

from __future__ import annotations

import os
import sys


def openblas_library() -> str | None:
    for lib in ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"):
        if os.path.exists(lib):
            return lib
    from ctypes.util import find_library

    return find_library("openblas")


def restart_with_openblas(argv: list[str], before_exec=None) -> None:
    """When OpenBLAS is installed but not loaded, replace this process with `python argv...` with it
    preloaded (DFLASH2_NO_OPENBLAS=1 turns this off). `before_exec` runs just before the exec."""
    if sys.platform != "linux" or os.environ.get("DFLASH2_NO_OPENBLAS"):
        return
    lib = openblas_library()
    preload = os.environ.get("LD_PRELOAD", "")
    if lib is None or "openblas" in preload:
        return
    if before_exec is not None:
        before_exec()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], dict(os.environ, LD_PRELOAD=f"{lib} {preload}".strip()))
