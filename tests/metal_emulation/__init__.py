"""Runs the repository's Metal kernels on the CPU, faithfully enough to fail a kernel with a race.

`emulate(launch)` takes a `dflash2_mlx.kernels.Launch`, obtains the exact source MLX would compile for it
(the kernel called with `verbose=True` inside a function traced by `mx.export_function`: no Metal needed),
compiles that as C++20 against `metal_shim.h` (binaries cached by source hash), and runs the grid the way
`dispatchThreads` does, with fresh poison in the outputs and threadgroup memory (see the header for the
barrier, SIMD and ordering rules). It returns the outputs as MLX arrays.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_mlx import kernels

SHIM = Path(__file__).with_name("metal_shim.h")
CACHE = Path(tempfile.gettempdir()) / "dflash2-metal-emulation"
FLAGS = ["-std=c++20", "-O1", "-w"]
# Metal attribute -> the emulator's field (metal_emu::Ids)
ATTRIBUTES = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
    "thread_execution_width",
}


class EmulationError(RuntimeError):
    """The kernel deadlocked, skipped a barrier, or did not compile."""


@functools.cache
def compiler() -> str | None:
    """A C++ compiler that takes -std=c++20, or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        path = name and shutil.which(name)
        probe = [path, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"]
        if path and subprocess.run(probe, input=b"#include <concepts>\n", capture_output=True).returncode == 0:
            return path
    return None


def generated_source(launch: kernels.Launch, body: str | None = None) -> str:
    """The full kernel source MLX generates for `launch` (with another `body` if given)."""
    kernel = kernels.build(launch.name, body) if body is not None else kernels.kernel(launch.name)

    def traced(*inputs):
        return kernel(**launch._replace(inputs=inputs).arguments(), verbose=True)

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as captured:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)  # MLX prints from C++, below Python's sys.stdout
        try:
            mx.export_function(f"{tmp}/kernel.mlxfn", traced, *launch.inputs)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        printed = captured.read()
    match = re.search(r"Generated source code for `[^`]*`:\n```\n(.*)\n```", printed, re.S)
    if match is None:
        raise EmulationError(f"MLX printed no kernel source for {launch.name}")
    return match.group(1)


PARAMETER = re.compile(r"^\s*(.+?)\s*\b(\w+) \[\[(\w+)(?:\((\d+)\))?\]\]", re.M)
THREADGROUP_ARRAY = re.compile(r"\bthreadgroup\s+([\w:]+)\s+(\w+)\s*(\[[^;]*\])\s*;")


def runner_source(source: str) -> tuple[str, list[tuple[str, str]]]:
    """C++ for the kernel plus a per-thread entry that passes every parameter; and the buffer
    parameters (type, name) in MLX's binding order."""
    start = source.index("[[kernel]]")
    signature = source[start : source.index(") {", start)]
    call = re.search(r"\[\[kernel\]\] void (\w+)", signature).group(1)
    instance = re.search(r"decltype\((\w+<[^)]*>)\)", source)
    buffers, arguments = [], []
    for type_, name, attribute, index in PARAMETER.findall(signature):
        if attribute == "buffer":
            assert int(index) == len(buffers), "buffers are bound in order"
            buffers.append((type_, name))
            if type_.endswith("&"):
                arguments.append(f"*reinterpret_cast<{type_[:-1]}*>(metal_emu::buffers[{index}])")
            else:
                arguments.append(f"reinterpret_cast<{type_}>(metal_emu::buffers[{index}])")
        elif attribute in ATTRIBUTES:
            arguments.append(f"id.{attribute}")
        else:
            raise EmulationError(f"the emulator does not supply [[{attribute}]]")
    # every thread of a group must see the same threadgroup array, poisoned when the group starts
    body = THREADGROUP_ARRAY.sub(r"static \1 \2\3; metal_emu::threadgroup_memory(\2, sizeof(\2));", source)
    outputs = ", ".join("false" if type_.startswith("const") else "true" for type_, _ in buffers)
    args = ",\n      ".join(arguments)
    cpp = f"""#include "metal_shim.h"

{body}

static void run_thread(const metal_emu::Ids& id) {{
  {instance.group(1) if instance else call}(
      {args});
}}

int main(int argc, char** argv) {{
  static const bool is_output[] = {{{outputs}}};
  return metal_emu::main(argc, argv, {len(buffers)}, is_output, run_thread);
}}
"""
    return cpp, buffers


def build_runner(cpp: str) -> Path:
    """Compile once per distinct source (and shim); later calls reuse the binary."""
    cxx = compiler()
    if cxx is None:
        raise EmulationError("no C++20 compiler (g++ or clang++) found")
    digest = hashlib.sha256("\0".join([SHIM.read_text(), cpp, cxx, *FLAGS]).encode()).hexdigest()[:20]
    binary = CACHE / f"runner-{digest}"
    if binary.exists():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    source_file = CACHE / f"runner-{digest}.cpp"
    source_file.write_text(cpp)
    partial = CACHE / f"runner-{digest}.{os.getpid()}.tmp"
    result = subprocess.run(
        [cxx, *FLAGS, "-I", str(SHIM.parent), str(source_file), "-o", str(partial)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise EmulationError(f"{source_file} did not compile:\n{result.stderr[-4000:]}")
    partial.replace(binary)  # atomic: concurrent test processes never see half a binary
    return binary


def _raw(x: mx.array) -> bytes:
    """The bytes MLX would bind for an input (row-contiguous)."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.ascontiguousarray(np.array(x)).tobytes()


def _from_raw(data: bytes, shape, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(data, np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(np.frombuffer(data, np.dtype(str(dtype).split(".")[-1])).reshape(shape))


def emulate(launch: kernels.Launch, reverse: bool = False, body: str | None = None) -> list[mx.array]:
    """Run `launch` on the CPU (threads and threadgroups in reverse order if asked); `body` replaces the
    kernel's body (for deliberately broken copies)."""
    mx.eval(*launch.inputs)
    cpp, buffers = runner_source(generated_source(launch, body))
    binary = build_runner(cpp)
    inputs = dict(zip(kernels.SIGNATURES[launch.name][0], launch.inputs))
    outputs = dict(zip(kernels.SIGNATURES[launch.name][1], zip(launch.output_shapes, launch.output_dtypes)))
    with tempfile.TemporaryDirectory() as tmp:
        for index, (_, name) in enumerate(buffers):
            base, _, field = name.rpartition("_")
            if name in inputs:
                data = _raw(inputs[name])
            elif name in outputs:
                shape, dtype = outputs[name]
                data = b"\xff" * (int(np.prod(shape)) * dtype.size)  # poison: NaN / all ones
            elif field == "shape":
                data = np.array(inputs[base].shape, np.int32).tobytes()
            elif field == "strides":
                shape = inputs[base].shape
                data = np.array([int(np.prod(shape[i + 1 :])) for i in range(len(shape))], np.int64).tobytes()
            else:  # ndim
                data = np.int32(inputs[base].ndim).tobytes()
            Path(tmp, f"{index}.bin").write_bytes(data)
        argv = [str(binary), tmp, *map(str, launch.grid), *map(str, launch.threadgroup), str(int(reverse))]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise EmulationError(f"{launch.name}: {result.stderr.strip() or f'exit status {result.returncode}'}")
        index = {name: i for i, (_, name) in enumerate(buffers)}
        return [
            _from_raw(Path(tmp, f"{index[name]}.out").read_bytes(), shape, dtype)
            for name, (shape, dtype) in outputs.items()
        ]
