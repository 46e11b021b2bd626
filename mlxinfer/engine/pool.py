"""A pool of prompt caches keyed by their tokens, so a request that extends or
shares a prefix with an earlier one prefills only the tokens that differ (the
building block for multi-turn chat over an API, where each turn resends the
whole conversation).

Reuse must be exact: a prefix means the same token ids at the same positions,
cut where the first id differs (mlx-lm once reused K/V past the point where
the prompts diverged), and a rotating cache that has overwritten tokens the
shorter context still needs is not reused at all. A recurrent layer's state
exists only at the lengths it was kept at (`cache.StateCache`: the end, the
checkpoints where each prefill started and each chunk ended), so an entry is
reused up to the longest of those within the common prefix. The pool hands out copies
and keeps its entries untouched, so one conversation can branch into many.

A prompt with images is matched by its cache keys (`prompt.image_keys`): each image's tokens
stand as a key from its pixels' digest, so the same text with another picture shares only the
tokens before that picture, and the same picture is reused like text.

Not thread-safe: the batch engine calls it from its one scheduling thread.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from ..models.cache import KV_GROUP_SIZES, KVCache, Parts, RotatingKVCache, StateCache
from ..models.prompt_cache import PromptCache, common_prefix
from ..base.checks import integer
from ..base.errors import InvalidOptionError
from ..models.lora import identity

CACHE_OPTIONS = ("max_kv_size", "kv_bits", "kv_group_size", "keep")

Layout = tuple[tuple[Any, ...], ...]


@dataclass
class PoolStats:
    """What the pool did and holds: `hits` are fetches that reused at least one
    token, `reused_tokens` how many prompt tokens those hits skipped."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    entries: int = 0
    nbytes: int = 0


@dataclass
class _Entry:
    """A pooled cache, the model that filled it, the cache layout it has and the adapter it ran
    with (`lora.identity`: never the same for two adapters, even of one name)."""

    model: weakref.ref
    layout: Layout
    adapter: int
    cache: PromptCache
    nbytes: int


class PromptCachePool:
    """Prompt caches kept up to `max_bytes` (least recently used dropped first).

    `fetch` returns a copy of the entry sharing the longest usable prefix with a
    prompt (or a fresh cache), which the caller runs and may `store` back when the
    request ends. Entries are matched by model and by the layout of their
    per-layer caches (kind, quantization, window), so a cache is only ever
    continued by the kind of cache that made it, and by the LoRA adapter that made it
    (K/V made with one adapter are not another's). `measure` gives an entry's size
    (default: its K/V bytes here)."""

    def __init__(self, max_bytes: int, measure: Callable[[PromptCache], int] | None = None):
        integer("max_bytes", max_bytes, 0)
        self.max_bytes = max_bytes
        self._measure = measure or cache_nbytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._serial = 0
        self._hits = self._misses = self._reused = 0

    @property
    def stats(self) -> PoolStats:
        return PoolStats(self._hits, self._misses, self._reused, len(self._entries), self._held())

    def fetch(self, model, prompt: Sequence[int], adapter: str | None = None, **cache_options: Any) -> PromptCache:
        """A cache the caller owns, ready for `cache.prepare(prompt)`: a copy of the
        pooled entry that shares the longest usable prefix with `prompt`, cut to
        that prefix and leaving at least one prompt token to run (the next-token
        logits come from it); else a fresh cache (a miss)."""
        fresh = PromptCache.for_model(model, adapter, **_checked(cache_options))
        layout, prompt, made_by = _layout(fresh), list(prompt), identity(model, adapter)
        best: tuple[int, int] | None = None  # (reused tokens, entry serial)
        for serial, entry in self._entries.items():
            if entry.model() is not model or entry.layout != layout or entry.adapter != made_by:
                continue
            n = entry.cache.reachable(min(common_prefix(entry.cache.tokens, prompt), len(prompt) - 1))
            if n > 0 and (best is None or n >= best[0]):
                best = (n, serial)  # `>=`: among equals the most recently used wins
        if best is None:
            self._misses += 1
            return fresh
        n, serial = best
        self._entries.move_to_end(serial)
        self._hits += 1
        self._reused += n
        copy = prefix_copy(self._entries[serial].cache, n)
        copy.adapter = adapter
        return copy

    def store(self, cache: PromptCache, model, **cache_options: Any) -> None:
        """Keep `cache` (the caller hands it over and must not run it again) under
        its tokens. Entries it covers (their tokens are a prefix of its own and it
        can be cut back to them) are dropped, as are those of models that no longer
        exist; then the least recently used go until the pool fits `max_bytes`.
        A cache larger than the bound, or holding no tokens, is not kept."""
        layout = _layout(PromptCache.for_model(model, **_checked(cache_options)))
        if _layout(cache) != layout:
            raise InvalidOptionError(
                "this cache was not made with these cache options; store it with the options it was fetched with"
            )
        tokens = cache.tokens
        if any(c.offset != len(tokens) for c in cache.caches):
            raise InvalidOptionError(
                f"this cache's layers cover {cache.offset} tokens but it lists {len(tokens)}; "
                "store only a cache that finished running"
            )
        size = self._measure(cache)
        if size > self.max_bytes or not tokens:
            return
        made_by = identity(model, cache.adapter)
        for serial, entry in list(self._entries.items()):
            old = entry.cache.tokens
            covered = (entry.model() is model and entry.layout == layout and entry.adapter == made_by
                       and common_prefix(old, tokens) == len(old))
            if entry.model() is None or (covered and cache.can_trim_to(len(old))):
                del self._entries[serial]  # covered, or its model is gone and nothing can fetch it
        self._serial += 1
        self._entries[self._serial] = _Entry(weakref.ref(model), layout, made_by, cache, size)
        while self._held() > self.max_bytes:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        self._entries.clear()

    def _held(self) -> int:
        return sum(e.nbytes for e in self._entries.values())


def prefix_copy(cache: PromptCache, length: int) -> PromptCache:
    """A new cache holding what `cache` holds for its first `length` tokens (which
    every layer must be able to trim to). Built from new array objects: MLX's
    `a[...] = b` rebinds the array object `a`, so two caches sharing one would see
    each other's writes; neither cache's later writes reach the other."""
    copy = PromptCache([_layer_copy(c, length) for c in cache.caches], cache.tokens[:length], cache.metadata,
                       cache.adapter)
    mx.eval([c.arrays() for c in copy.caches])  # its own memory, not a graph
    return copy


def _layer_copy(c: KVCache | StateCache, length: int) -> KVCache | StateCache:
    """Layer `c` as `trim` would leave it at `length` tokens, in a new cache object (a recurrent
    state is never written in place, so the copy may share its arrays)."""
    if isinstance(c, StateCache):
        return c.copy_at(length)
    m = c.meta()
    new: KVCache
    if m["kind"] == "RotatingKVCache":
        new = RotatingKVCache(m["max_size"], m["keep"], m["bits"], m["group_size"])
    else:
        new = KVCache(m["bits"], m["group_size"])
    keys, values = c.state
    positions = np.sort(c.positions())
    kept = int(np.searchsorted(positions, length))  # entries for the tokens before `length`
    new.restore(_head(keys, kept), _head(values, kept), length, positions[:kept])
    new.position_delta = c.position_delta if length else 0
    return new


def _head(parts: Parts, n: int) -> Parts:
    """The first `n` entries copied into new arrays (none at all when n is 0): a slice
    alone would be a view keeping the entry's whole buffer alive after it is evicted."""
    return tuple(mx.array(p[..., :n, :]) for p in parts) if n else ()


def _layout(cache: PromptCache) -> Layout:
    """Each layer's kind, quantization and window: what must agree for one cache to stand in for another."""
    return tuple(tuple(sorted((k, v) for k, v in c.meta().items() if k not in ("offset", "position_delta")))
                 for c in cache.caches)


def cache_nbytes(cache: PromptCache) -> int:
    """Bytes the cache's arrays occupy, spare preallocated slots and recurrent layers' checkpoints
    included (that is what it holds)."""
    return sum(c.held_bytes for c in cache.caches)


def _checked(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(CACHE_OPTIONS))
    if unknown:
        raise InvalidOptionError(f"unknown cache option {unknown[0]!r}; use one of {', '.join(CACHE_OPTIONS)}")
    if options.get("max_kv_size") is not None:
        integer("max_kv_size", options["max_kv_size"], 2)
    if options.get("kv_group_size") is not None and options["kv_group_size"] not in KV_GROUP_SIZES:
        raise InvalidOptionError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {options['kv_group_size']!r}")
    if "keep" in options:
        integer("keep", options["keep"], 0)
    return options
