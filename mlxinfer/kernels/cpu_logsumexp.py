"""log(sum(exp(x))) over each row of logits on the CPU: the compiled `logsumexp` of the CPU
extension (built and checked with the quantized matmul, `kernels.quantized_matmul`).

Why: every decode step reports the chosen token's log-probability, which needs the log of
the softmax's denominator over the whole vocabulary. MLX's CPU build takes one exponential
at a time there: ~0.5 ms a step for a 49k vocabulary, a twentieth of a small model's step.
The extension takes 16 at once where the CPU has AVX-512 (a polynomial within 2 ulp of
expf), so a row costs tens of microseconds. Elsewhere its loop takes one std::exp at a time,
as MLX does (and slower than MLX on arm64), so MLX's own is used there.
"""

from __future__ import annotations

import mlx.core as mx

from .quantized_matmul import extension, mode


def logsumexp(x: mx.array) -> mx.array:
    """[rows, 1] for logits `x` [rows, n] that `sampling.finite` has made NaN- and +inf-free."""
    ext = extension()
    if (ext is None or mode() != "auto" or ext.simd() != "avx512" or x.dtype != mx.float32 or x.ndim != 2
            or mx.default_device().type != mx.DeviceType.cpu):
        return mx.logsumexp(x, axis=-1, keepdims=True)
    return ext.logsumexp(x)
