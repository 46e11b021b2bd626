"""The affine grid of a group of weights (MLX's format: w ~ scale * code + bias, codes 0..2^bits-1):
MLX's own (the group's min to max), or the one with the least importance-weighted squared error.

mx.quantize spans each group from its smallest to its largest weight, so one outlier stretches the
steps for all the others; at 3 bits that wastes most of the grid. `fitted` searches, as llama.cpp's
K-quant rounding does, a range of step sizes around min-max (the group's range over 2^bits - 1 + d,
d in STEPS), each refined by weighted least squares: with the codes fixed, the scale and bias with
the least sum_j c_j (w_j - scale q_j - bias)^2 solve a 2x2 system; codes and fit alternate
REFITS times. The candidate with the least error wins, MLX's own among them, so a group is never
worse than mx.quantize rounds it. Measured on SmolLM2-135M, GPTQ at 3 bits with groups of 64, the
input second moments as weights: perplexity 29.9 -> 18.3 with the embedding kept float.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

STEPS = np.linspace(-1.0, 1.0, 21)  # d: the range over (2^bits - 1 + d) steps
REFITS = 2


def mlx_grid(group: np.ndarray, bits: int, dtype: mx.Dtype) -> tuple[np.ndarray, np.ndarray]:
    """MLX's affine scale and bias of each row of `group` (mx.quantize's own), as `dtype` stores them."""
    _, s, b = mx.quantize(mx.array(group, dtype=mx.float32), group.shape[1], bits)
    return (np.asarray(s.astype(dtype).astype(mx.float32), dtype=np.float64)[:, 0],
            np.asarray(b.astype(dtype).astype(mx.float32), dtype=np.float64)[:, 0])


def fitted(group: np.ndarray, weights: np.ndarray, bits: int, dtype: mx.Dtype) -> tuple[np.ndarray, np.ndarray]:
    """Scale and bias of each row of `group` [rows, n] with the least sum_j weights_j (w_j - Q(w_j))^2
    of the candidates the module docstring describes, as `dtype` stores them."""
    x = mx.array(group, dtype=mx.float32)[:, None, :]  # [rows, 1, n]: candidates broadcast on axis 1
    c = mx.array(np.maximum(weights, 0), dtype=mx.float32)[None, None, :]
    top = 2**bits - 1
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    scale = mx.maximum(hi - lo, 1e-12) / (top + mx.array(STEPS, dtype=mx.float32)[None, :, None])
    bias = mx.broadcast_to(lo, scale.shape)
    for _ in range(REFITS):
        scale, bias = _least_squares(x, c, _codes(x, scale, bias, top), scale, bias, dtype)
    s0, b0 = mlx_grid(group, bits, dtype)
    scale = mx.concatenate([mx.array(s0, dtype=mx.float32)[:, None, None], scale], axis=1)
    bias = mx.concatenate([mx.array(b0, dtype=mx.float32)[:, None, None], bias], axis=1)
    error = (c * mx.square(scale * _codes(x, scale, bias, top) + bias - x)).sum(axis=-1)  # [rows, candidates]
    best = mx.argmin(error, axis=1)[:, None, None]  # the first of equals: MLX's own when nothing beats it
    pick = lambda a: np.asarray(mx.take_along_axis(a, best, axis=1)[:, 0, 0], dtype=np.float64)  # noqa: E731
    return pick(scale), pick(bias)


def _codes(x: mx.array, scale: mx.array, bias: mx.array, top: int) -> mx.array:
    return mx.clip(mx.round((x - bias) / scale), 0, top)


def _least_squares(x: mx.array, c: mx.array, q: mx.array, scale: mx.array, bias: mx.array,
                   dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """The (scale, bias) minimizing sum c (x - scale q - bias)^2 for codes q, rounded to `dtype`;
    the old ones where the codes are all equal (the system is singular) or the scale would vanish."""
    sc, sq, sqq = c.sum(-1, keepdims=True), (c * q).sum(-1, keepdims=True), (c * q * q).sum(-1, keepdims=True)
    sx, sqx = (c * x).sum(-1, keepdims=True), (c * q * x).sum(-1, keepdims=True)
    det = sc * sqq - sq * sq
    solvable = det > 1e-9 * mx.maximum(sc * sqq, 1e-30)
    safe = mx.where(solvable, det, 1)
    new_scale = mx.where(solvable, (sc * sqx - sq * sx) / safe, scale)
    new_bias = mx.where(solvable, (sqq * sx - sq * sqx) / safe, bias)
    new_scale = new_scale.astype(dtype).astype(mx.float32)
    keep = mx.abs(new_scale) < 1e-12
    return mx.where(keep, scale, new_scale), mx.where(keep, bias, new_bias.astype(dtype).astype(mx.float32))
