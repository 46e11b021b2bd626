"""Speculative verification, beside its reference in MLX ops: the exact rule of
Leviathan et al. / Chen et al. in one kernel launch.

Given target distributions p [k+1, V], draft distributions q [k, V] (None: the
drafts are deterministic, q one-hot), the drafts [k] and uniforms u [k+1]:
accept draft i while u_i < p_i(x_i) / q_i(x_i); at the first rejection n draw
from the normalised residual max(0, p_n - q_n) (p_n itself if that is all zero);
if all k are accepted draw a bonus token from p_k. The draw is the inverse CDF
at u_k. Returns int32 [2]: (accepted, token).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .common import HELPERS, ROW_PREAMBLE, inverse_cdf
from .metal import Launch, MetalKernel

THREADS = 1024


def reference(p: mx.array, drafts: Sequence[int], q: mx.array | None, u: mx.array) -> mx.array:
    k = len(drafts)
    x = mx.array(list(drafts), mx.int32)
    px = mx.take_along_axis(p[:k], x[:, None], axis=-1)[:, 0]
    qx = mx.ones_like(px) if q is None else mx.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    n = int(mx.cumprod((u[:k] < px / qx).astype(mx.int32)).sum().item()) if k else 0
    if n == k:
        weights = p[k]
    else:
        draft_row = (mx.arange(p.shape[-1]) == drafts[n]).astype(p.dtype) if q is None else q[n]
        residual = mx.maximum(p[n] - draft_row, 0.0)
        weights = mx.where(residual.sum() > 0, residual, p[n])
    token = inverse_cdf(weights, u[k])
    return mx.stack([mx.array(n, mx.int32), token])


SOURCE = ROW_PREAMBLE + """
  const int V = iparams[0], K = iparams[1];
  const bool one_hot = iparams[2] != 0;
  int n = 0;
  while (n < K) {
    const int x = drafts[n];
    const float px = float(p[size_t(n) * V + x]);
    const float qx = one_hot ? 1.0f : float(q[size_t(n) * V + x]);
    if (!(u[n] < px / qx)) break;
    n++;
  }
  const Residual<T> residual{p + size_t(n) * V, q + size_t(metal::min(n, metal::max(K - 1, 0))) * V,
                             n < K ? (one_hot ? drafts[n] : -1) : -2};
  float mass = 0.0f;
  for (int j = int(tid); j < V; j += int(nt)) mass += residual(j);
  const bool empty = tg_sum(mass, fscratch, lane, sg, nsg) <= 0.0f;
  const Residual<T> weights{residual.p, residual.q, empty ? -2 : residual.draft};
  const int token = draw_index(weights, V, u[K], fscratch, iscratch, tid, nt, lane, sg, nsg);
  if (tid == 0) {
    out[0] = n;
    out[1] = token;
  }
"""

HEADER = HELPERS + """
// Weights of the final draw: p alone (draft == -2: all accepted, or an all-zero
// residual), max(0, p - one_hot(draft)) (draft >= 0), or max(0, p - q) (draft == -1).
template <typename T>
struct Residual {
  const device T* p;
  const device T* q;
  int draft;
  float operator()(int j) const {
    const float pj = float(p[j]);
    if (draft == -2) return pj;
    const float qj = draft >= 0 ? (j == draft ? 1.0f : 0.0f) : float(q[j]);
    return metal::max(pj - qj, 0.0f);
  }
};
"""

KERNEL = MetalKernel("mlxinfer_verify", ("p", "q", "drafts", "u", "iparams"), ("out",), SOURCE, HEADER)


def launch(p: mx.array, drafts: Sequence[int], q: mx.array | None, u: mx.array, threads: int = THREADS) -> Launch:
    k, V = len(drafts), p.shape[-1]
    iparams = mx.array([V, k, q is None], mx.int32)
    q = p[:1] if q is None else q  # unread when one-hot, but the signature needs a buffer of the same type
    x = mx.array(list(drafts) or [0], mx.int32)
    return Launch([p, q.astype(p.dtype), x, u.astype(mx.float32), iparams], [("T", p.dtype)], (threads, 1, 1),
                  (threads, 1, 1), [(2,)], [mx.int32])


def metal(p: mx.array, drafts: Sequence[int], q: mx.array | None, u: mx.array) -> mx.array:
    return KERNEL(launch(p, drafts, q, u))[0]
