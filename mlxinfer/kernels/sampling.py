"""Fused sampling: temperature, top-k, top-p, min-p and a categorical draw over
the whole vocabulary, in one Metal kernel, beside its reference in MLX ops.

The kernel never sorts. It works on the max-normalised probabilities
e = exp((x - max) / T) in (0, 1], whose float bit patterns order like the
values, and finds each cut-off by a bitwise search over those patterns:
top-k keeps e >= the k-th largest value (the largest t with at least k values
>= t); top-p keeps a token iff the mass strictly above it is below p (the
smallest t whose mass above is below p of the top-k mass); min-p keeps
e >= min_p. Ties at a cut-off are all kept, as the filters below do. The draw
is the inverse CDF at a uniform u per row, so the kernel and the reference map
the same u to the same token.

Rows need not be finite (a model's logits can overflow, a mask leaves -inf): NaN
counts as -inf, a row holding +inf draws evenly among its +inf entries (the limit
of softmax as they grow), and a row with nothing left draws `NO_TOKEN`, never a
token the distribution did not choose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from .common import HELPERS, ROW_PREAMBLE, inverse_cdf
from .metal import Launch, MetalKernel

NEG_INF = float("-inf")
NO_TOKEN = -1  # what a draw gives for a row with nothing to draw from (every logit -inf or NaN)
Filter = Callable[[mx.array], mx.array]
THREADS = 1024


@mx.compile
def finite(logits: mx.array) -> mx.array:
    """Logits [B, V] every filter and draw can take: NaN becomes -inf (nothing supports the
    token), and a row holding +inf becomes 0 at its +inf entries and -inf elsewhere (softmax's
    limit as those logits grow: even odds among them), so no step ever computes inf - inf.
    Compiled: it runs on every decode step, and fused it is about one pass over the row."""
    logits = mx.where(mx.isnan(logits), NEG_INF, logits)
    top = logits == float("inf")
    return mx.where(top.any(axis=-1, keepdims=True), mx.where(top, 0.0, NEG_INF), logits)


def empty_rows(logits: mx.array) -> mx.array:
    """Rows [B] of `finite` logits that hold nothing to draw: every entry -inf."""
    return (logits == NEG_INF).all(axis=-1)


def temperature(t: float) -> Filter:
    """Logits divided by t, shifted so the largest is 0 first: a finite logit over a small t
    would overflow to +inf, but a difference from the maximum only falls towards -inf."""
    return lambda logits: (logits - logits.max(axis=-1, keepdims=True)) / t


def top_k(k: int) -> Filter:
    """Keep the k most likely tokens (ties at the boundary all kept); a partition, not a sort."""

    def apply(logits: mx.array) -> mx.array:
        if k >= logits.shape[-1]:
            return logits
        kth = -mx.partition(-logits, k - 1, axis=-1)[..., k - 1 : k]
        return mx.where(logits >= kth, logits, NEG_INF)

    return apply


def top_p(p: float) -> Filter:
    """Keep the smallest most-likely set whose probability reaches p: one value
    sort finds the cut-off logit (ties with it are kept)."""

    def apply(logits: mx.array) -> mx.array:
        ordered = -mx.sort(-logits, axis=-1)
        probs = mx.softmax(ordered, axis=-1, precise=True)
        before = mx.cumsum(probs, axis=-1) - probs
        kept = (before < p).sum(axis=-1, keepdims=True)
        cutoff = mx.take_along_axis(ordered, kept - 1, axis=-1)
        return mx.where(logits >= cutoff, logits, NEG_INF)

    return apply


def min_p(m: float) -> Filter:
    """Keep tokens at least m times as likely as the most likely one."""

    def apply(logits: mx.array) -> mx.array:
        threshold = logits.max(axis=-1, keepdims=True) + mx.log(mx.array(m, logits.dtype))
        return mx.where(logits >= threshold, logits, NEG_INF)

    return apply


@dataclass(frozen=True)
class SamplingParams:
    """What the fused sampler applies (temperature > 0; 0 / 1 / 0 disable the rest)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def warp_chain(params: SamplingParams) -> list[Filter]:
    """Temperature and the truncation filters, in transformers' order."""
    chain: list[Filter] = []
    if params.temperature != 1:
        chain.append(temperature(params.temperature))
    if params.top_k:
        chain.append(top_k(params.top_k))
    if params.top_p < 1:
        chain.append(top_p(params.top_p))
    if params.min_p > 0:
        chain.append(min_p(params.min_p))
    return chain


@lru_cache(maxsize=64)
def _compiled_reference(params: SamplingParams) -> Callable[[mx.array, mx.array], mx.array]:
    chain = warp_chain(params)

    def draw(logits: mx.array, u: mx.array) -> mx.array:
        logits = finite(logits.astype(mx.float32))
        nothing = empty_rows(logits)
        for f in chain:
            logits = f(logits)
        weights = mx.exp(logits - logits.max(axis=-1, keepdims=True))
        return mx.where(nothing, NO_TOKEN, inverse_cdf(weights, u))

    return mx.compile(draw)


def reference(logits: mx.array, u: mx.array, params: SamplingParams) -> mx.array:
    """Tokens [B] drawn from logits [B, V] after the filters, at uniforms u [B] (`NO_TOKEN`
    for a row with nothing to draw)."""
    return _compiled_reference(params)(logits, u)


SOURCE = ROW_PREAMBLE + """
  threadgroup uint uscratch[32];
  const int V = iparams[0], K = iparams[1];
  const float inv_t = fparams[0], P = fparams[1], MINP = fparams[2];
  const uint row = threadgroup_position_in_grid.y;
  const device T* x = logits + size_t(row) * size_t(V);

  float top = -INFINITY;  // NaN skipped: it counts as -inf
  for (int j = int(tid); j < V; j += int(nt)) {
    const float xj = float(x[j]);
    if (!is_nan(xj)) top = metal::max(top, xj);
  }
  top = tg_max(top, fscratch, lane, sg, nsg);
  if (as_type<uint>(top) == NEG_INF_BITS) {  // nothing to draw from (every thread sees the same top)
    if (tid == 0) out[row] = -1;
    return;
  }
  const MaxNormalised<T> e{x, top, inv_t, as_type<uint>(top) == POS_INF_BITS};

  uint k_bits = 0;  // top-k: the largest t with count(e >= t) >= K
  if (K > 0 && K < V) {
    for (int b = 30; b >= 0; b--) {
      const uint candidate = k_bits | (1u << b);
      uint count = 0;
      for (int j = int(tid); j < V; j += int(nt)) count += as_type<uint>(e(j)) >= candidate ? 1u : 0u;
      if (tg_sum(count, uscratch, lane, sg, nsg) >= uint(K)) k_bits = candidate;
    }
  }
  uint p_bits = 0;  // top-p: one past the largest t whose mass above t is still >= P of the top-k mass
  if (P < 1.0f) {
    float mass = 0.0f;
    for (int j = int(tid); j < V; j += int(nt)) {
      const float ej = e(j);
      mass += as_type<uint>(ej) >= k_bits ? ej : 0.0f;
    }
    const float goal = P * tg_sum(mass, fscratch, lane, sg, nsg);
    uint t = 0;
    for (int b = 30; b >= 0; b--) {
      const uint candidate = t | (1u << b);
      float above = 0.0f;
      for (int j = int(tid); j < V; j += int(nt)) {
        const float ej = e(j);
        const uint bits = as_type<uint>(ej);
        above += (bits >= k_bits && bits > candidate) ? ej : 0.0f;
      }
      if (tg_sum(above, fscratch, lane, sg, nsg) >= goal) t = candidate;
    }
    p_bits = t + 1;
  }
  const Kept<T> kept{e, metal::max(k_bits, p_bits), MINP};
  const int token = draw_index(kept, V, u[row], fscratch, iscratch, tid, nt, lane, sg, nsg);
  if (tid == 0) out[row] = token;
"""

HEADER = HELPERS + """
// Infinities and NaN told apart by their bits, which fast math cannot fold away.
static constexpr constant uint POS_INF_BITS = 0x7f800000u, NEG_INF_BITS = 0xff800000u;
inline bool is_nan(float x) { return (as_type<uint>(x) & 0x7fffffffu) > POS_INF_BITS; }

// e = exp((x - top) / T) in [0, 1]: 0 for NaN; with +inf on the row, 1 at each +inf and 0 elsewhere.
template <typename T>
struct MaxNormalised {
  const device T* x;
  float top, inv_t;
  bool infinite_top;
  float operator()(int j) const {
    const float xj = float(x[j]);
    if (infinite_top) return as_type<uint>(xj) == POS_INF_BITS ? 1.0f : 0.0f;
    return is_nan(xj) ? 0.0f : metal::exp((xj - top) * inv_t);
  }
};

template <typename T>
struct Kept {
  MaxNormalised<T> e;
  uint min_bits;
  float min_p;
  float operator()(int j) const {
    const float ej = e(j);
    return (as_type<uint>(ej) >= min_bits && ej >= min_p) ? ej : 0.0f;
  }
};
"""

KERNEL = MetalKernel("mlxinfer_sample", ("logits", "u", "fparams", "iparams"), ("out",), SOURCE, HEADER)


def launch(logits: mx.array, u: mx.array, params: SamplingParams, threads: int = THREADS) -> Launch:
    B, V = logits.shape
    fparams = mx.array([1 / params.temperature, params.top_p, params.min_p], mx.float32)
    iparams = mx.array([V, params.top_k], mx.int32)
    return Launch([logits, u.astype(mx.float32), fparams, iparams], [("T", logits.dtype)], (threads, B, 1),
                  (threads, 1, 1), [(B,)], [mx.int32])


def metal(logits: mx.array, u: mx.array, params: SamplingParams) -> mx.array:
    return KERNEL(launch(logits, u, params))[0]
