"""Gated DeltaNet (Yang et al. 2024, arXiv 2412.06464): the linear attention of Qwen3-Next and
Qwen3.5, whose memory of the past is one [key_dim, value_dim] matrix per value head.

For value head h and token t, with q, k L2-normalised (q also scaled by 1/sqrt(key_dim)),
g_t <= 0 a log-decay and beta_t in (0, 1) a write strength:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

The rule is written twice, as two schedules of the same arithmetic: `recurrent` runs it a
token at a time (decoding, short updates such as a speculative verification and its `replay`),
`chunked` runs prompt chunks 64 tokens at a time, where the updates inside a chunk become
matrix products (the UT transform: (I + L)^-1 with L the chunk's strictly lower
beta k k^T decay matrix, by repeated squaring since L is nilpotent) and only the chunks
follow one another. Both leave the same state; which one ran never shows beyond float rounding.

In front of it a causal depthwise convolution (`short_conv.causal_conv`) mixes q, k and v
over the last `conv_kernel` tokens, so a sequence's state is that convolution's last inputs
plus the matrices S, held by a `cache.StateCache`. Every update also hands the cache the
inputs it consumed and `replay`, so the cache can rebuild the state after any prefix of its
recent updates (rolling back rejected speculative drafts) without the model.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .layers import Linear
from .short_conv import DepthwiseConv, causal_conv, conv_state, row_caches, split_rows, stacked

CHUNK = 64
# Updates of at most this many tokens run token by token: cheaper than a padded chunk, and a
# decoded token and a verified draft go through the very same arithmetic.
RECURRENT_MAX = 16
L2_EPS = 1e-6


def l2norm(x: mx.array) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


def recurrent(q: mx.array | None, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
              ) -> tuple[mx.array | None, mx.array]:
    """The rule token by token. q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta [B, H, T], state
    [B, H, Dk, Dv]; returns the outputs [B, H, T, Dv] (None without q: the state alone) and the state."""
    outs = []
    for t in range(k.shape[2]):
        kt = k[:, :, t : t + 1]  # [B, H, 1, Dk]
        state = state * mx.exp(g[:, :, t])[..., None, None]
        delta = (v[:, :, t : t + 1] - kt @ state) * beta[:, :, t, None, None]
        state = state + kt.swapaxes(-1, -2) @ delta
        if q is not None:
            outs.append(q[:, :, t : t + 1] @ state)
    return (mx.concatenate(outs, axis=2) if q is not None else None), state


def _unit_lower_inverse(lower: mx.array) -> mx.array:
    """(I + L)^-1 for strictly lower triangular L [..., C, C] (C a power of two): with X = -L,
    X^C = 0, so the inverse is sum_j X^j = (I + X)(I + X^2)(I + X^4)...(I + X^(C/2))."""
    x = -lower
    inv = x + mx.eye(lower.shape[-1], dtype=lower.dtype)
    power = x
    size = 2
    while size < lower.shape[-1]:
        power = power @ power
        inv = inv + inv @ power
        size *= 2
    return inv


def chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
            size: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The rule over chunks of `size` tokens (shapes as in `recurrent`). Padding the last chunk
    with k = v = 0, g = 0, beta = 0 leaves the state as it was."""
    T = k.shape[2]
    pad = -T % size
    if pad:
        widen = [(0, 0), (0, 0), (0, pad)]
        q, k, v = (mx.pad(a, [*widen, (0, 0)]) for a in (q, k, v))
        g, beta = (mx.pad(a, widen) for a in (g, beta))
    B, H, n = k.shape[0], k.shape[1], k.shape[2] // size
    q, k, v = (a.reshape(B, H, n, size, a.shape[-1]) for a in (q, k, v))
    g, beta = (a.reshape(B, H, n, size) for a in (g, beta))
    decay_log = mx.cumsum(g, axis=-1)  # log of the decay from the chunk's start to each token
    causal = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    pair = decay_log[..., :, None] - decay_log[..., None, :]
    decay = mx.exp(mx.where(causal, pair, -mx.inf))  # exp(G_i - G_j) for j <= i, else 0
    k_beta = k * beta[..., None]
    strict = mx.where(mx.tril(causal, -1), (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    solve = _unit_lower_inverse(strict)
    values = solve @ (v * beta[..., None])
    k_decayed = solve @ (k_beta * mx.exp(decay_log)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = q * mx.exp(decay_log)[..., None]
    k_to_end = k * mx.exp(decay_log[..., -1:] - decay_log)[..., None]
    chunk_decay = mx.exp(decay_log[..., -1])[..., None, None]
    outs = []
    for i in range(n):
        fresh = values[:, :, i] - k_decayed[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ fresh)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].swapaxes(-1, -2) @ fresh
    out = mx.concatenate(outs, axis=2)
    return out[:, :, :T], state


def gated_delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None
                     ) -> tuple[mx.array, mx.array]:
    """The rule on the layer's raw heads: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv],
    in float32 (the state too, whatever the model's dtype); each key head serves Hv / Hk
    consecutive value heads. Returns outputs [B, T, Hv, Dv] and the state [B, Hv, Dk, Dv]."""
    q, k, v, g, beta = _heads(q, k, v, g, beta)
    out, state = _scheduled(q * q.shape[-1] ** -0.5, k, v, g, beta, state)
    return out.swapaxes(1, 2), state


def _scheduled(q: mx.array | None, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None
               ) -> tuple[mx.array | None, mx.array]:
    """The rule on [B, Hv, T, ...] heads from `state` (None: zeros), token by token for short updates,
    chunked for longer ones; without q only the state is wanted."""
    if state is None:
        state = mx.zeros((*v.shape[:2], k.shape[-1], v.shape[-1]), mx.float32)
    if k.shape[2] <= RECURRENT_MAX:
        return recurrent(q, k, v, g, beta, state)
    out, state = chunked(k if q is None else q, k, v, g, beta, state)
    return (None if q is None else out), state


def _heads(q: mx.array | None, k: mx.array, v: mx.array, g: mx.array, beta: mx.array):
    """[B, T, heads, ...] -> [B, Hv, T, ...] in float32, q and k L2-normalised and repeated to the value heads."""
    repeat = v.shape[2] // k.shape[2]
    q, k = ((None if a is None else mx.repeat(a, repeat, axis=2) if repeat > 1 else a) for a in (q, k))
    q, k = ((None if a is None else l2norm(a.astype(mx.float32).swapaxes(1, 2))) for a in (q, k))
    v, g, beta = (a.astype(mx.float32).swapaxes(1, 2) for a in (v, g, beta))
    return q, k, v, g, beta


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times silu(gate)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps) * nn.silu(gate.astype(mx.float32)).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's layer (Qwen3-Next's fused projections are split into these at load time):
    qkv = conv(in_proj_qkv(x)), silu'd; z, b, a from their own projections; beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias); out_proj(norm(rule(q, k, v, g, beta), z))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        lin, h = cfg.linear, cfg.hidden_size
        self.key_heads, self.value_heads = lin.key_heads, lin.value_heads
        self.key_dim, self.value_dim = lin.key_dim, lin.value_dim
        keys, values = lin.key_heads * lin.key_dim, lin.value_heads * lin.value_dim
        self.in_proj_qkv = Linear(h, 2 * keys + values, bias=False)
        self.in_proj_z = Linear(h, values, bias=False)
        self.in_proj_b = Linear(h, lin.value_heads, bias=False)
        self.in_proj_a = Linear(h, lin.value_heads, bias=False)
        self.conv1d = DepthwiseConv(2 * keys + values, lin.conv_kernel)
        self.dt_bias = mx.ones((lin.value_heads,))
        self.A_log = mx.zeros((lin.value_heads,))
        self.norm = GatedRMSNorm(lin.value_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(values, h, bias=False)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, T, _ = x.shape
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        caches = row_caches(cache)
        conv = stacked(caches, 0) if caches else None
        ssm = stacked(caches, 1) if caches else None
        qkv, new_conv = causal_conv(mixed, self.conv1d.weight[:, 0, :], None, conv)
        q, k, v = self._split(nn.silu(qkv))
        out, new_ssm = gated_delta_rule(q, k, v, self._decay(a), mx.sigmoid(b.astype(mx.float32)), ssm)
        if caches:
            split_rows(caches, (new_conv, new_ssm), (mixed, a, b), self.replay)
        out = self.norm(out.astype(x.dtype), z.reshape(B, T, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(B, T, -1))

    def _split(self, qkv: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, T, _ = qkv.shape
        keys = self.key_heads * self.key_dim
        q, k, v = mx.split(qkv, [keys, 2 * keys], axis=-1)
        return (q.reshape(B, T, self.key_heads, self.key_dim), k.reshape(B, T, self.key_heads, self.key_dim),
                v.reshape(B, T, self.value_heads, self.value_dim))

    def _decay(self, a: mx.array) -> mx.array:
        return -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + self.dt_bias)

    def replay(self, state: tuple[mx.array, ...] | None, inputs: tuple[mx.array, ...]) -> tuple[mx.array, ...] | None:
        """The state after the logged inputs (pre-convolution qkv, a, b) followed `state`: the
        convolution and the rule run again, without q, projections or outputs."""
        mixed, a, b = inputs
        if mixed.shape[1] == 0:
            return state
        conv, ssm = state if state is not None else (None, None)
        qkv, _ = causal_conv(mixed, self.conv1d.weight[:, 0, :], None, conv)
        _, k, v = self._split(nn.silu(qkv))
        _, k, v, g, beta = _heads(None, k, v, self._decay(a), mx.sigmoid(b.astype(mx.float32)))
        _, ssm = _scheduled(None, k, v, g, beta, ssm)
        return conv_state(conv, mixed, self.conv1d.kernel), ssm
