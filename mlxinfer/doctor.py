"""`mlxinfer doctor`: the environment, and on Metal every kernel checked against its
reference on random inputs of realistic sizes. A kernel that disagrees beyond its
tolerance is disabled for the process (its dispatcher runs the reference), so a
broken kernel can never corrupt output."""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import blas, kernels
from .kernels import attention, quantized_matmul, sampling, verification


@dataclass(frozen=True)
class Sizes:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    keys: int = 4096
    vocab: int = 152064
    rows: int = 32
    drafts: int = 4


SMALL = Sizes(heads=4, kv_heads=2, head_dim=64, keys=300, vocab=2000, rows=16, drafts=3)


@dataclass(frozen=True)
class Case:
    """A kernel's check: inputs, both implementations, and how far apart they may be."""

    name: str
    inputs: Callable[[Sizes, np.random.Generator], list[tuple]]
    reference: Callable
    kernel: Callable
    error: Callable[[list[mx.array], list[mx.array]], float]
    tolerance: float
    metric: str


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    error: float
    tolerance: float
    reference_ms: float
    kernel_ms: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def _attention_inputs(s: Sizes, rng: np.random.Generator) -> list[tuple]:
    """A full 4-bit ring read with a mask (a few speculative queries), and an 8-bit growing cache."""
    cases = []
    for bits, queries, masked in ((4, 4, True), (8, 1, False)):
        shape = (1, s.kv_heads, s.keys, s.head_dim)
        k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in range(2))
        q = mx.array(rng.standard_normal((1, s.heads, queries, s.head_dim)).astype(np.float32))
        mask = None
        if masked:
            positions = rng.permutation(s.keys)  # ring order: slots hold positions out of order
            query_pos = np.arange(s.keys - queries, s.keys)
            mask = mx.array((positions[None] <= query_pos[:, None]) & (positions[None] > query_pos[:, None] - 1024))
        group = 64
        keys = tuple(mx.quantize(k, group_size=group, bits=bits))
        values = tuple(mx.quantize(v, group_size=group, bits=bits))
        cases.append((q, keys, values, s.head_dim**-0.5, mask, group, bits, s.keys))
    return cases


def _sampling_inputs(s: Sizes, rng: np.random.Generator) -> list[tuple]:
    logits = mx.array(rng.standard_normal((s.rows, s.vocab)).astype(np.float32) * 4)
    u = mx.array(rng.random(s.rows).astype(np.float32))
    configs = (sampling.SamplingParams(0.7, 50, 0.9, 0.05), sampling.SamplingParams(1.0, 0, 0.95, 0.0))
    return [(logits, u, c) for c in configs]


def _verify_inputs(s: Sizes, rng: np.random.Generator) -> list[tuple]:
    cases = []
    for trial in range(s.rows):
        p = mx.softmax(mx.array(rng.standard_normal((s.drafts + 1, s.vocab)).astype(np.float32) * 3), axis=-1)
        if trial % 2:
            q, drafts = None, [int(t) for t in np.array(mx.argmax(p[: s.drafts], axis=-1))]
        else:
            q = mx.softmax(mx.array(rng.standard_normal((s.drafts, s.vocab)).astype(np.float32) * 3), axis=-1)
            drafts = [int(t) for t in np.array(mx.argmax(q, axis=-1))]
        cases.append((p, drafts, q, mx.array(rng.random(s.drafts + 1).astype(np.float32))))
    return cases


def _max_abs(expected: list[mx.array], got: list[mx.array]) -> float:
    return max(float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()) for a, b in zip(expected, got))


def _mismatch(expected: list[mx.array], got: list[mx.array]) -> float:
    """The fraction of integer results (tokens, acceptance counts) that differ."""
    a, b = (mx.concatenate([x.flatten() for x in xs]) for xs in (expected, got))
    return float((a != b).astype(mx.float32).mean().item())


CASES = (
    Case("attention", _attention_inputs, lambda *a: attention.reference(*a), lambda *a: attention.metal(*a),
         _max_abs, 1e-3, "max abs error"),
    Case("sampling", _sampling_inputs, lambda *a: sampling.reference(*a), lambda *a: sampling.metal(*a),
         _mismatch, 1 / 16, "tokens differing"),
    Case("verify", _verify_inputs, lambda *a: verification.reference(*a), lambda *a: verification.metal(*a),
         _mismatch, 1 / 16, "results differing"),
)


def timed(fn: Callable, cases: list[tuple], repeat: int) -> tuple[list[mx.array], float]:
    """Outputs for every case, and the median milliseconds of one pass over them."""
    outputs = [fn(*c) for c in cases]
    mx.eval(outputs)
    if not repeat:
        return outputs, 0.0
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval([fn(*c) for c in cases])
        times.append(time.perf_counter() - start)
    return outputs, 1000 * statistics.median(times) / len(cases)


def check(case: Case, sizes: Sizes = Sizes(), repeat: int = 5, seed: int = 0) -> Check:
    """Run one kernel and its reference on the same random inputs; disable the kernel
    if they disagree beyond the tolerance."""
    inputs = case.inputs(sizes, np.random.default_rng(seed))
    expected, reference_ms = timed(case.reference, inputs, repeat)
    got, kernel_ms = timed(case.kernel, inputs, repeat)
    error = case.error(expected, got)
    result = Check(case.name, case.metric, error, case.tolerance, reference_ms, kernel_ms)
    if not result.ok:
        kernels.disable(case.name, f"{case.metric} {error:.3g} > {case.tolerance:.3g} against the reference")
    return result


def self_check(name: str) -> None:
    """Kernel `name` against its reference on small inputs, untimed: what every
    process does before first running a kernel. A disagreeing kernel is disabled
    (by `check`) and a warning says so."""
    result = check(next(c for c in CASES if c.name == name), SMALL, repeat=0)
    if not result.ok:
        warnings.warn(f"mlxinfer: kernel '{name}' disagrees with its reference ({result.metric} "
                      f"{result.error:.3g}); the reference runs instead", RuntimeWarning, stacklevel=2)


def run_checks(sizes: Sizes = Sizes(), repeat: int = 5) -> list[Check]:
    """Every kernel against its reference (only meaningful on Metal)."""
    return [check(case, sizes, repeat) for case in CASES]


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
    advice = blas.hint()
    rows += [("BLAS advice", advice)] if advice else []
    return rows + [("quantized matmul", quantized_matmul.describe()),
                   ("4-bit matvec", f"{quantized_matvec_rate():.2f} GB/s of weights read (4096 x 4096, group 64)")]


def quantized_matvec_rate(n: int = 4096, repeat: int = 5) -> float:
    """Bytes of packed weights, scales and biases per second read by a one-row 4-bit
    product through the path decode uses here: the number the CPU extension moves."""
    packed, scales, biases = mx.quantize(mx.random.normal((n, n), key=mx.random.key(0)), group_size=64, bits=4)
    x = mx.random.normal((1, n), key=mx.random.key(1))
    mx.eval(packed, scales, biases, x)
    nbytes = packed.nbytes + scales.nbytes + biases.nbytes
    with mx.stream(mx.cpu):
        best = float("inf")
        for _ in range(repeat + 1):
            start = time.perf_counter()
            mx.eval(quantized_matmul.quantized_matmul(x, packed, scales, biases, 64, 4))
            best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def matmul_gflops(n: int = 1024, repeat: int = 3) -> float:
    """Best float32 matmul rate on the CPU: the number that tells a fast BLAS from the reference one."""
    a, b = (mx.random.normal((n, n), key=mx.random.key(i)) for i in range(2))
    with mx.stream(mx.cpu):
        mx.eval(a @ b)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


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
