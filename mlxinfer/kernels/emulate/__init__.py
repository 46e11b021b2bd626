"""Run a Metal kernel's source on the CPU: the source MLX would compile, built as
C++17 against `metal_shim.h` into a shared object whose one C entry point runs
the whole grid, called through ctypes on numpy buffers.

Used by the tests, so the kernels' Metal code is compiled and executed here, not
just read; see metal_shim.h for what the emulation does and does not cover.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..metal import Assembled, Launch, MetalKernel

SHIM = Path(__file__).with_name("metal_shim.h")
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-Wall", "-Wno-attributes", "-Wno-unused-parameter", "-Werror"]
ENTRY = "mlxinfer_launch"


def compiler() -> str | None:
    """A C++17 compiler on PATH, if any."""
    return next((c for c in (shutil.which("g++"), shutil.which("c++"), shutil.which("clang++")) if c), None)


def launcher(assembled: Assembled) -> str:
    """The translation unit: shim, the assembled kernel, and a C entry point that
    passes each parameter from a buffer (or a thread attribute) in signature order."""
    args, buffer = [], 0
    for p in assembled.params:
        ctype = p.ctype.replace("device ", "").replace("constant ", "")
        if p.kind == "attribute":
            args.append(f"a.{p.name}")
            continue
        if p.kind in ("scalar", "ndim"):
            args.append(f"*(const {ctype.rstrip('&')}*)b[{buffer}]")
        elif p.kind == "output":
            args.append(f"({ctype})b[{buffer}]")
        else:
            args.append(f"(const {ctype})b[{buffer}]")
        buffer += 1
    call = assembled.name + assembled.template_args + "(\n      " + ",\n      ".join(args) + ")"
    return (
        f'#include "{SHIM}"\n{assembled.source}\n'
        f'extern "C" int {ENTRY}(void** b, const unsigned* grid, const unsigned* tg) {{\n'
        f"  return emu::run_grid(grid, tg, [&](const emu::ThreadAttrs& a) {{\n    {call};\n  }});\n}}\n"
    )


@dataclass
class Emulated:
    """A compiled kernel variant; `run` takes the same Launch the Metal path uses."""

    kernel: MetalKernel
    library: ctypes.CDLL

    def run(self, launch: Launch) -> list[np.ndarray]:
        buffers: list[np.ndarray] = []
        for name, x in zip(self.kernel.input_names, launch.inputs):
            buffers.append(np.ascontiguousarray(np.array(x)))
            for suffix, value in (("shape", np.array(x.shape, np.int32)),
                                  ("strides", np.cumprod((x.shape + (1,))[:0:-1])[::-1].astype(np.int64)),
                                  ("ndim", np.array(x.ndim, np.int32))):
                if f"{name}_{suffix}" in self.kernel.source and x.ndim:
                    buffers.append(value)
        outputs = []
        for shape, dtype in zip(launch.output_shapes, launch.output_dtypes):
            out = np.empty(shape, np.dtype(np.array(mx.zeros(1, dtype)).dtype))
            out.view(np.uint8)[...] = 0xFF  # poison: an unwritten output shows as NaN or -1
            outputs.append(out)
        buffers += outputs
        pointers = (ctypes.c_void_p * len(buffers))(*(b.ctypes.data for b in buffers))
        dims = [(ctypes.c_uint * 3)(*d) for d in (launch.grid, launch.threadgroup)]
        if self.library[ENTRY](pointers, *dims):
            raise RuntimeError(f"{self.kernel.name}: a barrier or simd collective was not reached by every thread")
        return outputs


def build(kernel: MetalKernel, launch: Launch, folder: Path) -> Emulated:
    """Compile the source MLX would build for `launch` (template values included)."""
    assembled = kernel.assemble(launch)
    folder.mkdir(parents=True, exist_ok=True)
    cpp = folder / f"{assembled.name}.cpp"
    cpp.write_text(launcher(assembled))
    lib = folder / f"{assembled.name}.so"
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++)")
    done = subprocess.run([cxx, *FLAGS, str(cpp), "-o", str(lib)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"compiling {cpp} failed:\n{done.stderr[-4000:]}")
    library = ctypes.CDLL(str(lib))
    library[ENTRY].restype = ctypes.c_int
    return Emulated(kernel, library)
