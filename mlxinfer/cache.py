"""KV caches: what attention reads back instead of recomputing the past.

The protocol every cache follows (the models rely on nothing else):
`offset` (tokens seen so far), `update_and_fetch(k, v) -> (k, v)` for a
[B, heads, T, head_dim] chunk, `make_mask(queries, window)`, `trim(n)` and
`nbytes`.
"""

from __future__ import annotations

import mlx.core as mx

from .models.layers import attention_mask


class KVCache:
    """Growing cache, preallocated in `step`-token blocks so decode never
    concatenates per token."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            self._grow(keys, values, prev + n)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        blocks = (needed + self.step - 1) // self.step * self.step
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, blocks, Dk), keys.dtype)
        new_v = mx.zeros((B, H, blocks, values.shape[3]), values.dtype)
        if self.keys is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def make_mask(self, queries: int, window: int | None):
        return attention_mask(queries, self.offset, window)

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (speculative rollback); returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def make_cache(model) -> list[KVCache]:
    """One cache per transformer layer of `model`."""
    return [KVCache() for _ in model.layers]
