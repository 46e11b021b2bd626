"""The caches of one sequence and the one place that runs a model over tokens: a prompt's per-layer
caches and the token ids they cover (`PromptCache`: run, prefill in chunks, reuse a common prefix,
roll back an interrupted run), and a batch's decode step over several (`run_rows`)."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from .cache import KVCache, LayerRows, Parts, RotatingKVCache, StateCache, make_cache
from ..base.errors import CorruptCheckpointError
from .lora import selecting
from .vision import Embedded
from ..base.slices import Slices, run_whole


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
