"""KV caches: what attention reads back instead of recomputing the past.

The protocol the models rely on: `offset` (tokens seen), `make_mask(queries,
window)` (called before the update, for the keys the update will return), and
`attend(q, k, v, scale, mask)` (store the new keys/values, then attend over all
kept ones). `trim(n)` rolls back the newest tokens for speculative decoding and
prompt reuse; `nbytes` is what the live entries occupy.

Keys and values are kept as tuples of arrays with the sequence on axis 2: one
float array, or MLX's (packed, scales, biases) triple when quantized, so the
growing and the rotating cache share one code path for both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .errors import InvalidOptionError
from .kernels import quantized_attention
from .models.layers import attention_mask

Parts = tuple[mx.array, ...]
KV_BITS = (4, 8)


def _encode(x: mx.array, bits: int | None, group_size: int) -> Parts:
    return (x,) if bits is None else tuple(mx.quantize(x, group_size=group_size, bits=bits))


def _slice(parts: Parts, start: int, stop: int) -> Parts:
    return tuple(p[..., start:stop, :] for p in parts)


def _take(parts: Parts, idx: np.ndarray) -> Parts:
    index = mx.array(idx.astype(np.int32))
    return tuple(mx.take(p, index, axis=2) for p in parts)


def _concat(a: Parts | None, b: Parts) -> Parts:
    return b if a is None else tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b))


def _write(buf: Parts, parts: Parts, start: int) -> None:
    for dst, src in zip(buf, parts):
        dst[..., start : start + src.shape[2], :] = src


def _grown(buf: Parts | None, used: int, like: Parts, capacity: int) -> Parts:
    """A buffer of `capacity` slots holding the first `used` entries of `buf`."""
    new = tuple(mx.zeros((*p.shape[:2], capacity, p.shape[3]), p.dtype) for p in like)
    if buf is not None and used:
        _write(new, _slice(buf, 0, used), 0)
    return new


class KVCache:
    """Growing cache, preallocated in `step`-token blocks so decode never
    concatenates per token; quantized to `bits` when given."""

    step = 256
    max_capacity: int | None = None

    def __init__(self, bits: int | None = None, group_size: int = 64):
        if bits is not None and bits not in KV_BITS:
            raise InvalidOptionError(f"kv_bits must be one of {KV_BITS}, got {bits}")
        self.bits, self.group_size = bits, group_size
        self.keys: Parts | None = None
        self.values: Parts | None = None
        self.offset = 0
        self.size = 0

    def _store(self, keys: Parts, values: Parts) -> tuple[Parts, Parts]:
        n = keys[0].shape[2]
        if self.keys is None or self.size + n > self.keys[0].shape[2]:
            capacity = (self.size + n + self.step - 1) // self.step * self.step
            capacity = min(capacity, max(self.max_capacity or capacity, self.size + n))
            self.keys = _grown(self.keys, self.size, keys, capacity)
            self.values = _grown(self.values, self.size, values, capacity)
        _write(self.keys, keys, self.size)
        _write(self.values, values, self.size)
        self.size += n
        self.offset += n
        return _slice(self.keys, 0, self.size), _slice(self.values, 0, self.size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        """Store a [B, kv_heads, T, head_dim] chunk; return every kept key and value."""
        return self._store(_encode(keys, self.bits, self.group_size), _encode(values, self.bits, self.group_size))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
        keys, values = self.update_and_fetch(k, v)
        if self.bits is None:
            return mx.fast.scaled_dot_product_attention(q, keys[0], values[0], scale=scale, mask=mask)
        return quantized_attention(q, self.keys, self.values, scale, mask, self.group_size, self.bits, self.size)

    def make_mask(self, queries: int, window: int | None):
        return attention_mask(queries, self.offset, window)

    def positions(self) -> np.ndarray:
        """The token position of each kept entry, in storage order."""
        return np.arange(self.size)

    def trim(self, n: int) -> int:
        """Forget the newest `n` tokens; returns how many were dropped."""
        n = min(self.size, n)
        self.size -= n
        self.offset -= n
        return n

    def can_trim_to(self, offset: int) -> bool:
        return offset <= self.offset

    @property
    def state(self) -> tuple[Parts, Parts]:
        """Kept keys and values in token order."""
        order = np.argsort(self.positions(), kind="stable")
        if self.keys is None:
            return (), ()
        if np.array_equal(order, np.arange(self.size)):
            return _slice(self.keys, 0, self.size), _slice(self.values, 0, self.size)
        return _take(self.keys, order), _take(self.values, order)

    @property
    def nbytes(self) -> int:
        """Bytes held by the live entries (keys and values, scales included)."""
        return self.size * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        return sum(p.nbytes // p.shape[2] for p in (*self.keys, *self.values))

    def meta(self) -> dict[str, Any]:
        return {"kind": "KVCache", "offset": self.offset, "bits": self.bits, "group_size": self.group_size}

    def restore(self, keys: Parts, values: Parts, offset: int, positions: np.ndarray) -> None:
        """Refill from token-ordered state (the inverse of `state` and `positions`)."""
        self.keys, self.values = None, None
        self.size, self.offset = 0, 0
        if keys:
            self._store(keys, values)
        self.offset = offset


class QuantizedKVCache(KVCache):
    """Growing cache whose keys and values are stored as `bits`-bit affine groups."""

    def __init__(self, bits: int = 8, group_size: int = 64):
        super().__init__(bits=bits, group_size=group_size)


class RotatingKVCache(KVCache):
    """Bounded cache for endless chats: once `max_size` entries are kept it
    overwrites the oldest, except the first `keep` tokens (attention sinks).

    Every query attends to the sinks plus the newest `max_size - keep` tokens up
    to itself. A multi-token update keeps `max_size - 1` old entries beside the
    new ones, so each new query still sees its full window and the update can be
    trimmed back exactly (speculative rollback).
    """

    def __init__(self, max_size: int, keep: int = 4, bits: int | None = None, group_size: int = 64):
        if not 0 <= keep < max_size:
            raise InvalidOptionError(f"rotating cache needs 0 <= keep < max_size, got keep={keep}, max_size={max_size}")
        super().__init__(bits=bits, group_size=group_size)
        self.max_size, self.keep = max_size, keep
        self.max_capacity = max_size
        self._pos = np.zeros(0, dtype=np.int64)
        self._next = 0

    @property
    def window(self) -> int:
        return self.max_size - self.keep

    def positions(self) -> np.ndarray:
        return self._pos

    def _ring(self, queries: int) -> bool:
        """A single token into a full ring overwrites the oldest non-sink slot in place."""
        return queries == 1 and self.size == self.max_size

    def _kept(self) -> np.ndarray:
        """Storage indices, in token order, of the old entries a compaction keeps."""
        order = np.argsort(self._pos, kind="stable")
        sinks = order[self._pos[order] < self.keep]
        rest = order[self._pos[order] >= self.keep]
        room = max(self.max_size - 1 - len(sinks), 0)
        return np.concatenate([sinks, rest[len(rest) - min(room, len(rest)) :]])

    def make_mask(self, queries: int, window: int | None):
        if queries == 1 and self.size <= self.max_size and (window is None or window >= self.window):
            return None  # every kept entry is a sink or inside the window by construction
        new = np.arange(self.offset, self.offset + queries)
        if self._ring(queries):
            kpos = self._pos.copy()
            kpos[self._next] = self.offset
        elif queries == 1 and self.size < self.max_size:
            kpos = np.concatenate([self._pos, new])
        else:
            kpos = np.concatenate([self._pos[self._kept()], new])
        kpos, qpos = kpos[None], new[:, None]
        allowed = (kpos <= qpos) & ((kpos < self.keep) | (kpos > qpos - self.window))
        if window is not None:
            allowed &= kpos > qpos - window
        return mx.array(allowed)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        k, v = _encode(keys, self.bits, self.group_size), _encode(values, self.bits, self.group_size)
        queries = keys.shape[2]
        if self._ring(queries):
            slot = self._next
            _write(self.keys, k, slot)
            _write(self.values, v, slot)
            self._pos[slot] = self.offset
            self.offset += 1
            self._next = slot + 1 if slot + 1 < self.max_size else int((self._pos < self.keep).sum())
            return self.keys, self.values
        if queries == 1 and self.size < self.max_size:
            self._pos = np.append(self._pos, self.offset)
            out = self._store(k, v)
            self._next = int((self._pos < self.keep).sum())
            return out
        kept = self._kept()
        self._set(_take(self.keys, kept) if len(kept) else None, _take(self.values, kept) if len(kept) else None,
                  self._pos[kept], self.offset)
        self.keys, self.values = _concat(self.keys, k), _concat(self.values, v)
        self._pos = np.concatenate([self._pos, np.arange(self.offset, self.offset + queries)])
        self.size = len(self._pos)
        self.offset += queries
        self._next = int((self._pos < self.keep).sum())
        return self.keys, self.values

    def _set(self, keys: Parts | None, values: Parts | None, positions: np.ndarray, offset: int) -> None:
        """Hold exactly these token-ordered entries."""
        self.keys, self.values = keys, values
        self._pos = positions.astype(np.int64)
        self.size = len(positions)
        self.offset = offset
        self._next = int((self._pos < self.keep).sum())

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        cut = self.offset - n
        kept = np.where(self._pos < cut)[0]
        kept = kept[np.argsort(self._pos[kept], kind="stable")]
        has = self.keys is not None and len(kept)
        self._set(_take(self.keys, kept) if has else None, _take(self.values, kept) if has else None,
                  self._pos[kept], cut)
        return n

    def can_trim_to(self, offset: int) -> bool:
        """Exact only while every token the shorter context needs is still kept."""
        if offset > self.offset:
            return False
        needed = set(range(min(self.keep, offset))) | set(range(max(offset - self.window, 0), offset))
        return needed <= set(self._pos.tolist())

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "kind": "RotatingKVCache", "max_size": self.max_size, "keep": self.keep}

    def restore(self, keys: Parts, values: Parts, offset: int, positions: np.ndarray) -> None:
        self._set(keys or None, values or None, positions, offset)


def pick_kv_group_size(head_dim: int, requested: int | None) -> int:
    """The quantization group for cached keys/values: as requested, else the
    largest MLX group size that divides the head dimension."""
    if requested is not None:
        if head_dim % requested:
            raise InvalidOptionError(f"kv group size {requested} does not divide the head dimension {head_dim}")
        return requested
    for size in (64, 32):
        if head_dim % size == 0:
            return size
    raise InvalidOptionError(f"head dimension {head_dim} cannot be quantized (needs a multiple of 32); drop kv_bits")


def make_cache(
    model,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    keep: int = 4,
) -> list[KVCache]:
    """One cache per layer: growing, or rotating when `max_kv_size` bounds memory;
    a sliding-window layer gets a rotating cache the size of its window."""
    group = pick_kv_group_size(model.config.head_dim, kv_group_size) if kv_bits else 64
    caches: list[KVCache] = []
    for layer in model.layers:
        sizes = [s for s in (max_kv_size, layer.window) if s]
        if not sizes:
            caches.append(KVCache(kv_bits, group))
        elif layer.window and min(sizes) == layer.window:
            caches.append(RotatingKVCache(layer.window, keep=0, bits=kv_bits, group_size=group))
        else:
            caches.append(RotatingKVCache(max_kv_size, keep=min(keep, max_kv_size - 1), bits=kv_bits, group_size=group))
    return caches


class PromptCache:
    """Per-layer caches plus the token ids they cover, so a new prompt only
    prefills what differs from the last one (multi-turn chat, shared prefixes)."""

    def __init__(self, caches: list[KVCache], tokens: Sequence[int] = (), metadata: dict[str, str] | None = None):
        self.caches = caches
        self.tokens = list(tokens)
        self.metadata = dict(metadata or {})

    @classmethod
    def for_model(cls, model, **options: Any) -> "PromptCache":
        return cls(make_cache(model, **options))

    @property
    def offset(self) -> int:
        return self.caches[0].offset if self.caches else 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def bounded(self) -> bool:
        """Every layer rotates, so the context may grow past the model's window."""
        return all(isinstance(c, RotatingKVCache) for c in self.caches)

    def feed(self, tokens: Sequence[int]) -> None:
        """Record tokens the model has just processed through these caches."""
        self.tokens.extend(int(t) for t in tokens)

    def trim(self, n: int) -> None:
        for c in self.caches:
            c.trim(n)
        del self.tokens[len(self.tokens) - n :]

    def prepare(self, prompt: Sequence[int]) -> list[int]:
        """Reuse the longest common prefix with what is cached and return the
        tokens still to prefill (always at least one, to get next-token logits)."""
        prompt = list(prompt)
        common = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        if all(c.can_trim_to(common) for c in self.caches):
            self.trim(len(self.tokens) - common)
            return prompt[common:]
        self.reset()
        return prompt

    def reset(self) -> None:
        for c in self.caches:
            c.trim(c.offset)
        self.tokens.clear()


def save_prompt_cache(path: str | Path, cache: PromptCache, metadata: dict[str, str] | None = None) -> None:
    """Write caches, their token ids and metadata as one safetensors file (atomically)."""
    arrays: dict[str, mx.array] = {"tokens": mx.array(np.array(cache.tokens, dtype=np.int32))}
    layers = []
    for i, c in enumerate(cache.caches):
        keys, values = c.state
        for j, (k, v) in enumerate(zip(keys, values)):
            arrays[f"{i}.keys.{j}"], arrays[f"{i}.values.{j}"] = k, v
        arrays[f"{i}.positions"] = mx.array(np.sort(c.positions()).astype(np.int32))
        layers.append({**c.meta(), "parts": len(keys)})
    meta = {"mlxinfer.layers": json.dumps(layers), "mlxinfer.metadata": json.dumps({**cache.metadata, **(metadata or {})})}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata=meta)
    tmp.replace(path)


def load_prompt_cache(path: str | Path) -> PromptCache:
    """Read a file written by `save_prompt_cache`."""
    from .errors import CorruptCheckpointError

    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        layers = json.loads(meta["mlxinfer.layers"])
        user = json.loads(meta["mlxinfer.metadata"])
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"'{path}' is not a prompt cache written by mlxinfer ({e})") from None
    caches: list[KVCache] = []
    for i, m in enumerate(layers):
        c: KVCache
        if m["kind"] == "RotatingKVCache":
            c = RotatingKVCache(m["max_size"], m["keep"], m["bits"], m["group_size"])
        else:
            c = KVCache(m["bits"], m["group_size"])
        keys = tuple(arrays[f"{i}.keys.{j}"] for j in range(m["parts"]))
        values = tuple(arrays[f"{i}.values.{j}"] for j in range(m["parts"]))
        c.restore(keys, values, m["offset"], np.array(arrays[f"{i}.positions"]).astype(np.int64))
        caches.append(c)
    return PromptCache(caches, np.array(arrays["tokens"]).tolist(), user)
