"""A one-time self-check of the Metal kernels before a drafter uses them.

A kernel is compiled by Metal the first time it runs, so a kernel this machine's Metal cannot build (or one
that computes something else here) would otherwise surface in the middle of a generation. Under
`--kernels auto` each kernel first runs on tiny random inputs in every dtype it takes and is compared with
its pure-MLX twin; a kernel that fails to build or disagrees is switched off (its pure-MLX op runs instead,
same results) with one warning naming it, and the others stay on. The checks run once per process (the
first drafter set to 'auto' on a Metal machine): the kernels' first builds, which a generation would pay
anyway, and a few launches on small inputs.
`dflash2 info --self-check` prints them. `--kernels metal` skips the check (every kernel, whatever happens);
`--kernels mlx` runs none.

Each check calls the kernel through `kernels` (so through `kernels.Launch.run`, where the tests put a
stand-in) and the op's own pure-MLX function; `CHECKS` holds them by kernel name.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import kernels
from .sampling import accept_greedy
from .selector import LatticeInputs, lattice_of, walk_greedy, walk_viterbi
from .short_conv import dynamic_conv_mlx

DTYPES = (mx.float32, mx.bfloat16, mx.float16)
# The pure-MLX conv rounds every partial sum to its dtype, the kernel only the result: a bound on
# |kernel - op| per element, relative to the largest |op| output plus the element's own.
CONV_TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 3e-2, mx.float16: 4e-3}


class KernelCheckWarning(RuntimeWarning):
    """A Metal kernel failed its self-check and is switched off."""


class Result(NamedTuple):
    """One kernel's check in one dtype: `reason` says why it failed ('' when it passed); `max_diff` is the
    largest |kernel - pure-MLX| of its float outputs (None when it did not run or has only integer outputs)."""

    kernel: str
    dtype: str
    ok: bool
    reason: str = ""
    max_diff: float | None = None


Outcome = tuple[str, "float | None"]  # (what disagrees, '' if nothing; max |diff| of the float outputs)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _max_diff(got: mx.array, want: mx.array) -> float:
    return mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()


def check_dynamic_conv(dtype: mx.Dtype) -> Outcome:
    """Two sequences of 5 rows of 300 channels (two threadgroups a row, the second partial), 2 taps, groups of 4."""
    keys = mx.random.split(mx.random.key(0), 3)  # explicit keys: the global random state is left alone
    x = mx.random.normal((2, 5, 300), key=keys[0]).astype(dtype)
    base = mx.random.normal((2, 300), key=keys[1]).astype(dtype)
    dyn = (0.5 * mx.random.normal((2, 5, 2, 75), key=keys[2])).astype(dtype)
    got, want = kernels.dynamic_conv(x, base, dyn), dynamic_conv_mlx(x, base, dyn)
    mx.eval(got, want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"gave {got.dtype} {got.shape}, the pure-MLX op {want.dtype} {want.shape}", None
    if not mx.all(mx.isfinite(got)).item():
        return "non-finite output", None
    scale = mx.abs(want.astype(mx.float32))
    bound = CONV_TOLERANCE[dtype] * (mx.max(scale) + scale)
    diff = _max_diff(got, want)
    if not mx.all(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)) <= bound).item():
        return f"max |diff| {diff:.3g} exceeds the {_dtype_name(dtype)} tolerance", diff
    return "", diff


def check_lattice_path(dtype: mx.Dtype) -> Outcome:
    """6 draft rows, top-16, rank 64, both walks, on small whole numbers: every score is exact in any summation
    order and ties are everywhere, so scores and paths must equal the pure-MLX ones exactly."""
    keys = mx.random.split(mx.random.key(1), 4)
    shapes = [(6, 16), (6, 16, 64), (6, 64), (6, 16, 64)]
    fields = [mx.random.randint(-2, 3, s, key=key).astype(dtype) for s, key in zip(shapes, keys)]
    inputs = LatticeInputs(mx.zeros((6, 16), mx.uint32), *fields)
    want = lattice_of(inputs)
    for walk, reference in (("greedy", walk_greedy), ("viterbi", walk_viterbi)):
        scores, path = kernels.scored_path(inputs.unary, inputs.pred_rows, inputs.h, inputs.succ, walk)
        want_path = reference(want)
        mx.eval(scores, path, want.scores, want_path)
        if scores.shape != want.scores.shape:
            return f"gave scores of shape {scores.shape}, the pure-MLX op {want.scores.shape}", None
        diff = _max_diff(scores, want.scores)
        if not mx.array_equal(scores, want.scores).item():
            return f"{walk} walk: scores differ (max |diff| {diff:.3g})", diff
        if path.tolist() != want_path.tolist():
            return f"{walk} walk: path {path.tolist()}, the pure-MLX walk {want_path.tolist()}", diff
    return "", diff


def check_accept_greedy(dtype: mx.Dtype) -> Outcome:
    """8 verify rows over 3,000 tokens (each thread reads several): drafts wrong from row 3 on, and all right."""
    rng = np.random.default_rng(2)
    logits = mx.array(rng.normal(size=(8, 3000)).astype(np.float32)).astype(dtype)
    choice = np.array(mx.argmax(logits, axis=-1)).astype(np.uint32)
    wrong = choice[:-1].copy()
    wrong[3] = (wrong[3] + 1) % 3000
    for drafts in (mx.array(wrong), mx.array(choice[:-1])):
        got, want = kernels.accept_greedy(drafts, logits), accept_greedy(drafts, logits)
        mx.eval(*got, *want)
        if [g.item() for g in got] != [w.item() for w in want]:
            return (
                "(accepted, bonus) = ({}, {}), the pure-MLX op ({}, {})".format(*(a.item() for a in (*got, *want))),
                None,
            )
    return "", None


# kernel name -> (the dtypes it is checked in, its check); lattice_path's inputs are float32 whatever the drafter's
CHECKS: dict[str, tuple[tuple[mx.Dtype, ...], Callable[[mx.Dtype], Outcome]]] = {
    "dynamic_conv": (DTYPES, check_dynamic_conv),
    "lattice_path": ((mx.float32,), check_lattice_path),
    "accept_greedy": (DTYPES, check_accept_greedy),
}


def check(name: str, dtype: mx.Dtype) -> Result:
    """One kernel in one dtype against its pure-MLX op."""
    try:
        problem, diff = CHECKS[name][1](dtype)
    except Exception as e:  # noqa: BLE001 -- Metal compiles a kernel at its first evaluation: errors surface here
        message = " | ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        message = message if len(message) <= 400 else message[:400] + "..."  # a compiler's first errors
        return Result(name, _dtype_name(dtype), False, f"did not build or run: {message}")
    if diff is not None and not math.isfinite(diff):
        diff, problem = None, problem or "non-finite output"
    if problem:
        return Result(name, _dtype_name(dtype), False, f"disagrees with the pure-MLX op: {problem}", diff)
    return Result(name, _dtype_name(dtype), True, "", diff)


_lock = threading.Lock()
_results: tuple[Result, ...] | None = None


def results() -> tuple[Result, ...]:
    """Every kernel's checks, run once per process (the first call; later calls return the same records).
    Each kernel that fails is named in one `KernelCheckWarning`, at that first call."""
    global _results
    with _lock:
        if _results is None:
            done = tuple(check(name, dtype) for name, (dtypes, _) in CHECKS.items() for dtype in dtypes)
            for name in CHECKS:
                failed = [r for r in done if r.kernel == name and not r.ok]
                if failed:
                    reasons = {r.reason: [f.dtype for f in failed if f.reason == r.reason] for r in failed}
                    detail = "; ".join(f"{', '.join(dtypes)}: {reason}" for reason, dtypes in reasons.items())
                    warnings.warn(
                        f"the {name} Metal kernel failed its self-check and is switched off, its pure-MLX op runs "
                        f"instead (same results) [{detail}]. `dflash2 info --self-check` prints the check for a "
                        "bug report; `--kernels mlx` turns every kernel off.",
                        KernelCheckWarning,
                        stacklevel=2,
                    )
            _results = done
        return _results


def passed(checked: tuple[Result, ...] | None = None) -> frozenset[str]:
    """The kernels that passed in every dtype (`checked`: these results, else the process's own)."""
    checked = results() if checked is None else checked
    return frozenset(name for name in CHECKS if all(r.ok for r in checked if r.kernel == name))


def enabled(choice: str = "auto") -> frozenset[str]:
    """The kernels a kernels setting runs here: 'auto' those that pass the self-check where Metal is
    available (none elsewhere), 'metal' all of them (an error without Metal), 'mlx' none."""
    if not kernels.use_metal(choice):
        return frozenset()
    return frozenset(kernels.NAMES) if choice == "metal" else passed()


def clear() -> None:
    """Forget the checks (the next `results` runs them again; for tests)."""
    global _results
    with _lock:
        _results = None
