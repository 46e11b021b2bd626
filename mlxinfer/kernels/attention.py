"""Decode attention over a 4- or 8-bit affine-quantized K/V cache, beside its
reference in MLX ops.

Both read the cache's buffers in place: `keys`/`values` are the (packed, scales,
biases) triples of a cache, [B, kv_heads, capacity, ...], of which the first
`length` slots are live, in storage order (a rotating cache's ring buffer as it
lies; softmax does not care about key order). `mask` is None, "causal", or a
boolean [queries, length] over those slots. Grouped-query: query head h reads
kv head h // (heads / kv_heads).

The kernel runs one threadgroup of `SIMDGROUPS` x 32 threads per (batch, head,
query): each simdgroup takes every SIMDGROUPS-th key, each lane D/32 of the
dimensions, dequantizing as it reads; an online softmax per simdgroup, merged
through threadgroup memory at the end.
"""

from __future__ import annotations

import mlx.core as mx

from .metal import Launch, MetalKernel

Parts = tuple[mx.array, ...]
SIMDGROUPS = 8
MAX_QUERIES = 8  # beyond this (prefill) the reference's matmuls win


def _as_array_mask(mask: mx.array | str | None, queries: int, keys: int) -> mx.array | None:
    if isinstance(mask, str):
        return mx.arange(keys)[None] <= mx.arange(keys - queries, keys)[:, None]
    return mask


def _live(parts: Parts, length: int) -> Parts:
    return tuple(p[..., :length, :] for p in parts)


def reference(q: mx.array, keys: Parts, values: Parts, scale: float, mask, group_size: int, bits: int,
              length: int) -> mx.array:
    """Attention straight on the quantized values (no dequantized copy): q [B, H, T, D] -> [B, H, T, D]."""
    B, H, T, D = q.shape
    kv_heads = keys[0].shape[1]
    q = (q * scale).reshape(B, kv_heads, H // kv_heads, T, D)
    keys = tuple(mx.expand_dims(p, 2) for p in _live(keys, length))
    values = tuple(mx.expand_dims(p, 2) for p in _live(values, length))
    scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)
    mask = _as_array_mask(mask, T, length)
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(probs, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, H, T, D)


HEADER = """
// Element i of slot `slot` of an affine-quantized row: scale * q + bias.
template <int BITS, int G, int D, typename PW, typename PS>
inline float dequantized(PW w, PS scales, PS biases, size_t slot, int i) {
  constexpr int PER = 32 / BITS;
  const uint word = w[slot * (D / PER) + i / PER];
  const uint level = (word >> ((i % PER) * BITS)) & ((1u << BITS) - 1u);
  const size_t group = slot * (D / G) + i / G;
  return float(scales[group]) * float(level) + float(biases[group]);
}
"""

SOURCE = """
  constexpr int E = D / 32;
  const int L = params[0], C = params[1], Tq = params[2], rep = params[3];
  const uint lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
  const int row = int(threadgroup_position_in_grid.y);
  const int t = row % Tq;
  const size_t base = size_t(row / Tq / rep) * size_t(C);
  float qv[E], acc[E];
  for (int i = 0; i < E; i++) {
    qv[i] = float(q[size_t(row) * D + lane * E + i]) * scale[0];
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int s = int(sg); s < L; s += NSG) {
    if (MASKED && !mask[t * L + s]) continue;
    const size_t slot = base + size_t(s);
    float dot = 0.0f;
    for (int i = 0; i < E; i++) dot += qv[i] * dequantized<BITS, G, D>(kw, ks, kb, slot, int(lane) * E + i);
    dot = metal::simd_sum(dot);
    const float m_new = metal::max(m, dot);
    const float carry = metal::exp(m - m_new), w = metal::exp(dot - m_new);
    l = l * carry + w;
    for (int i = 0; i < E; i++) acc[i] = acc[i] * carry + w * dequantized<BITS, G, D>(vw, vs, vb, slot, int(lane) * E + i);
    m = m_new;
  }
  threadgroup float tg_m[NSG];
  threadgroup float tg_l[NSG];
  threadgroup float tg_acc[NSG * D];
  if (lane == 0) {
    tg_m[sg] = m;
    tg_l[sg] = l;
  }
  for (int i = 0; i < E; i++) tg_acc[sg * D + lane * E + i] = acc[i];
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  if (sg == 0) {
    float top = -INFINITY;
    for (int j = 0; j < NSG; j++) top = metal::max(top, tg_m[j]);
    float total = 0.0f, o[E];
    for (int i = 0; i < E; i++) o[i] = 0.0f;
    for (int j = 0; j < NSG; j++) {
      const float c = tg_m[j] == -INFINITY ? 0.0f : metal::exp(tg_m[j] - top);
      total += tg_l[j] * c;
      for (int i = 0; i < E; i++) o[i] += tg_acc[j * D + lane * E + i] * c;
    }
    for (int i = 0; i < E; i++) out[size_t(row) * D + lane * E + i] = T(total > 0.0f ? o[i] / total : 0.0f);
  }
"""

KERNEL = MetalKernel(
    "mlxinfer_quantized_attention",
    ("q", "kw", "ks", "kb", "vw", "vs", "vb", "mask", "params", "scale"), ("out",), SOURCE, HEADER,
)


def supported(q: mx.array, group_size: int, bits: int) -> bool:
    """Shapes the kernel handles: a few queries, head dim a multiple of 32."""
    return q.shape[2] <= MAX_QUERIES and q.shape[3] % 32 == 0 and group_size % 32 == 0 and bits in (4, 8)


def launch(q: mx.array, keys: Parts, values: Parts, scale: float, mask, group_size: int, bits: int, length: int,
           simdgroups: int = SIMDGROUPS) -> Launch:
    B, H, T, D = q.shape
    mask = _as_array_mask(mask, T, length)
    masked = mask is not None
    mask = mx.broadcast_to(mask, (T, length)) if masked else mx.ones((1,), mx.bool_)
    params = mx.array([length, keys[0].shape[2], T, H // keys[0].shape[1]], mx.int32)
    template = [("T", q.dtype), ("D", D), ("BITS", bits), ("G", group_size),
                ("NSG", simdgroups), ("MASKED", masked)]
    return Launch([q, *keys, *values, mask, params, mx.array([scale], mx.float32)], template,
                  (32 * simdgroups, B * H * T, 1), (32 * simdgroups, 1, 1), [q.shape], [q.dtype])


def metal(q: mx.array, keys: Parts, values: Parts, scale: float, mask, group_size: int, bits: int,
          length: int) -> mx.array:
    return KERNEL(launch(q, keys, values, scale, mask, group_size, bits, length))[0]
