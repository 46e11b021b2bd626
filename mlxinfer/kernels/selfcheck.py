"""Each kernel against its reference on the same random inputs: the cases, and one
comparison. Beside the kernels (not in the doctor) because every process runs the small
cases before first using a kernel; `kernels.check` acts on the result."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import attention, sampling, verification


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


def compare(case: Case, sizes: Sizes, repeat: int, seed: int) -> Check:
    """Run one kernel and its reference on the same random inputs (timed `repeat` times)."""
    inputs = case.inputs(sizes, np.random.default_rng(seed))
    expected, reference_ms = timed(case.reference, inputs, repeat)
    got, kernel_ms = timed(case.kernel, inputs, repeat)
    return Check(case.name, case.metric, case.error(expected, got), case.tolerance, reference_ms, kernel_ms)


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)
