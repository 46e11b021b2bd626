"""Attention over cached keys and values: the mask, the soft-capped variant, and the
dispatch between float K/V (MLX's fused kernel) and quantized K/V (our kernel or its
reference). Caches only store and return K/V (`update_and_fetch`); computing with them
happens here, so every attention module of every family goes through one place.

Batched decoding keeps one cache per sequence (each with its own length, position and
kind), and hands a layer a cache whose `rows` lists them. RoPE takes one offset per row;
storing and attending run per row with the very arithmetic a sequence gets alone: on the
CPU a decode step's float rows go together to one compiled primitive that reads each
row's buffer in place (`kernels.cpu_attention`), other rows to `attend` one by one. The
projections around attention run on the whole batch at once.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from ..kernels import cpu_attention, quantized_attention

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


def with_spans(mask: Mask, queries: int, offset: int, spans: tuple[tuple[int, int], ...]) -> Mask:
    """`mask` for `queries` new tokens after `offset` cached ones, where the tokens of each span
    [start, end) (chunk positions) also see the later tokens of their span (Gemma 3's images
    attend to themselves both ways; transformers' token_type_ids mask). Only keys ahead of a
    query are added: keys behind it keep the causal rule and the layer's window, as
    transformers keeps the window over the bidirectional part too. The new keys are the last
    `queries` columns of every cache's mask (the cache appends them after what it keeps)."""
    if not spans or queries == 1:
        return mask
    if mask is None or isinstance(mask, str):
        mask = mx.arange(offset + queries)[None] <= mx.arange(offset, offset + queries)[:, None]
    group = np.full(queries, -1)
    for i, (start, end) in enumerate(spans):
        group[start:end] = i
    index = np.arange(queries)
    ahead = (group[:, None] == group[None]) & (group[:, None] >= 0) & (index[None] > index[:, None])
    keys = mask.shape[-1]
    return mask | mx.array(np.concatenate([np.zeros((queries, keys - queries), bool), ahead], axis=1))


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
           softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """Store k/v in `cache` (when there is one) and attend q over everything it keeps;
    `sinks` [heads] are learned logits each head's softmax also spreads over (gpt-oss).

    Quantized K/V are read in place by `kernels.quantized_attention` (no dequantized
    copy of the whole cache per step); float K/V go to MLX's fused kernel, which takes
    the sinks. The quantized kernel has no sink term, so with sinks a quantized cache is
    dequantized for the fused kernel instead.
    """
    if softcap is not None:
        if cache is not None:
            k, v = stored_kv(cache, k, v)
        return softcapped_attention(q, k, v, scale, mask, softcap)
    if cache is not None and (cache.bits is None or sinks is not None):
        k, v = stored_kv(cache, k, v)
    elif cache is not None:
        cache.update_and_fetch(k, v)
        return quantized_attention(q, cache.keys, cache.values, scale, mask, cache.group_size, cache.bits,
                                   cache.size)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def position(cache) -> int:
    """The RoPE position of a cache's next token: its offset plus the `position_delta` a
    vision-language prompt left (Qwen-VL's images take fewer positions than tokens; else 0)."""
    return cache.offset + cache.position_delta


def offsets(cache) -> int | list[int]:
    """Where the new tokens' RoPE positions start: one offset, or one per row for a batch (RoPE takes either)."""
    if cache is None:
        return 0
    rows = getattr(cache, "rows", None)
    return position(cache) if rows is None else [position(c) for c in rows]


def attention(q: mx.array, k: mx.array, v: mx.array, cache, mask, scale: float,
              softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """Store k/v and attend, for one sequence or a batch (a cache with `rows`, one mask
    per row): a decode step over per-sequence caches goes through `decode_rows`, the
    rest (prefill, soft-capping, sinks, one cache holding many rows) through `attend`
    (the CPU primitive of `decode_rows` has no sink term)."""
    rows = getattr(cache, "rows", None)
    one_cache_many_rows = rows is None and q.shape[0] != 1  # a plain [B, ...] cache, not per-row buffers
    if (cache is not None and q.shape[2] == 1 and softcap is None and sinks is None and not one_cache_many_rows
            and cpu_attention.available(q)):
        return decode_rows(q, k, v, rows or [cache], mask if rows is not None else [mask], scale)

    def one(qi: mx.array, ki: mx.array, vi: mx.array, c, m: Mask) -> mx.array:
        return attend(qi, ki, vi, c, scale, m, softcap, sinks)

    return per_row(one, cache, mask, q, k, v)


def decode_rows(q: mx.array, k: mx.array, v: mx.array, caches: list, masks: list, scale: float) -> mx.array:
    """One decode step, row b over caches[b]: the rows with a float cache and no mask are
    attended by the CPU primitive together (one op per layer instead of one fused-attention
    call per row, each ~40 µs on the CPU however small), the others by `attend` alone.
    Which way a row goes depends on that row only, so its numbers never depend on its batch."""
    n = len(caches)
    fast = [b for b in range(n) if masks[b] is None and caches[b].bits is None]
    ks, vs = ([a] if n == 1 else mx.split(a, n) for a in (k, v))
    qs = q if len(fast) == n else mx.split(q, n)  # rows of q only where some go to `attend`
    outs: list[mx.array] = [q] * n  # placeholders, each replaced below
    for b in range(n):
        if b in fast:
            caches[b].store(ks[b], vs[b])
        else:
            outs[b] = attend(qs[b], ks[b], vs[b], caches[b], scale, masks[b])
    if fast:
        qf = q if len(fast) == n else mx.concatenate([qs[b] for b in fast])
        o = cpu_attention.decode_attention(qf, [(caches[b].keys[0], caches[b].values[0], caches[b].size)
                                                for b in fast], scale)
        for b, ob in zip(fast, [o] if len(fast) == 1 else mx.split(o, len(fast))):
            outs[b] = ob
    return outs[0] if n == 1 else mx.concatenate(outs, axis=0)


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
