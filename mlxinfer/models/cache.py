"""KV caches: what attention reads back instead of recomputing the past.

The protocol the models rely on: `offset` (tokens seen), `make_mask(queries,
window)` (called before the update, for the keys the update will return), and
`update_and_fetch(keys, values)` (store the new keys/values, return all kept ones);
attention itself is computed in `models.attention`. `trim(n)` rolls back the newest
tokens for speculative decoding and prompt reuse; `nbytes` is what the live entries
occupy. A sequence's caches, and running a model through them, are `prompt_cache`; the
file format, `prompt_file`.

Keys and values are kept as tuples of arrays with the sequence on axis 2: one
float array, or MLX's (packed, scales, biases) triple when quantized, so the
growing and the rotating cache share one code path for both.

Recurrent layers (linear attention, short convolutions) keep a fixed-size state
instead (`StateCache`): the same `offset`, `trim`, `can_trim_to` and snapshots, with
`state` / `update` in place of keys and values.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from ..base.errors import InvalidOptionError
from .attention import attention_mask

Parts = tuple[mx.array, ...]
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize accepts


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
    concatenates per token; quantized to `bits` when given.

    `position_delta` is what RoPE adds to `offset` for the tokens after a vision-language
    prompt (Qwen-VL's M-RoPE: an image takes fewer positions than tokens); the prefill of such a
    prompt sets it, trimming keeps it (the tokens before stay where they were) and emptying the
    cache clears it."""

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
        self.position_delta = 0

    def _store(self, keys: Parts, values: Parts) -> None:
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

    def _live(self) -> tuple[Parts, Parts]:
        """The kept keys and values: the first `size` slots of the buffers, in storage order."""
        return _slice(self.keys, 0, self.size), _slice(self.values, 0, self.size)

    def store(self, keys: mx.array, values: mx.array) -> None:
        """Store a [B, kv_heads, T, head_dim] chunk, for a caller that reads the buffers
        (`keys`, `values`, their first `size` slots) itself."""
        self._store(_encode(keys, self.bits, self.group_size), _encode(values, self.bits, self.group_size))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        """Store a [B, kv_heads, T, head_dim] chunk; return every kept key and value."""
        self.store(keys, values)
        return self._live()

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
        if not self.offset:
            self.position_delta = 0
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
            return self._live()
        return _take(self.keys, order), _take(self.values, order)

    @property
    def nbytes(self) -> int:
        """Bytes held by the live entries (keys and values, scales included)."""
        return self.size * self.bytes_per_token

    @property
    def held_bytes(self) -> int:
        """Bytes the buffers occupy, spare preallocated slots included."""
        return sum(p.nbytes for p in self.arrays())

    def arrays(self) -> list[mx.array]:
        """What evaluating the cache computes: its key and value buffers."""
        return [*(self.keys or ()), *(self.values or ())]

    def checkpoint(self) -> None:
        """Nothing to keep: keys and values can be cut back at any length."""

    @property
    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        return sum(p.nbytes // p.shape[2] for p in (*self.keys, *self.values))

    def meta(self) -> dict[str, Any]:
        return {"kind": "KVCache", "offset": self.offset, "bits": self.bits, "group_size": self.group_size,
                "position_delta": self.position_delta}

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
            self._store(k, v)
            self._next = int((self._pos < self.keep).sum())
            return self._live()
        kept = self._kept()
        self._set(_take(self.keys, kept) if len(kept) else None, _take(self.values, kept) if len(kept) else None,
                  self._pos[kept], self.offset)
        self.keys, self.values = _concat(self.keys, k), _concat(self.values, v)
        self._pos = np.concatenate([self._pos, np.arange(self.offset, self.offset + queries)])
        self.size = len(self._pos)
        self.offset += queries
        self._next = int((self._pos < self.keep).sum())
        return self.keys, self.values

    def store(self, keys: mx.array, values: mx.array) -> None:
        self.update_and_fetch(keys, values)

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
        if not cut:
            self.position_delta = 0
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


State = tuple[mx.array, ...]
Replay = Callable[[State | None, State], State | None]


class StateCache:
    """The fixed-size state of a recurrent layer (a Gated DeltaNet's matrices and convolution
    inputs, a short convolution's last inputs): whatever the length of the context, one
    `state`, replaced by each `update` (None before the first token).

    A state cannot be cut back the way keys and values can: it folds every token in. Going
    back to an earlier length uses what is kept for that:

    - recent updates are replayed: the cache keeps the state from before them and the
      inputs each update consumed (at most `replay_tokens` tokens, or the last update if it
      was longer), and the layer's `replay` rebuilds the state after any prefix of them. That
      is what rolls back a speculative verification to its accepted drafts, and an interrupted
      step, exactly as if only those tokens had been fed; it costs the recurrence over a few
      tokens, never the model.
    - checkpoints: `checkpoint()` keeps the state at the current length. `PromptCache.prefill`
      takes one where a prefill starts (the end of the previous turn: what /undo and a branching
      conversation return to) and after every chunk it runs (the end of a prompt: what an agent
      loop's next turn shares when its template rewrites the last reply). At most
      `max_checkpoints` are kept, thinned where they are densest (the newest always stays), as
      each costs one state of memory.
    - anywhere else: recompute. `PromptCache.reachable` finds the longest length every layer
      can return to exactly and the prompt is prefilled again from there.

    Recomputing from checkpoints rather than checkpointing every token: a state is as large as
    hundreds of tokens of K/V, so a snapshot per token would cost more memory than attention;
    a few at the places conversations return to make those returns cheap.
    """

    max_checkpoints = 8
    replay_tokens = 32

    def __init__(self):
        self.offset = 0
        self.state: State | None = None
        self.checkpoints: dict[int, State | None] = {}
        self._start = 0  # the replay log: the state at `_start` tokens and the inputs since
        self._base: State | None = None
        self._inputs: list[State] = []
        self._replay: weakref.WeakMethod | None = None

    def update(self, state: State, inputs: State, replay: Replay) -> None:
        """The state after the new tokens; `inputs` (arrays [B, T, ...], T the new tokens) and
        `replay` (a bound method of the layer, held weakly) rebuild it after any prefix of them."""
        logged = self.offset - self._start
        if logged and logged + inputs[0].shape[1] > self.replay_tokens:
            self._start, self._base, self._inputs = self.offset, self.state, []
        self._inputs.append(inputs)
        self._replay = weakref.WeakMethod(replay)
        self.state = state
        self.offset += inputs[0].shape[1]

    def checkpoint(self) -> None:
        """Keep the state at the current length (see the class docstring)."""
        if self.offset == 0 or self.offset in self.checkpoints:
            return
        self.checkpoints[self.offset] = self.state
        while len(self.checkpoints) > self.max_checkpoints:
            kept = sorted(self.checkpoints)
            # drop the one whose loss leaves the smallest gap between its neighbours (never the newest)
            gaps = [kept[i + 1] - (kept[i - 1] if i else 0) for i in range(len(kept) - 1)]
            del self.checkpoints[kept[gaps.index(min(gaps))]]

    def _replayable(self, offset: int) -> bool:
        return self._start <= offset <= self.offset and (offset == self._start or self._replay() is not None)

    def can_trim_to(self, offset: int) -> bool:
        return 0 <= offset <= self.offset and (offset in (0, self.offset) or offset in self.checkpoints
                                               or self._replayable(offset))

    def state_at(self, offset: int) -> State | None:
        """The state after the first `offset` tokens (`can_trim_to(offset)` must hold)."""
        if offset == self.offset:
            return self.state
        if offset in self.checkpoints:
            return self.checkpoints[offset]
        if offset == 0:
            return None
        if not self._replayable(offset):
            raise InvalidOptionError(f"this state cache cannot go back to {offset} tokens; "
                                     "check can_trim_to first")
        if offset == self._start:
            return self._base
        inputs = self._logged(offset - self._start)
        return self._replay()(self._base, inputs)

    def _logged(self, n: int) -> State:
        """The first `n` logged tokens' inputs, joined."""
        parts, left = [], n
        for inputs in self._inputs:
            take = min(left, inputs[0].shape[1])
            parts.append(tuple(x[:, :take] for x in inputs))
            left -= take
            if not left:
                break
        return tuple(mx.concatenate(xs, axis=1) if len(xs) > 1 else xs[0] for xs in zip(*parts))

    def trim(self, n: int) -> int:
        """Go back `n` tokens (to a length `can_trim_to` allows); returns how many were dropped."""
        n = min(n, self.offset)
        if not n:
            return 0
        target = self.offset - n
        state = self.state_at(target)
        if self._start <= target:
            if target > self._start:
                self._inputs = [self._logged(target - self._start)]
            else:
                self._inputs = []
        else:  # back before the log: it starts again here
            self._start, self._base, self._inputs = target, state, []
        self.state, self.offset = state, target
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= target}
        return n

    def copy_at(self, offset: int) -> StateCache:
        """A new cache holding this one's state after `offset` tokens and its checkpoints up to there."""
        new = StateCache()
        new.state = new._base = self.state_at(offset)
        new.offset = new._start = offset
        new.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= offset}
        return new

    def arrays(self) -> list[mx.array]:
        """What evaluating the cache computes: its state."""
        return list(self.state or ())

    @property
    def nbytes(self) -> int:
        """Bytes of the state (the same at every length)."""
        return sum(a.nbytes for a in self.state or ())

    @property
    def held_bytes(self) -> int:
        """Bytes the cache keeps alive: the state, its checkpoints and the replay log."""
        seen: dict[int, int] = {}
        for part in (self.state, self._base, *self.checkpoints.values(), *self._inputs):
            for a in part or ():
                seen[id(a)] = a.nbytes
        return sum(seen.values())

    bytes_per_token = 0

    def meta(self) -> dict[str, Any]:
        return {"kind": "StateCache", "offset": self.offset}

    def restore(self, state: State | None, offset: int) -> None:
        """Hold `state` after `offset` tokens (a cache read back from a file)."""
        self.state = self._base = state or None
        self.offset = self._start = offset
        self.checkpoints, self._inputs = {}, []


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
) -> list[KVCache | StateCache]:
    """One cache per layer: growing, or rotating when `max_kv_size` bounds memory;
    a sliding-window layer gets a rotating cache the size of its window, a recurrent
    layer a StateCache."""
    group = pick_kv_group_size(model.config.head_dim, kv_group_size) if kv_bits else 64
    caches: list[KVCache | StateCache] = []
    for layer in model.layers:
        if not layer.attends:  # a recurrent layer: its state, whatever the K/V options
            caches.append(StateCache())
            continue
        sizes = [s for s in (max_kv_size, layer.window) if s]
        if not sizes:
            caches.append(KVCache(kv_bits, group))
        elif layer.window and min(sizes) == layer.window:
            caches.append(RotatingKVCache(layer.window, keep=0, bits=kv_bits, group_size=group))
        else:
            caches.append(RotatingKVCache(max_kv_size, keep=min(keep, max_kv_size - 1), bits=kv_bits, group_size=group))
    return caches


class LayerRows:
    """One layer's caches for a batch of sequences, one cache per sequence, as a model
    layer sees them: masks are per row, and attention runs row by row
    (`models.attention.per_row`), so each sequence keeps its own length and cache kind."""

    def __init__(self, rows: Sequence[KVCache]):
        self.rows = list(rows)

    def make_mask(self, queries: int, window: int | None) -> list:
        return [c.make_mask(queries, window) for c in self.rows]


