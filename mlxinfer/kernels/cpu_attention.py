"""Attention over float32 K/V caches on the CPU, for one sequence or a batch of sequences
each with its own cache: the compiled primitive `attention` of the CPU extension (built and
checked with the quantized matmul, `kernels.quantized_matmul`), which the fused CPU layer
(`kernels.decode_layer`) runs too.

Why: MLX's fused attention on the CPU costs ~40 µs per call however small the cache, and
a batch whose sequences keep their own caches would pay it for every row and layer (64
calls per step for 8 sequences on an 8-layer model); over a long cache it reads K/V once
per query head. The primitive is one op per layer for all rows; it reads each row's cache
buffer in place, the query heads of a KV group together (one read of K/V per step), and
computes every query in one fixed order, so a sequence gets the same numbers alone or in
any batch, and a position the same in a decode step as in a prompt chunk.
"""

from __future__ import annotations

import mlx.core as mx

from .quantized_matmul import extension, mode


def available(q: mx.array) -> bool:
    """Whether `decode_attention` runs here for queries like `q` (float32, CPU, extension built)."""
    return (q.dtype == mx.float32 and mx.default_device().type == mx.DeviceType.cpu and mode() == "auto"
            and extension() is not None)


def decode_attention(q: mx.array, caches: list[tuple[mx.array, mx.array, int]], scale: float) -> mx.array:
    """q [B, heads, 1, dims] over row b's (keys, values, live slots): buffers
    [1, kv_heads, slots, dims] whose first `live` slots hold its keys and values."""
    buffers = [a for keys, values, _ in caches for a in (keys, values)]
    return extension().attention(q, buffers, [n for _, _, n in caches], scale)


def describe() -> str:
    """One line for `mlxinfer doctor`: which attention runs where."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "MLX's fused attention (GPU); quantized K/V: our Metal kernel (see the kernel checks)"
    if mode() == "off" or extension() is None:
        return "MLX's attention per op (the CPU extension is off or not built: see quantized matmul)"
    ext = extension()
    return (f"CPU extension, tiled ({ext.simd()}, {ext.threads()} threads): decode steps and prompt chunks of "
            "standard blocks over float32 K/V (chunks of any size with quantized projections); MLX per op: the rest "
            "(other blocks, long chunks with float32 projections, chunks through a sliding window or a bounded "
            "cache, sinks, soft-capping, quantized K/V)")
