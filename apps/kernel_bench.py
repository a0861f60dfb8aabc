"""Microbenchmark: each fused Metal kernel against its pure-MLX op, milliseconds per call at the sizes of
real DFlash 2 drafters (hidden 2560 / 5120, blocks of 5, 8 and 16, top-16 rank-256 selector, a 152k
vocabulary), with a check that both give the same result. On a Mac:

    python -m dflash2_apps.kernel_bench

Without Metal it times the pure-MLX ops only, and says so.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import mlx.core as mx
from rich.table import Table

from dflash2_apps.bench_report import report_console
from dflash2_mlx.machine import runtime_info
from dflash2_mlx.sampling import accept_greedy
from dflash2_mlx.selector import LatticeInputs, scored_path
from dflash2_mlx.short_conv import dynamic_conv

HIDDEN_SIZES = (2560, 5120)
BLOCK_SIZES = (5, 8, 16)
CONV_TAPS, CONV_GROUP = 2, 16
TOP_K, RANK = 16, 256
VOCAB = 151936


def cases(dtype):
    """(op, size, call) for every op and size; call(metal) runs the op as pure MLX or as its Metal kernel."""
    normal = mx.random.normal
    for D in HIDDEN_SIZES:
        for L in BLOCK_SIZES:
            x, base = normal((1, L, D)).astype(dtype), normal((CONV_TAPS, D)).astype(dtype)
            dyn = normal((1, L, CONV_TAPS, D // CONV_GROUP)).astype(dtype)
            yield "dynamic conv", f"D={D} L={L}", partial(dynamic_conv, x, base, dyn)
    for B in BLOCK_SIZES:
        T = B - 1
        lattice = LatticeInputs(
            mx.zeros((T, TOP_K), mx.uint32),
            normal((T, TOP_K)),
            normal((T, TOP_K, RANK)),
            normal((T, RANK)),
            normal((T, TOP_K, RANK)),
        )
        for walk in ("greedy", "viterbi"):
            yield f"selector, {walk} walk", f"T={T} k={TOP_K} R={RANK}", partial(scored_path, lattice, walk)
        logits = normal((B, VOCAB)).astype(dtype)
        drafts = mx.argmax(logits[:-1], axis=-1)
        drafts[T // 2] = (drafts[T // 2] + 1) % VOCAB  # half the drafts accepted
        yield "greedy acceptance", f"B={B} V={VOCAB}", partial(accept_greedy, drafts, logits)


def ms_per_call(call, iterations: int) -> tuple[float, list[mx.array]]:
    """Many calls in one evaluation (one command buffer), so launch latency counts and sync latency not."""
    result = call()
    mx.eval(result)  # warm-up: builds the kernel
    tic = time.perf_counter()
    mx.eval([call() for _ in range(iterations)])
    return (time.perf_counter() - tic) * 1000 / iterations, list(result) if isinstance(result, tuple) else [result]


def agree(a: list[mx.array], b: list[mx.array]) -> str:
    worst = max(float(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)))) for x, y in zip(a, b))
    return "exact" if worst == 0 else f"max diff {worst:.2g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash2_apps.kernel_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="dtype of the conv inputs and the verify logits (the selector is float32)",
    )
    args = parser.parse_args(argv)
    console = report_console()
    info = runtime_info()
    metal = mx.metal.is_available()
    console.print(
        f"[bold]dflash2 kernel bench[/] MLX {info['mlx']}, {info['backend']} ({info['machine']}), "
        f"{args.dtype}, {args.iterations} calls per op"
    )
    if not metal:
        console.print(
            "Metal is not available here (mx.metal.is_available() is False): timing the pure-MLX ops "
            "only. Run this on a Mac for the kernel column."
        )
    table = Table("op", "size", "pure-MLX ms", "Metal ms", "speedup", "same result")
    for op, size, call in cases(getattr(mx, args.dtype)):
        pure_ms, pure = ms_per_call(partial(call, metal=False), args.iterations)
        if metal:
            metal_ms, fused = ms_per_call(partial(call, metal=True), args.iterations)
            table.add_row(
                op, size, f"{pure_ms:.3f}", f"{metal_ms:.3f}", f"{pure_ms / metal_ms:.2f}x", agree(pure, fused)
            )
        else:
            table.add_row(op, size, f"{pure_ms:.3f}", "-", "-", "-")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
