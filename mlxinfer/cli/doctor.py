"""`mlxinfer doctor`: the environment, and on Metal every kernel checked against its
reference on random inputs of realistic sizes. A kernel that disagrees beyond its
tolerance is disabled for the process (its dispatcher runs the reference), so a
broken kernel can never corrupt output."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import mlx.core as mx

from .. import kernels
from ..base import blas
from ..kernels import cpu_attention, quantized_matmul
from ..kernels.selfcheck import CASES, SMALL, Check, Sizes  # noqa: F401  (SMALL: doctor.SMALL, the quick sizes)


def run_checks(sizes: Sizes = Sizes(), repeat: int = 5) -> list[Check]:
    """Every kernel against its reference (only meaningful on Metal)."""
    return [kernels.check(case.name, sizes, repeat) for case in CASES]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def environment() -> list[tuple[str, str]]:
    rows = [("MLX", mx.__version__), ("default device", str(mx.default_device())),
            ("Metal", "available" if kernels.metal_available() else "not available"),
            ("MLXINFER_KERNELS", os.environ.get("MLXINFER_KERNELS", "auto"))]
    if kernels.metal_available():
        info = mx.device_info()
        wired = mx.set_wired_limit(0)  # reading it means setting it: put it straight back
        mx.set_wired_limit(wired)
        rows += [("device", str(info.get("device_name", info.get("architecture", "?")))),
                 ("unified memory", _gib(info["memory_size"])),
                 ("recommended working set", _gib(info["max_recommended_working_set_size"])),
                 ("wired limit", _gib(wired) if wired else "none")]
    else:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        rows += [("system memory", _gib(pages))]
    rows += [("BLAS", blas.describe()), ("float32 matmul", f"{matmul_gflops():.1f} GFLOP/s (1024 x 1024, CPU)")]
    advice = blas.hint() or blas.core_hint()
    rows += [("BLAS advice", advice)] if advice else []
    rows += [("quantized matmul", quantized_matmul.describe()), ("attention", cpu_attention.describe()),
             ("4-bit matvec", f"{quantized_matvec_rate():.2f} GB/s of weights read (4096 x 4096, group 64)")]
    ext = quantized_matmul.extension()
    if ext is not None and mx.default_device().type == mx.DeviceType.cpu:
        peak = ext.peak_gflops()
        rate = quantized_gemm_gflops()
        rows += [("4-bit GEMM", f"{rate:.0f} GFLOP/s, {rate / peak:.0%} of the {peak:.0f} GFLOP/s FMA peak "
                                f"({ext.simd()}, {ext.threads()} threads; 512 x 1536 x 1536, group 64)")]
    return rows


def quantized_gemm_gflops(rows: int = 512, n: int = 1536, repeat: int = 5) -> float:
    """The rate of a prompt-sized 4-bit product through the path prefill uses here (the extension's GEMM)."""
    packed, scales, biases = mx.quantize(mx.random.normal((n, n), key=mx.random.key(0)), group_size=64, bits=4)
    x = mx.random.normal((rows, n), key=mx.random.key(1))
    mx.eval(packed, scales, biases, x)
    return 2 * rows * n * n / best_cpu_seconds(
        lambda: quantized_matmul.quantized_matmul(x, packed, scales, biases, 64, 4), repeat) / 1e9


def quantized_matvec_rate(n: int = 4096, repeat: int = 5) -> float:
    """Bytes of packed weights, scales and biases per second read by a one-row 4-bit
    product through the path decode uses here: the number the CPU extension moves."""
    packed, scales, biases = mx.quantize(mx.random.normal((n, n), key=mx.random.key(0)), group_size=64, bits=4)
    x = mx.random.normal((1, n), key=mx.random.key(1))
    mx.eval(packed, scales, biases, x)
    nbytes = packed.nbytes + scales.nbytes + biases.nbytes
    return nbytes / best_cpu_seconds(lambda: quantized_matmul.quantized_matmul(x, packed, scales, biases, 64, 4),
                                      repeat) / 1e9


def matmul_gflops(n: int = 1024, repeat: int = 3) -> float:
    """Best float32 matmul rate on the CPU: the number that tells a fast BLAS from the reference one."""
    a, b = (mx.random.normal((n, n), key=mx.random.key(i)) for i in range(2))
    return 2 * n**3 / best_cpu_seconds(lambda: a @ b, repeat) / 1e9


def best_cpu_seconds(product: Callable[[], mx.array], repeat: int) -> float:
    """The fastest of `repeat` evaluations of `product()` on the CPU, after one warm-up."""
    with mx.stream(mx.cpu):
        mx.eval(product())
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            mx.eval(product())
            best = min(best, time.perf_counter() - start)
    return best


def report(sizes: Sizes = Sizes(), repeat: int = 5) -> list[str]:
    """The doctor's output, line by line (runs the checks on Metal)."""
    lines = [f"{name + ':':<26}{value}" for name, value in environment()]
    if kernels.mode() == "reference" or not kernels.metal_available():
        why = "MLXINFER_KERNELS=reference" if kernels.mode() == "reference" else "no Metal on this machine"
        lines.append(f"kernels: {why}; the MLX reference implementations are in use for {', '.join(kernels.NAMES)}")
        return lines
    lines.append(f"{'kernel':<11}{'metric':<19}{'error':>10}{'tolerance':>11}{'reference ms':>14}{'kernel ms':>11}")
    for c in run_checks(sizes, repeat):
        lines.append(f"{c.name:<11}{c.metric:<19}{c.error:>10.2e}{c.tolerance:>11.2e}"
                     f"{c.reference_ms:>14.3f}{c.kernel_ms:>11.3f}")
    for name, reason in kernels.disabled().items():
        lines.append(f"warning: kernel '{name}' disabled for this session ({reason}); the reference runs instead")
    lines.append("in use: " + ", ".join(f"{n} {impl}" for n, impl in kernels.selection().items()))
    return lines
