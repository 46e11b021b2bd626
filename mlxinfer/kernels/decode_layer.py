"""One step of a pre-norm block over new tokens per sequence (a decode step, or a prompt chunk of
any size) as two compiled CPU primitives of the CPU extension
(`decode_layer_in`: norm, QKV, q/k norm, RoPE; `decode_layer_out`: causal attention over each
row's cache, O, residual, norm, gated MLP, residual), for sequences with their own caches.

Why: on MLX's CPU backend the same step is ~60 small ops per layer (rms_norm and rope are
themselves built of ops there), each paying a fixed dispatch and a graph node for Python to
build; the products are the only part that needs the cores. The cut between the two halves
is the cache: the caller stores the new keys and values with its own cache code, so every
cache kind keeps one way of storing. The primitives compute what the per-op path computes,
in float32, with the same quantized-product loop (`kernels.quantized_matmul`) and attention
loop (`kernels.cpu_attention`) and each row by itself, so a row's numbers never depend on
its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import cpu_attention
from .quantized_matmul import extension

# Rows a step with float32 projections takes: each of their outputs is one dot product per row (no
# GEMM), and beyond this the per-op path's BLAS matmul is quicker. Quantized projections take any
# count (the extension's GEMM).
FLOAT_ROWS = 256


@dataclass(frozen=True)
class Projection:
    """A linear layer as the primitives take it: [w(, bias)] float32 when `bits` is 0, else
    [w, scales, biases(, bias)] in MLX's affine format."""

    arrays: list[mx.array]
    bits: int = 0
    group: int = 0


@dataclass(frozen=True)
class Adapters:
    """LoRA updates for one step: each row's slot, and for (qkv, o, gate_up, down) empty or the
    layer's stacked float32 [A [slots, rank, in], B transposed [slots, rank, out]] (scale folded
    into B; slot 0, the base, all zeros): row r's product gains B[s] (A[s] x) for s = slots[r]."""

    slots: list[int]
    stacks: tuple[list[mx.array], ...] = ([], [], [], [])


NO_ADAPTERS = Adapters([])


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    dims: int


def available(x: mx.array) -> bool:
    """Whether the primitives run here for a step's hidden state `x` [rows, tokens, hidden]."""
    return cpu_attention.available(x)


def most_rows(projections: Sequence[Projection]) -> int | None:
    """The most rows (tokens of all sequences) a step through these projections takes: any count
    (None) when all are quantized, FLOAT_ROWS with a float32 one."""
    return None if all(p.bits for p in projections) else FLOAT_ROWS


def rope_table(base: float | None, freqs: mx.array | None, dims: int) -> mx.array:
    """The inverse frequencies mx.fast.rope's CPU path derives from `base` or `freqs`, bit for bit
    (positions times this table are its angles): exp(-i * (log(base) / half)), all in float32."""
    if freqs is not None:
        return mx.reciprocal(freqs)
    half = dims // 2
    step = np.float32(np.log(np.float32(base))) / np.float32(half)
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, dtype=mx.float32))


def layer_in(x: mx.array, norm: mx.array, eps: float, qkv: Projection, heads: Heads, positions: list[int],
             qk_norms: tuple[mx.array, mx.array, float] | None, rope: tuple[mx.array, float] | None,
             adapters: Adapters = NO_ADAPTERS) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
    """q [rows, heads, tokens, dims] and each row's new (keys, values) [1, kv_heads, tokens, dims];
    `qk_norms` (q weight, k weight, eps) and `rope` (table, attention factor) where the layer has them."""
    q_norm, k_norm, qk_eps = qk_norms or (None, None, 0.0)
    table, factor = rope or (None, 1.0)
    out = extension().decode_layer_in(
        x, norm, qkv.arrays, qkv.bits, qkv.group, adapters.stacks[0], [q_norm, k_norm] if qk_norms else [],
        [table] if rope else [], positions, adapters.slots, heads.heads, heads.kv_heads, heads.dims, eps, qk_eps,
        factor)
    return out[0], [(out[1 + 2 * r], out[2 + 2 * r]) for r in range(x.shape[0])]


def layer_out(x: mx.array, q: mx.array, o: Projection, norms: tuple[mx.array, ...], eps: float,
              gate_up: Projection, down: Projection, caches: list[tuple[mx.array, mx.array, int]], heads: Heads,
              scale: float, gelu: bool, adapters: Adapters = NO_ADAPTERS) -> mx.array:
    """The block's output [rows, tokens, hidden] from its input `x` and q, row b attending
    causally over caches[b] = (keys, values, live slots) with its new entries stored; `norms`
    the pre-MLP norm's weight, or for sandwich norms (Gemma) the post-attention, pre-MLP and
    post-MLP ones."""
    buffers = [a for keys, values, _ in caches for a in (keys, values)]
    return extension().decode_layer_out(
        x, q, o.arrays, o.bits, o.group, list(norms), gate_up.arrays, gate_up.bits, gate_up.group, down.arrays,
        down.bits, down.group, list(adapters.stacks[1:]), buffers, [n for _, _, n in caches], adapters.slots,
        heads.heads, heads.kv_heads, heads.dims, scale, eps, gelu)
