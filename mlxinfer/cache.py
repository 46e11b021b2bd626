"""KV caches: what attention reads back instead of recomputing the past.

The protocol the models rely on: `offset` (tokens seen), `make_mask(queries,
window)` (called before the update, for the keys the update will return), and
`update_and_fetch(keys, values)` (store the new keys/values, return all kept ones);
attention itself is computed in `models.attention`. `trim(n)` rolls back the newest
tokens for speculative decoding and prompt reuse; `nbytes` is what the live entries
occupy. `PromptCache` is the one place that runs a model over tokens through the
per-layer caches and keeps its token list in step with them.

Keys and values are kept as tuples of arrays with the sequence on axis 2: one
float array, or MLX's (packed, scales, biases) triple when quantized, so the
growing and the rotating cache share one code path for both.

Recurrent layers (linear attention, short convolutions) keep a fixed-size state
instead (`StateCache`): the same `offset`, `trim`, `can_trim_to` and snapshots, with
`state` / `update` in place of keys and values.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from .checks import INDEX_MAX, is_integer
from .errors import CorruptCheckpointError, InvalidOptionError, MlxinferError
from .files import replacing
from .loading import safetensors_header
from .models.attention import attention_mask
from .models.lora import selecting
from .models.vision import Embedded
from .slices import Slices, run_whole

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


class PromptCache:
    """Per-layer caches plus the token ids they cover, so a new prompt only
    prefills what differs from the last one (multi-turn chat, shared prefixes).

    It is also the one place that runs a model over tokens (`run`, `prefill`, and
    `run_rows` for a batch): the per-layer caches and the token list advance together,
    and a run interrupted while its graph is being built is rolled back, so the two
    never disagree whatever stops a generation.

    `adapter` is the LoRA adapter its runs use (None: the model's default, the base unless one
    was loaded as the default): its K/V depend on it, so it belongs to the cache."""

    def __init__(self, caches: list[KVCache], tokens: Sequence[int] = (), metadata: dict[str, str] | None = None,
                 adapter: str | None = None):
        self.caches = caches
        self.adapter = adapter
        self._tokens = list(tokens)
        self._pending: list[mx.array] = []  # ids run as arrays whose values were not read yet
        self.metadata = dict(metadata or {})
        self._fits: int | None = None  # id() of the model `check_fits` last accepted

    @property
    def tokens(self) -> list[int]:
        """The token ids the caches cover (ids still being computed are read here, once)."""
        if self._pending:
            self._tokens.extend(t for ids in self._pending for t in ids.tolist())
            self._pending.clear()
        return self._tokens

    def run(self, model, tokens: Sequence[int] | mx.array, embedded: Embedded | None = None,
            keys: Sequence[int] | None = None) -> mx.array:
        """Run `tokens` through `model` and these caches; their logits [T, V], lazily.
        `tokens` may be a 1-D array not computed yet (pipelined decoding: the next step
        is queued before this one's token is read); its ids join `tokens` when read.
        `embedded`: the model's inputs for these tokens with their images in; `keys`: what
        the cache lists for them instead of their ids (an image's tokens stand as its key)."""
        ids = tokens if isinstance(tokens, mx.array) else mx.array([int(t) for t in tokens])
        extra = {} if embedded is None else {"embedded": embedded}
        try:
            with selecting(model, [self.adapter]):
                logits = model(ids[None], cache=self.caches, **extra)
        except BaseException:
            self._settle()
            raise
        if isinstance(tokens, mx.array):
            self._pending.append(tokens)
        else:
            self._tokens.extend(int(t) for t in (tokens if keys is None else keys))
        return logits[0]

    def prefill(self, model, tokens: Sequence[int], step: int = 512, embedded: Embedded | None = None,
                keys: Sequence[int] | None = None) -> None:
        """Run prompt tokens in chunks of at most `step` (bounded memory), evaluating
        only the caches: the LM head's logits for these positions are never computed.
        Recurrent layers keep their state where the prefill starts and after each chunk
        (`StateCache.checkpoint`): the lengths a later prompt most likely shares.
        With `embedded` (these tokens' inputs, images in) a chunk never ends inside a span that
        attends both ways (it runs longer or stops before it), and every layer takes the prompt's
        position delta; `keys` are what the cache lists for the tokens (`run`)."""
        run_whole(self.prefill_slices(model, tokens, step, embedded, keys))

    def prefill_slices(self, model, tokens: Sequence[int], step: int = 512, embedded: Embedded | None = None,
                       keys: Sequence[int] | None = None) -> Slices[None]:
        """`prefill`, yielding after each chunk (`slices`)."""
        self.checkpoint()
        if embedded is not None:
            self.set_position_delta(embedded.position_delta)
        i = 0
        while i < len(tokens):
            j = i + step if embedded is None else chunk_end(i, i + step, embedded.bidirectional)
            j = min(j, len(tokens))
            part = None if embedded is None else embedded.slice(i, j)
            self.run(model, tokens[i:j], part, None if keys is None else keys[i:j])
            mx.eval([c.arrays() for c in self.caches])
            self.checkpoint()
            i = j
            yield

    def set_position_delta(self, delta: int) -> None:
        """What positions after this prompt add to the cache offset, on every layer (M-RoPE)."""
        for c in self.caches:
            c.position_delta = delta

    def checkpoint(self) -> None:
        """Snapshot every recurrent layer's state at the current length."""
        for c in self.caches:
            c.checkpoint()

    def _length(self) -> int:
        return len(self._tokens) + sum(ids.size for ids in self._pending)

    def _settle(self) -> None:
        """After a run stopped mid-graph some layers may hold tokens the list does not:
        trim them back, or start over where a layer cannot (a rotation overwrote)."""
        n = self._length()
        if all(c.offset == n for c in self.caches):
            return
        if all(c.offset >= n and c.can_trim_to(n) for c in self.caches):
            for c in self.caches:
                c.trim(c.offset - n)
        else:
            self.reset()

    def check_fits(self, model) -> None:
        """Refuse (CorruptCheckpointError) a cache that another model made, or a loaded file
        that lies: a layer count, K/V shape or dtype the model does not produce, or a token
        id outside its vocabulary would otherwise crash inside MLX or read out of bounds.
        Checked once per model; K/V layouts are learned by running the model on one token."""
        if self._fits == id(model):
            return
        problem = self._misfit(model)
        if problem:
            raise CorruptCheckpointError(f"this prompt cache does not fit the model: {problem}; start a new cache")
        self._fits = id(model)

    def _misfit(self, model) -> str | None:
        if len(self.caches) != len(model.layers):
            return f"it has {len(self.caches)} layers, the model {len(model.layers)}"
        vocab = model.config.vocab_size
        if any(t >= vocab or (t < 0 and model.image_token_id is None) for t in self.tokens):
            return f"it holds token ids outside the vocabulary of {vocab}"
        if not any(c.arrays() for c in self.caches):
            return None
        probe = PromptCache.for_model(model)
        probe.run(model, [0])
        for i, (c, fresh) in enumerate(zip(self.caches, probe.caches)):
            if isinstance(c, StateCache) or isinstance(fresh, StateCache):
                problem = _state_misfit(c, fresh)
                if problem:
                    return f"layer {i}'s {problem}"
                continue
            for name, have, want in (("keys", c.keys, fresh.keys), ("values", c.values, fresh.values)):
                if have is None:
                    continue
                got, made = _layout(have, c.bits, c.group_size), _layout(want, None, 0)
                if got != made:
                    return f"layer {i}'s {name} are (heads, dims, dtype) {got}, the model makes {made}"
        return None

    @classmethod
    def for_model(cls, model, adapter: str | None = None, **options: Any) -> "PromptCache":
        return cls(make_cache(model, **options), adapter=adapter)

    def use_adapter(self, adapter: str | None) -> None:
        """Run with `adapter` from now on; what it holds was made with another, so it empties."""
        if adapter != self.adapter:
            self.reset()
            self.adapter = adapter

    @property
    def offset(self) -> int:
        return self.caches[0].offset if self.caches else 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def bounded(self) -> bool:
        """Every layer rotates or keeps a fixed-size state, so the context may grow past the model's window."""
        return all(isinstance(c, (RotatingKVCache, StateCache)) for c in self.caches)

    def trim(self, n: int) -> None:
        """Forget the newest `n` tokens (speculative rollback, prefix reuse)."""
        tokens = self.tokens
        for c in self.caches:
            c.trim(n)
        del tokens[len(tokens) - n :]

    def can_trim_to(self, length: int) -> bool:
        """Whether every layer still holds what a context of the first `length` tokens needs."""
        return all(c.can_trim_to(length) for c in self.caches)

    def reachable(self, length: int) -> int:
        """The longest context of at most `length` tokens every layer can go back to exactly:
        `length` itself where K/V can be cut there, else a recurrent layer's checkpoint below it
        (the tokens after it are recomputed), else 0."""
        marks = {m for c in self.caches if isinstance(c, StateCache) for m in c.checkpoints if m < length}
        for n in sorted({length, *marks}, reverse=True):
            if self.can_trim_to(n):
                return n
        return 0

    def prepare(self, prompt: Sequence[int]) -> list[int]:
        """Reuse the longest common prefix with what is cached (that every layer can go back
        to: `reachable`) and return the tokens still to prefill (always at least one, to get
        next-token logits)."""
        prompt = list(prompt)
        keep = self.reachable(min(common_prefix(self.tokens, prompt), len(prompt) - 1))
        if keep:
            self.trim(len(self.tokens) - keep)
            return prompt[keep:]
        self.reset()
        return prompt

    def reset(self) -> None:
        for c in self.caches:
            c.trim(c.offset)
        self._tokens.clear()
        self._pending.clear()


def chunk_end(start: int, end: int, spans: Sequence[tuple[int, int]]) -> int:
    """Where a prefill chunk from `start` meant to end at `end` ends so that no [s, e) span that
    attends both ways is split: before a span it would cut into, or after one it starts in."""
    for s, e in spans:
        if s < end < e:
            return s if s > start else e
    return end


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (same ids at the same positions)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_rows(model, caches: Sequence[PromptCache], tokens: mx.array) -> mx.array:
    """One decode step for a batch: token `tokens[i]` runs through `caches[i]`, all in one
    forward pass; next-token logits [B, V], lazily (ids are read back as in `run`). One row
    runs as a lone sequence does (`PromptCache.run`): the same arithmetic, without the split."""
    if len(caches) == 1:
        return caches[0].run(model, tokens)[-1:]
    layers = [LayerRows([c.caches[i] for c in caches]) for i in range(len(model.layers))]
    try:
        with selecting(model, [c.adapter for c in caches]):
            logits = model(tokens[:, None], cache=layers)
    except BaseException:
        for c in caches:
            c._settle()
        raise
    for i, c in enumerate(caches):
        c._pending.append(tokens[i : i + 1])
    return logits[:, -1]


def _state_misfit(have: KVCache | StateCache, want: KVCache | StateCache) -> str | None:
    """Why a saved layer cannot stand in for the model's (a recurrent state where it attends,
    or states of other shapes or dtypes), or None."""
    if type(have) is not type(want) and StateCache in (type(have), type(want)):
        return f"cache is a {type(have).__name__}, the model keeps a {type(want).__name__}"
    got = [(a.shape[1:], str(a.dtype)) for a in have.state or ()]
    made = [(a.shape[1:], str(a.dtype)) for a in want.state or ()]
    if got and got != made:
        return f"state is (shape, dtype) {got}, the model makes {made}"
    return None


def _layout(parts: Parts, bits: int | None, group_size: int) -> tuple[int, int, str]:
    """(heads, dims per head, float dtype) of cached keys or values, quantized or not."""
    if bits is None:
        return parts[0].shape[1], parts[0].shape[3], str(parts[0].dtype)
    return parts[1].shape[1], parts[1].shape[3] * group_size, str(parts[1].dtype)


def save_prompt_cache(path: str | Path, cache: PromptCache, metadata: dict[str, str] | None = None) -> None:
    """Write caches, their token ids and metadata as one safetensors file (atomically). A cache
    that holds an image is refused: its image tokens are listed as keys of the pixels (negative,
    `generate.image_key`), which the file's token ids cannot carry."""
    if any(t < 0 for t in cache.tokens):
        raise InvalidOptionError("a prompt cache that holds an image cannot be saved; save one of a text prompt")
    arrays: dict[str, mx.array] = {"tokens": mx.array(np.array(cache.tokens, dtype=np.int32))}
    layers = []
    for i, c in enumerate(cache.caches):
        if isinstance(c, StateCache):
            for j, a in enumerate(c.state or ()):
                arrays[f"{i}.state.{j}"] = a
            layers.append({**c.meta(), "parts": len(c.state or ())})
            continue
        keys, values = c.state
        for j, (k, v) in enumerate(zip(keys, values)):
            arrays[f"{i}.keys.{j}"], arrays[f"{i}.values.{j}"] = k, v
        arrays[f"{i}.positions"] = mx.array(np.sort(c.positions()).astype(np.int32))
        layers.append({**c.meta(), "parts": len(keys)})
    meta = {"mlxinfer.layers": json.dumps(layers), "mlxinfer.metadata": json.dumps({**cache.metadata, **(metadata or {})})}
    with replacing(Path(path), suffix=".safetensors") as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata=meta)


def load_prompt_cache(path: str | Path) -> PromptCache:
    """Read a file written by `save_prompt_cache`. The file is untrusted: its header, layer
    descriptions, array shapes and dtypes, positions and offsets must agree with each other
    (a CorruptCheckpointError otherwise); whether it fits a model is `PromptCache.check_fits`."""
    path = Path(path)
    try:
        safetensors_header(path)  # bounds checked before MLX maps the file
        arrays, meta = mx.load(str(path), return_metadata=True)
        layers = json.loads(meta["mlxinfer.layers"])
        user = json.loads(meta["mlxinfer.metadata"])
    except (MlxinferError, OSError, RuntimeError, ValueError, KeyError, RecursionError) as e:
        raise CorruptCheckpointError(f"'{path}' is not a prompt cache written by mlxinfer ({e})") from None
    if not isinstance(user, dict) or not all(isinstance(v, str) for v in user.values()):
        raise _unusable(path, "its metadata is not an object of strings")
    if not isinstance(layers, list) or not all(isinstance(m, dict) for m in layers):
        raise _unusable(path, "its layer list is not a list of objects")
    tokens = _int_vector(path, arrays, "tokens")
    if tokens.size and tokens.min() < 0:
        raise _unusable(path, f"it holds token id {tokens.min()}")
    caches = [_read_layer(path, i, m, arrays, len(tokens)) for i, m in enumerate(layers)]
    return PromptCache(caches, tokens.tolist(), user)


def _unusable(path: Path, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"'{path}' is not a usable prompt cache: {why}; save it again")


def _int_vector(path: Path, arrays: dict[str, mx.array], name: str) -> np.ndarray:
    a = arrays.get(name)
    if a is None or a.ndim != 1 or not mx.issubdtype(a.dtype, mx.integer):
        raise _unusable(path, f"'{name}' is missing or not a vector of integers")
    return np.array(a).astype(np.int64)


def _setting(path: Path, i: int, m: dict[str, Any], key: str, allowed: Any) -> Any:
    """Layer `i`'s `key`, which must be an int in `allowed` (a range or a tuple), or None where allowed has it."""
    value = m.get(key)
    if value is None:
        ok = isinstance(allowed, tuple) and None in allowed
    else:  # checked as an integer first: `in range` scans linearly for anything else
        ok = is_integer(value) and value in allowed
    if not ok:
        raise _unusable(path, f"layer {i} has {key} {value!r:.40}")
    return value


def _read_layer(path: Path, i: int, m: dict[str, Any], arrays: dict[str, mx.array], n_tokens: int
                ) -> KVCache | StateCache:
    """One layer's cache from its description and arrays, each checked against the others."""
    kind = m.get("kind")
    if kind not in ("KVCache", "RotatingKVCache", "StateCache"):
        raise _unusable(path, f"layer {i} has unknown kind {kind!r:.40}")
    if kind == "StateCache":
        return _read_state(path, i, m, arrays, n_tokens)
    bits = _setting(path, i, m, "bits", (None, *KV_BITS))
    group = _setting(path, i, m, "group_size", KV_GROUP_SIZES)
    offset = _setting(path, i, m, "offset", range(INDEX_MAX))
    parts = _setting(path, i, m, "parts", (0, 1 if bits is None else 3))
    if n_tokens and offset != n_tokens:  # no tokens: an older file whose caches were filled without a token list
        raise _unusable(path, f"layer {i} covers {offset} tokens but the file lists {n_tokens}")
    keys = _parts(path, arrays, f"{i}.keys", parts, bits, group)
    values = _parts(path, arrays, f"{i}.values", parts, bits, group)
    positions = _int_vector(path, arrays, f"{i}.positions")
    stored = keys[0].shape[2] if keys else 0
    if (values and values[0].shape[2] != stored) or len(positions) != stored:
        raise _unusable(path, f"layer {i}'s keys, values and positions disagree in length")
    if len(positions) and (positions[0] < 0 or positions[-1] >= offset or np.any(np.diff(positions) <= 0)):
        raise _unusable(path, f"layer {i}'s positions are not increasing token positions below {offset}")
    c: KVCache
    if kind == "RotatingKVCache":
        size = _setting(path, i, m, "max_size", range(2, INDEX_MAX))
        c = RotatingKVCache(size, _setting(path, i, m, "keep", range(size)), bits, group)
    else:
        if stored != offset:
            raise _unusable(path, f"layer {i} keeps {stored} entries for {offset} tokens")
        c = KVCache(bits, group)
    c.restore(keys, values, offset, positions)
    c.position_delta = m.get("position_delta", 0)  # files from before vision-language prompts have none
    if not is_integer(c.position_delta) or abs(c.position_delta) >= INDEX_MAX:
        raise _unusable(path, f"layer {i} has position_delta {c.position_delta!r:.40}")
    return c


def _read_state(path: Path, i: int, m: dict[str, Any], arrays: dict[str, mx.array], n_tokens: int) -> StateCache:
    """A recurrent layer's state: floating arrays [1, ...], present exactly when tokens were seen
    (whether their shapes fit the model is `PromptCache.check_fits`)."""
    offset = _setting(path, i, m, "offset", range(INDEX_MAX))
    parts = _setting(path, i, m, "parts", range(8))
    if n_tokens and offset != n_tokens:
        raise _unusable(path, f"layer {i} covers {offset} tokens but the file lists {n_tokens}")
    state = tuple(arrays.get(f"{i}.state.{j}") for j in range(parts))
    if any(a is None or a.ndim < 2 or a.shape[0] != 1 or not mx.issubdtype(a.dtype, mx.floating) for a in state):
        raise _unusable(path, f"layer {i}'s state is missing or not floating arrays [1, ...]")
    if bool(state) != bool(offset):
        raise _unusable(path, f"layer {i} has a state of {parts} arrays for {offset} tokens")
    c = StateCache()
    c.restore(state, offset)
    return c


def _parts(path: Path, arrays: dict[str, mx.array], name: str, count: int, bits: int | None, group: int) -> Parts:
    """`count` arrays [1, heads, tokens, dims]: floats, or MLX's (packed uint32, scales, biases)."""
    parts = tuple(arrays.get(f"{name}.{j}") for j in range(count))
    if any(p is None or p.ndim != 4 or p.shape[0] != 1 for p in parts):
        raise _unusable(path, f"'{name}' is missing or not shaped [1, heads, tokens, dims]")
    if len({p.shape[:3] for p in parts}) > 1:
        raise _unusable(path, f"the parts of '{name}' disagree in shape")
    if bits is None and parts and not mx.issubdtype(parts[0].dtype, mx.floating):
        raise _unusable(path, f"'{name}' is not floating point")
    if bits is not None and parts:
        packed, scales, biases = parts
        ok = packed.dtype == mx.uint32 and scales.shape == biases.shape and mx.issubdtype(scales.dtype, mx.floating)
        if not ok or packed.shape[3] * 32 // bits != scales.shape[3] * group:
            raise _unusable(path, f"'{name}' is not {bits}-bit data in groups of {group}")
    return parts
