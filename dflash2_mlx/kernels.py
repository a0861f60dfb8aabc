"""Fused Metal kernels for the hot ops of the DFlash 2 cycle, and what a kernels setting means.

Each kernel has a pure-MLX twin where the op lives (`short_conv.dynamic_conv`, `selector.scored_path`,
`sampling.accept_greedy`); those call in here when told to (their `metal` argument). Which a drafter runs is
its own setting (`DFlashDraftModel.use_kernels`; `--kernels` on the command line); under 'auto' only the kernels
that pass `kernel_check`'s self-check on this machine. The kernel bodies are the
`.metal` files of the `dflash2_metal` package (the repository's `metal/`). Every launch is described by a
`Launch` before it runs, so the tests can hand the very same launch to the CPU emulator of
`tests/metal_emulation`.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import NamedTuple

import mlx.core as mx

BACKENDS = ("auto", "metal", "mlx")

# name -> (input names, output names, header file) of each kernel in metal/
SIGNATURES = {
    "dynamic_conv": (("x", "base", "dyn"), ("out",), None),
    "lattice_path": (("unary", "pred_rows", "h", "succ"), ("scores", "path"), "simd_argmax.h"),
    "accept_greedy": (("drafts", "logits"), ("accepted", "bonus"), "simd_argmax.h"),
}
NAMES = tuple(SIGNATURES)
# the fixed-size threadgroup arrays of lattice_path.metal
MAX_ROWS, MAX_K, MAX_RANK = 16, 16, 256


def use_metal(choice: str = "auto") -> bool:
    """Whether a kernels setting runs the Metal kernels here. 'auto': where Metal is available, else pure MLX;
    'metal': the kernels or an error; 'mlx': pure MLX everywhere (same results, the reference)."""
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernels setting {choice!r}; choose one of {BACKENDS}")
    if choice == "metal" and not mx.metal.is_available():
        raise ValueError(
            "--kernels metal needs Metal, which this machine does not have (mx.metal.is_available() is "
            "False); use --kernels auto or --kernels mlx to run the pure-MLX ops"
        )
    return choice == "metal" or (choice == "auto" and mx.metal.is_available())


def backend_name(metal: bool | frozenset[str]) -> str:
    """What the hot ops run on, for reports: 'Metal' or 'pure-MLX'; for a set of kernel names (those on),
    also 'Metal (lattice_path: pure-MLX)' when some are off."""
    if isinstance(metal, (set, frozenset)):
        off = [name for name in NAMES if name not in metal]
        if metal and off:
            return f"Metal ({', '.join(off)}: pure-MLX)"
    return "Metal" if metal else "pure-MLX"


def source(file: str) -> str:
    return files("dflash2_metal").joinpath(file).read_text()


def build(name: str, body: str | None = None):
    """The `mx.fast.metal_kernel` for metal/<name>.metal, or for another `body` with its signature."""
    inputs, outputs, header = SIGNATURES[name]
    return mx.fast.metal_kernel(
        name=f"dflash2_{name}" if body is None else f"dflash2_{name}_variant",
        input_names=list(inputs),
        output_names=list(outputs),
        source=source(f"{name}.metal") if body is None else body,
        header=source(header) if header else "",
    )


kernel = cache(build)  # each kernel object (and so each Metal library) is built once


class Launch(NamedTuple):
    """One kernel call: which kernel and everything `mx.fast.metal_kernel` is called with."""

    name: str
    inputs: tuple
    output_shapes: tuple
    output_dtypes: tuple
    grid: tuple
    threadgroup: tuple
    template: tuple = ()

    def arguments(self) -> dict:
        return dict(
            inputs=list(self.inputs),
            output_shapes=list(self.output_shapes),
            output_dtypes=list(self.output_dtypes),
            grid=self.grid,
            threadgroup=self.threadgroup,
            template=list(self.template),
        )

    def run(self) -> list[mx.array]:
        return kernel(self.name)(**self.arguments())


def conv_launch(x: mx.array, base: mx.array, dyn: mx.array) -> Launch:
    """`short_conv.dynamic_conv`: one thread per output element, rows of 256 channels per threadgroup."""
    out_dtype = mx.result_type(x, dyn)  # as the pure-MLX op: base is cast to x's dtype there
    return Launch(
        "dynamic_conv",
        (x, base, dyn),
        (x.shape,),
        (out_dtype,),
        (x.shape[-1], x.size // x.shape[-1], 1),
        (256, 1, 1),
        (("T", out_dtype),),
    )


def path_launch(unary: mx.array, pred_rows: mx.array, h: mx.array, succ: mx.array, walk: str) -> Launch:
    """`selector.scored_path`: the lattice and the walk of one block in one threadgroup of 256 threads."""
    T, k = unary.shape
    R = h.shape[-1]
    if T > MAX_ROWS or k > MAX_K or R > MAX_RANK:
        raise ValueError(
            f"the lattice_path kernel takes up to {MAX_ROWS} draft rows, top-{MAX_K} candidates "
            f"and rank {MAX_RANK}; got {T} rows, top-{k}, rank {R} (use --kernels mlx)"
        )
    return Launch(
        "lattice_path",
        (unary, pred_rows, h, succ),
        ((T, k, k), (T,)),
        (mx.float32, mx.uint32),
        (256, 1, 1),
        (256, 1, 1),
        (("VITERBI", walk == "viterbi"),),
    )


def accept_launch(drafts: mx.array, target_logits: mx.array) -> Launch:
    """`sampling.accept_greedy`: one threadgroup of 1024 threads walks the verify rows."""
    return Launch("accept_greedy", (drafts, target_logits), ((), ()), (mx.int32, mx.uint32), (1024, 1, 1), (1024, 1, 1))


def dynamic_conv(x: mx.array, base: mx.array, dyn: mx.array) -> mx.array:
    return conv_launch(x, base, dyn).run()[0]


def scored_path(unary, pred_rows, h, succ, walk: str) -> tuple[mx.array, mx.array]:
    return tuple(path_launch(unary, pred_rows, h, succ, walk).run())


def accept_greedy(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    return tuple(accept_launch(drafts, target_logits).run())
