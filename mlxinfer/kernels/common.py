"""Pieces the sampling and verification kernels share: threadgroup reductions and
an inverse-CDF categorical draw, in Metal, and the same draw in MLX ops.

The Metal helpers take their threadgroup scratch through a template pointer type
so they compile both for Metal (where it is `threadgroup float*`) and for the
CPU emulation.
"""

from __future__ import annotations

import mlx.core as mx

HELPERS = """
template <typename T, typename P>
inline T tg_sum(T x, P scratch, uint lane, uint sg, uint nsg) {
  x = metal::simd_sum(x);
  if (lane == 0) scratch[sg] = x;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  T total = 0;
  for (uint i = 0; i < nsg; i++) total += scratch[i];
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return total;
}

template <typename T, typename P>
inline T tg_max(T x, P scratch, uint lane, uint sg, uint nsg) {
  x = metal::simd_max(x);
  if (lane == 0) scratch[sg] = x;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  T best = scratch[0];
  for (uint i = 1; i < nsg; i++) best = metal::max(best, scratch[i]);
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return best;
}

// Index of the first j whose running sum of w(j) exceeds u * total, over
// j < n; each thread owns one contiguous chunk, chunks are prefix-summed.
// A target that rounding puts past the last chunk takes the last positive weight.
template <typename W, typename PF, typename PI>
inline int draw_index(W w, int n, float u, PF fscratch, PI iscratch, uint tid, uint nt, uint lane, uint sg, uint nsg) {
  const int chunk = (n + int(nt) - 1) / int(nt);
  const int lo = metal::min(int(tid) * chunk, n), hi = metal::min(lo + chunk, n);
  float mine = 0.0f;
  int last = -1;
  for (int j = lo; j < hi; j++) {
    float wj = w(j);
    mine += wj;
    if (wj > 0.0f) last = j;
  }
  float before = metal::simd_prefix_exclusive_sum(mine);
  float group = metal::simd_sum(mine);
  if (lane == 0) fscratch[sg] = group;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < nsg; i++) {
    if (i < sg) before += fscratch[i];
    total += fscratch[i];
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  const float target = u * total;
  int found = -1;
  if (last >= 0 && before <= target && target < before + mine) {
    float run = before;
    found = last;
    for (int j = lo; j < hi; j++) {
      run += w(j);
      if (run > target && w(j) > 0.0f) {
        found = j;
        break;
      }
    }
  }
  found = tg_max(found, iscratch, lane, sg, nsg);
  return found >= 0 ? found : tg_max(last, iscratch, lane, sg, nsg);
}
"""

# The start of a kernel body whose threadgroup works on one row: thread indices and
# the scratch the helpers above need (up to 1024 threads, 32 simdgroups).
ROW_PREAMBLE = """
  const uint tid = thread_position_in_threadgroup.x, nt = threads_per_threadgroup.x;
  const uint lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
  const uint nsg = (nt + 31) / 32;
  threadgroup float fscratch[32];
  threadgroup int iscratch[32];
"""


def inverse_cdf(weights: mx.array, u: mx.array) -> mx.array:
    """Per row of `weights` [..., V] (non-negative, not necessarily normalised), the
    first index whose running sum exceeds u * total; u in [0, 1) per row. A
    target that rounding puts past the end takes the last positive weight."""
    running = mx.cumsum(weights, axis=-1)
    target = u[..., None] * running[..., -1:]
    index = (running <= target).sum(axis=-1)
    V = weights.shape[-1]
    last = V - 1 - mx.argmax(weights[..., ::-1] > 0, axis=-1)
    return mx.minimum(index, last).astype(mx.int32)
