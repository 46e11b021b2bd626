"""Attention over cached keys and values: the mask, the soft-capped variant, and the
dispatch between float K/V (MLX's fused kernel) and quantized K/V (our kernel or its
reference). Caches only store and return K/V (`update_and_fetch`); computing with them
happens here, so every attention module of every family goes through one place.

Batched decoding keeps one cache per sequence (each with its own length, position and
kind), and hands a layer a cache whose `rows` lists them: `per_row` runs the
position-dependent part (RoPE, store, attend) row by row with the very arithmetic a
sequence gets alone, while the projections around it run on the whole batch at once.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..kernels import quantized_attention

Mask = mx.array | str | None


def attention_mask(queries: int, offset: int, window: int | None) -> Mask:
    """Causal (optionally windowed) mask for `queries` new tokens after `offset` cached ones.

    A window keeps `window` keys including the query's own position, as
    transformers' sliding-window mask does.
    """
    if window is None or offset + queries <= window:
        return "causal" if queries > 1 else None
    q = mx.arange(offset, offset + queries)[:, None]
    k = mx.arange(offset + queries)[None]
    return (k <= q) & (k > q - window)


def softcapped_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask, cap: float) -> mx.array:
    """Attention whose scores pass through `cap * tanh(score / cap)` before the mask
    (Gemma 2); the fused kernel has no hook for that, so this one is spelled out."""
    B, H, T, D = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    q = (q * scale).reshape(B, kv_heads, H // kv_heads, T, D)
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str):
        mask = mx.arange(S)[None] <= mx.arange(S - T, S)[:, None]
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ mx.expand_dims(v, 2)).reshape(B, H, T, D)


def stored_kv(cache, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
    """Store new keys/values in `cache`; return every kept one as a float array
    (for attention that needs them as floats: soft-capping, latent attention)."""
    keys, values = cache.update_and_fetch(k, v)
    if len(keys) == 1:
        return keys[0], values[0]
    params = {"group_size": cache.group_size, "bits": cache.bits}
    return mx.dequantize(*keys, **params), mx.dequantize(*values, **params)


def attend(q: mx.array, k: mx.array, v: mx.array, cache, scale: float, mask: Mask,
           softcap: float | None = None) -> mx.array:
    """Store k/v in `cache` (when there is one) and attend q over everything it keeps.

    Quantized K/V are read in place by `kernels.quantized_attention` (no dequantized
    copy of the whole cache per step); float K/V go to MLX's fused kernel.
    """
    if softcap is not None:
        if cache is not None:
            k, v = stored_kv(cache, k, v)
        return softcapped_attention(q, k, v, scale, mask, softcap)
    if cache is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    keys, values = cache.update_and_fetch(k, v)
    if cache.bits is None:
        return mx.fast.scaled_dot_product_attention(q, keys[0], values[0], scale=scale, mask=mask)
    return quantized_attention(q, cache.keys, cache.values, scale, mask, cache.group_size, cache.bits, cache.size)


def offsets(cache) -> int | list[int]:
    """Where the new tokens start: one offset, or one per row for a batch (RoPE takes either)."""
    if cache is None:
        return 0
    rows = getattr(cache, "rows", None)
    return cache.offset if rows is None else [c.offset for c in rows]


def per_row(one: Callable[..., mx.array], cache, mask, *arrays: mx.array) -> mx.array:
    """`one(*arrays, cache, mask)`, or, for a batch of sequences (a cache with `rows`,
    and one mask per row), the same on each row with that row's cache and mask,
    stacked back into the batch. Rows are cut with one split per array: every op
    costs a fixed dispatch on the CPU, and this runs per layer and step."""
    rows = getattr(cache, "rows", None)
    if rows is None:
        return one(*arrays, cache, mask)
    split = [mx.split(a, len(rows)) for a in arrays]
    outs = [one(*(s[i] for s in split), c, m) for i, (c, m) in enumerate(zip(rows, mask))]
    return mx.concatenate(outs, axis=0)
