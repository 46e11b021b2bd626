"""Batched generation: many sequences decoded together, joining and leaving at will.

The engine schedules and steps; the pieces it uses hold the rest: a request made ready
(`prepared`), one sequence's state and the moves it makes on its own (`sequence`), and how
slots are shared between requests (`fairness`).

Every sequence keeps its own `PromptCache` (its own length, positions and cache kind:
growing, rotating, quantized) and its own sampler, options and text layer. A decode
step runs all decoding sequences' next tokens through the model as one batch
(`prompt_cache.run_rows`): the projections and feed-forward see [B, 1] inputs, attention
reads each row's own cache (`models.attention`), so a row's arithmetic is what the same
sequence gets alone and an answer does not depend on who else is being served. New
sequences prefill in the same chunks a lone generation uses, a bounded number of tokens
per step, between decode steps, so a long prompt never freezes the others' streams for
its whole length.

Speculative decoding (a draft model, prompt lookup or a predicted output) runs while its
sequence is the only one in the engine; when others join it is decoded in the shared batch,
and it resumes drafting when it is alone again (`stats.note` says when that happened). At
the switch the pipeline drains first, so the cache always holds everything but the next input.

A request for n choices (`enqueue_choices`) is n sequences sharing one prefill: the first
admitted runs the prompt, the others wait and then start from copies of its cache. Each
has its own sampler (seeded per choice: `SamplingConfig.for_choice`), constraint and text.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx

from ..models.prompt_cache import PromptCache, run_rows
from ..base.checks import integer
from ..text.constrain import masked
from ..decode.sources import Token, chosen_logprobs, drawn
from ..base.errors import InvalidOptionError
from ..text.images import LIMITS, LOCAL, ImageLimits, has_images
from .runtime import generation_stream, wired_limit
from .fairness import SlotShares
from .prepared import Prepared, count, prepare
from .sequence import SequenceState, SharedPrompt
from .text_stream import Chunk
from .options import PREFILL_STEP, Prompt
from ..models.vision import check_takes_images
from .pool import PromptCachePool
from .request import Request
from ..decode.sample import greedy
from ..text.tokenizer import Tokenizer


@dataclass
class _Decode:
    """One batched decode step, queued (lazy) before the previous step's tokens are read."""

    members: list[SequenceState]
    tokens: mx.array  # [B]
    logprobs: mx.array  # [B, V]
    chosen: mx.array  # [B]


@dataclass
class BatchStats:
    """What the engine did: decode steps, tokens, the largest batch, prefill work."""

    steps: int = 0
    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    max_batch_seen: int = 0


class BatchGenerator:
    """Continuous batching: `submit` sequences at any time, `step` (or `stream`) to run.

    Each step admits waiting sequences (up to `max_batch` in flight), prefills a bounded
    amount of their prompts (about `prefill_step` tokens), and runs one batched decode
    step for every sequence whose prompt is in, yielding a (uid, Chunk) per new token.
    Decode steps are pipelined: the next one is queued before this one's tokens are read.
    With a `pool`, prompts reuse cached prefixes and finished sequences leave theirs.
    Not thread-safe: drive it from one thread.
    """

    def __init__(self, model, tokenizer: Tokenizer, max_batch: int = 8, prefill_step: int = PREFILL_STEP,
                 pool: PromptCachePool | None = None, image_sources: frozenset[str] = LOCAL,
                 image_limits: ImageLimits = LIMITS, **defaults: Any):
        integer("max_batch", max_batch, 1)
        if pool is not None and not isinstance(pool, PromptCachePool):
            raise InvalidOptionError(f"pool must be a PromptCachePool, got {type(pool).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.prefill_step, self.pool = max_batch, prefill_step, pool
        self.image_sources = image_sources  # where requests' images may come from (a server: data: URLs)
        self.image_limits = image_limits  # how large, and for a URL how slow, each may be
        self.defaults = {"prefill_step": prefill_step, **defaults}
        Request.of("", model.config.vocab_size, self.defaults)  # bad defaults fail here, not per request
        self.stats = BatchStats()
        self._uids = itertools.count()
        self._groups = itertools.count()
        self._waiting: deque[SequenceState] = deque()
        self._prefilling: list[SequenceState] = []
        self._decoding: list[SequenceState] = []
        self._paused: list[SequenceState] = []  # decoding sequences that gave their slot to another request
        self._cancelled: set[int] = set()
        self._known: set[int] = set()
        self._queued: _Decode | None = None
        self.failures: dict[int, Exception] = {}  # uid -> what ended it with finish_reason "error", this step

    @property
    def active(self) -> int:
        """Sequences submitted and not finished (waiting, prefilling, decoding or paused)."""
        return len(self._waiting) + len(self._prefilling) + len(self._decoding) + len(self._paused)

    @property
    def waiting(self) -> int:
        """Sequences submitted and not yet admitted (all `max_batch` slots were taken)."""
        return len(self._waiting)

    @property
    def cache_bytes(self) -> int:
        """Bytes of K/V held by the sequences in flight."""
        return sum(s.cache.nbytes for s in (*self._prefilling, *self._decoding, *self._paused) if s.cache is not None)

    def uses_adapter(self, name: str) -> bool:
        """Whether a sequence in flight (waiting, prefilling or decoding) runs adapter `name`."""
        return any(s.options.adapter == name for s in self._in_engine())

    def _in_engine(self) -> tuple[SequenceState, ...]:
        return (*self._waiting, *self._prefilling, *self._decoding, *self._paused)

    def submit(self, prompt: Prompt, **options: Any) -> int:
        """Queue a sequence (a string, token ids or chat messages) with its own options
        (those of `stream_generate`); returns its uid. Bad options fail here. For n > 1
        choices: `enqueue_choices`."""
        return self.enqueue(self.prepare(self.request(prompt, **options)))

    def request(self, prompt: Prompt, **options: Any) -> Request:
        """The typed request for `prompt` and keyword options, over this engine's defaults; images
        in its messages are loaded from where `image_sources` allows (refused by a text-only model)."""
        if has_images(prompt):
            check_takes_images(self.model)  # before any image is read
        return Request.of(prompt, self.model.config.vocab_size, self.defaults, image_sources=self.image_sources,
                          image_limits=self.image_limits, **options)

    def prepare(self, request: Request) -> Prepared:
        """Everything about a request that does not need the engine (`prepared.prepare`). Touches
        no engine state, so a server runs it on another thread: work that grows with a request's
        size never stalls the sequences being decoded."""
        return prepare(self.model, self.tokenizer, request)

    def count(self, request: Request) -> int:
        """How many tokens the request's prompt is as `prepare` renders it (`prepared.count`)."""
        return count(self.model, self.tokenizer, request)

    def new_group(self) -> int:
        """A name for a request made of several engine requests (the prompts one client sent
        together), to pass as their `group`: slots are shared fairly between groups."""
        return next(self._groups)

    def enqueue(self, prepared: Prepared, cache: PromptCache | None = None, group: int | None = None) -> int:
        """Queue a prepared request (`prepare`) of one choice; returns its uid. With `cache`
        (the caller's, kept across calls) the sequence runs in it, reusing its longest common
        prefix, and its draft cache (`draft_cache`) is the caller's too. `group`: as `enqueue_choices`."""
        if prepared.options.n != 1:
            raise InvalidOptionError(f"this request asks for n={prepared.options.n} choices: queue it with "
                                     "enqueue_choices, which returns one uid per choice")
        if cache is not None:
            cache.check_fits(self.model)
        return self._queue(prepared, 0, None, self.new_group() if group is None else group, cache)

    def enqueue_choices(self, prepared: Prepared, group: int | None = None) -> list[int]:
        """Queue a prepared request's n choices (`options.n`) as n sequences that prefill its
        prompt once; their uids, in choice order. With seed s, choice i samples with seed
        `sample.choice_seed(s, i)` (choice 0 with s: the first of n is what n=1 gives). They share
        slots with other requests as one `group` (`new_group`; by default a group of their own)."""
        shared = SharedPrompt() if prepared.options.n > 1 else None
        group = self.new_group() if group is None else group
        return [self._queue(prepared, i, shared, group) for i in range(prepared.options.n)]

    def _queue(self, p: Prepared, index: int, shared: SharedPrompt | None, group: int,
               cache: PromptCache | None = None) -> int:
        uid = next(self._uids)
        self._waiting.append(SequenceState.of(uid, p, index, shared, group, cache))
        self._known.add(uid)
        return uid

    def new_cache(self, **cache_options: Any) -> PromptCache:
        """An empty cache for a caller to keep across requests (`enqueue(..., cache=)`, `fill`):
        a chat's conversation. Made by the engine so a replicated engine can make its twin on
        every rank."""
        return PromptCache.for_model(self.model, **cache_options)

    def fill(self, cache: PromptCache, tokens: Sequence[int]) -> None:
        """Make a kept cache hold exactly `tokens` (a chat rolled back to text alone): the common
        prefix stays, the rest is prefilled; no tokens empties it. Text alone has no M-RoPE delta:
        the one an image left must not place what is prefilled again (the kept prefix, before
        any image, does not depend on it)."""
        if not tokens:
            cache.reset()
            return
        todo = cache.prepare(list(tokens))
        cache.set_position_delta(0)
        cache.prefill(self.model, todo, self.prefill_step)

    def close(self) -> None:
        """Nothing more will be queued. A one-process engine holds nothing to let go of; a
        replicated one (`replica.Replica`) lets the other ranks stop."""

    def cancel(self, uid: int) -> None:
        """Stop a sequence; its last chunk (finish_reason "cancelled") comes with the next
        step, and its cache is freed then. Cancelling a finished sequence does nothing."""
        if uid not in self._known:
            raise InvalidOptionError(f"no sequence {uid} was submitted to this engine")
        self._cancelled.add(uid)

    def stream(self) -> Iterator[tuple[int, Chunk]]:
        """Step until every submitted sequence has finished."""
        with wired_limit(self.model):
            while self.active:
                yield from self.step()

    def step(self, prefill: bool = True) -> list[tuple[int, Chunk]]:
        """Admit, prefill a little, then decode: one batched step, or one speculative burst
        for a sequence alone in the engine. Returns the (uid, Chunk) pairs it produced.
        `prefill=False`: no prefill this step (the caller runs another chunk of work beside it)."""
        out: list[tuple[int, Chunk]] = []
        self.failures.clear()
        with mx.stream(generation_stream()):
            self._drop_cancelled(out)
            self._admit(out)
            if prefill:
                self._prefill_some(out)
            lone = self._lone_speculative()
            try:
                if lone is not None and self._queued is None:
                    self._speculate(lone, out)
                    return out
                current = self._queued or self._decode(self._decoding)
                self._queued = None
                if current is not None:
                    # a constrained row's mask needs this step's token: its next step is built after it is read
                    if lone is None and not any(s.constraint is not None for s in current.members):
                        self._queued = self._decode(self._continuing(current), current)
                    self._emit(current, out)
                    if self._queued is None:  # not pipelined: the next step starts from these tokens
                        for i, s in enumerate(current.members):
                            s.next_input = current.tokens[i : i + 1]
                    self._pause_marked(current)
            except Exception as e:  # noqa: BLE001 - a failed batched step ends its members, not the engine
                self._queued = None
                for s in list(self._decoding):
                    self._fail(s, e, out)
        return out

    def _lone_speculative(self) -> SequenceState | None:
        """The sequence that may draft now: it asked to, and it is the only one in the engine."""
        if len(self._decoding) == 1 and not self._prefilling and not self._waiting and not self._paused:
            s = self._decoding[0]
            return s if s.speculative is not None else None
        return None

    def _speculate(self, s: SequenceState, out: list[tuple[int, Chunk]]) -> None:
        """One burst of speculative decoding for the lone sequence (`SequenceState.burst`), its
        tokens handed out until it ends."""
        for token in s.burst():
            if not self._hand_out(s, token, out):
                return

    def _hand_out(self, s: SequenceState, token: Token, out: list[tuple[int, Chunk]], batched: bool = False) -> bool:
        """Turn `token` into the sequence's next chunk; False once the sequence has ended
        (finished, or failed: one sequence's failure ends that sequence only). A token of
        the batched step also moves the sequence's constraint on (a speculative burst
        moves it itself)."""
        try:
            drawn(token.id)
            if batched and s.constraint is not None:
                s.constraint.accept(token.id)
            chunk = s.chunk_of(token)
        except Exception as e:  # noqa: BLE001 - reported as this sequence's error chunk
            self._fail(s, e, out)
            return False
        self.stats.decoded_tokens += 1
        out.append((s.uid, chunk))
        if chunk.finish_reason:
            self._decoding.remove(s)
            s.release(self.model, self.pool)
            return False
        return True

    def _fail(self, s: SequenceState, error: Exception, out: list[tuple[int, Chunk]]) -> None:
        """End `s` with an error chunk (the others go on); its cache is dropped, not pooled."""
        for group in (self._waiting, self._prefilling, self._decoding, self._paused):
            if s in group:
                group.remove(s)
        self.failures[s.uid] = error
        out.append((s.uid, s.failed(error)))

    def _drop_cancelled(self, out: list[tuple[int, Chunk]]) -> None:
        """End the sequences cancelled since the last step, wherever they are, with their last chunk."""
        if not self._cancelled:
            return
        for group in (self._waiting, self._prefilling, self._decoding, self._paused):
            for s in [s for s in group if s.uid in self._cancelled]:
                group.remove(s)
                out.append((s.uid, s.cancelled(self.tokenizer)))
        self._cancelled.clear()

    def _admit(self, out: list[tuple[int, Chunk]]) -> None:
        """Start waiting sequences, and resume paused ones, while slots are free, fairly across
        requests (`fairness.SlotShares`: who is owed the next slot, and who gives one up when
        every slot is taken). A choice whose prompt another choice is prefilling stays in the
        queue (others behind it may start) until that is done."""
        shares = SlotShares((*self._prefilling, *self._decoding))
        while ready := [s for s in (*self._paused, *self._waiting) if s.shared is None or s.shared.ready()]:
            s = shares.next(ready)
            if len(self._prefilling) + len(self._decoding) >= self.max_batch:
                giving = shares.to_pause(self._decoding, s)
                if giving is not None:
                    giving.pausing = True
                return
            shares.take(s)
            if s in self._paused:
                self._paused.remove(s)
                self._decoding.append(s)
                continue
            self._waiting.remove(s)
            try:
                limit = s.begin(self.model, self.tokenizer, self.pool)
            except Exception as e:  # noqa: BLE001 - one sequence's failure ends that sequence only
                self._fail(s, e, out)
                continue
            if s.options.echo and s.scores is None:
                out.append((s.uid, s.text.prompt(s.prompt)))
            if limit <= 0 and s.scores is None:
                out.append((s.uid, s.text.end("length")))
                s.release(self.model, self.pool)
                continue
            self._prefilling.append(s)

    def _pause_marked(self, current: _Decode) -> None:
        """Move the sequences marked to give their slot up (`_admit`) out of the decoding batch,
        each holding its next input: the token this step gave it."""
        row = {id(s): i for i, s in enumerate(current.members)}
        for s in [s for s in self._decoding if s.pausing]:
            s.pausing = False
            if id(s) in row:
                s.next_input = current.tokens[row[id(s)] : row[id(s)] + 1]
            self._decoding.remove(s)
            self._paused.append(s)

    def _prefill_some(self, out: list[tuple[int, Chunk]]) -> None:
        """Prefill chunks (`SequenceState.next_chunk`) until about `prefill_step` tokens ran this
        step; sequences whose prompt is in join decoding (a scored prompt first comes back with
        its scores, and ends there when nothing may be generated)."""
        budget = self.prefill_step
        for s in list(self._prefilling):
            try:
                while s.prompt_pending and budget > 0:
                    chunk = s.next_chunk()
                    if s.cost(chunk) > budget and budget < self.prefill_step:  # the next step runs it
                        break
                    s.prefill(self.model, chunk)
                    budget -= s.cost(chunk)
                    self.stats.prefilled_tokens += len(chunk)
            except Exception as e:  # noqa: BLE001 - one sequence's failure ends that sequence only
                self._fail(s, e, out)
                continue
            if s.prompt_pending:
                break
            self._prefilling.remove(s)
            s.prompt_done()
            if s.scores is not None:
                out.append((s.uid, s.text.prompt(s.prompt, s.scores)))
                if s.text.limit <= 0:
                    out.append((s.uid, s.text.end("length")))
                    s.release(self.model, self.pool)
                    continue
            s.next_input = mx.array(s.todo[-1:])
            self._decoding.append(s)

    def _continuing(self, current: _Decode) -> list[SequenceState]:
        """Who the next decode step runs: this step's members that may still produce a
        token after this one, then sequences whose prompt just went in."""
        members = [s for s in current.members
                   if s in self._decoding and not s.pausing and s.text.generated + 1 < s.text.limit]
        running = {s.uid for s in current.members}
        return members + [s for s in self._decoding if s.uid not in running]

    def _decode(self, members: Sequence[SequenceState], previous: _Decode | None = None) -> _Decode | None:
        """Queue one batched decode step over `members` (lazily, then started)."""
        if not members:
            return None
        if previous is not None:
            row = {id(s): i for i, s in enumerate(previous.members)}
            for s in members:
                if id(s) in row:
                    s.next_input = previous.tokens[row[id(s)] : row[id(s)] + 1]
        for s in members:
            if s.speculative is not None:
                s.pause_drafting(shared=len(members) > 1)
        logits = run_rows(self.model, [s.cache for s in members], mx.concatenate([s.next_input for s in members]))
        if any(s.constraint is not None for s in members):
            mx.async_eval(logits)  # the grammar works out the masks while the forward pass runs
            logits = mx.concatenate([masked(logits[i : i + 1], s.constraint.mask()) if s.constraint is not None
                                     else logits[i : i + 1] for i, s in enumerate(members)])
        if all(s.sampler.argmax_only for s in members):  # one op for the batch, same argmax per row
            tokens = greedy(logits)
        else:
            tokens = mx.concatenate([s.sampler(logits[i : i + 1]) for i, s in enumerate(members)])
        chosen, logprobs = chosen_logprobs(logits, tokens)
        mx.async_eval(tokens, chosen)
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(members))
        return _Decode(list(members), tokens, logprobs, chosen)

    def _emit(self, current: _Decode, out: list[tuple[int, Chunk]]) -> None:
        self.stats.steps += 1
        ids, values = current.tokens.tolist(), current.chosen.tolist()
        for i, s in enumerate(current.members):
            if s not in self._decoding:  # finished, cancelled or failed while this step was queued
                continue
            self._hand_out(s, Token(ids[i], values[i], current.logprobs[i]), out, batched=True)
