"""One engine, stepped alike on every rank of a model sharded across ranks.

A sharded forward pass is a run of collectives that every rank must join in the same order
with the same shapes, so every forward pass of a sharded model runs in an engine round. Rank
0's front end (`generate`, `chat`, `serve`) drives a `Replica` as it would a `BatchGenerator`;
the other ranks run `Replica.follow` (`run_front_end` gives each rank its part). Each round
rank 0 shares what it did to the engine since the last one (requests queued, as their typed
`Request`'s JSON; sequences cancelled; kept caches made) and what the round runs (a step, or a
kept cache refilled); every rank applies that and runs the same work. Sampling draws on a
random state seeded alike on every rank (`relay.agreed_seed`), in the same order, so every
rank picks the same tokens.

Ctrl-C on rank 0 while the engine runs is noted, not raised: the next round cancels every
sequence in flight on every rank, and only then does rank 0 raise KeyboardInterrupt, so all
ranks stop a reply at the same token and keep the same cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from .batch import BatchGenerator
from .prepared import Prepared
from ..models.prompt_cache import PromptCache
from ..base.errors import InvalidOptionError
from .pool import PromptCachePool, cache_nbytes
from .text_stream import Chunk
from .relay import Relay, agreed_seed, summed
from .request import Request
from ..text.tokenizer import Tokenizer


class Replica(BatchGenerator):
    """A `BatchGenerator` whose every change and step rank 0 shares with the other ranks."""

    def __init__(self, model, tokenizer, relay: Relay, **engine_options: Any):
        super().__init__(model, tokenizer, **engine_options)
        self.relay = relay
        self._ops: list[list[Any]] = []  # rank 0: what was done to the engine since the last round
        self._kept: list[PromptCache] = []  # caches callers keep across requests, by the name every rank knows
        self._interrupted = False
        self._closed = False

    @classmethod
    def for_model(cls, model, tokenizer: Tokenizer, **engine_options: Any) -> Replica | None:
        """For a model sharded across ranks: the engine every rank runs alike (rank 0 drives it, the
        others follow it), with every rank's random state seeded alike (rank 0's seed) and Ctrl-C
        left to rank 0; None for a model on one machine."""
        place = getattr(model, "shard", None)
        if place is None:
            return None
        relay = Relay(place.group)
        mx.random.seed(agreed_seed(place.group))
        if not relay.leader:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return cls(model, tokenizer, relay, **engine_options)

    @property
    def leader(self) -> bool:
        return self.relay.leader

    def prepare(self, request: Request) -> Prepared:
        """As the engine's, less a prediction: speculation would have each rank choose its passes by
        its own timings, and a prediction never changes what is generated, only how fast."""
        if request.options.prediction is not None:
            request = dataclasses.replace(request, options=dataclasses.replace(request.options, prediction=None))
        return super().prepare(request)

    def new_cache(self, **cache_options: Any) -> PromptCache:
        cache = super().new_cache(**cache_options)
        self._kept.append(cache)
        self._ops.append(["cache", cache_options])
        return cache

    def enqueue(self, prepared: Prepared, cache: PromptCache | None = None, group: int | None = None) -> int:
        group = self.new_group() if group is None else group  # named here: the other ranks take rank 0's
        # a request that cannot be shared fails first
        op = ["submit", prepared.request.to_json(), self._name(cache), group]
        uid = super().enqueue(prepared, cache, group)
        self._ops.append(op)
        return uid

    def enqueue_choices(self, prepared: Prepared, group: int | None = None) -> list[int]:
        group = self.new_group() if group is None else group
        op = ["choices", prepared.request.to_json(), group]
        uids = super().enqueue_choices(prepared, group)
        self._ops.append(op)
        return uids

    def cancel(self, uid: int) -> None:
        super().cancel(uid)
        self._ops.append(["cancel", uid])

    def fill(self, cache: PromptCache, tokens: Sequence[int]) -> None:
        """A round of its own: every rank refills its twin of the cache."""
        name = self._name(cache)
        with self._interrupts_deferred():
            self._round(["fill", name, [int(t) for t in tokens]])
            with self.relay.watchdog.bounded("a step"):
                super().fill(cache, tokens)
        self._raise_if_interrupted()

    def stream(self) -> Iterator[tuple[int, Chunk]]:
        with self._interrupts_deferred():
            yield from super().stream()

    def step(self) -> list[tuple[int, Chunk]]:
        if self._interrupted:
            for uid in self._in_flight():
                self.cancel(uid)
        self._round(["step"])
        with self.relay.watchdog.bounded("a step"):
            out = super().step()
        self._raise_if_interrupted()
        return out

    def close(self) -> None:
        """Rank 0: the other ranks stop following. Once: a server's engine thread closes it when it
        stops, and `run_front_end` again when the server has stopped, by when the others are gone."""
        if self.leader and not self._closed:
            self._closed = True
            self.relay.share(None)

    def follow(self) -> None:
        """A rank other than 0: apply and run each round rank 0 shares, until it closes. Waiting
        for the next round is not bounded (a server may be idle, a person may be thinking)."""
        while (ops := self.relay.share()) is not None:
            with self.relay.watchdog.bounded("a step"):
                for op in ops:
                    self._apply(op)

    def _apply(self, op: list[Any]) -> None:
        kind = op[0]
        if kind == "cache":
            self._kept.append(super().new_cache(**op[1]))
        elif kind == "submit":
            cache = self._kept[op[2]] if op[2] is not None else None
            super().enqueue(self.prepare(Request.from_json(op[1])), cache, op[3])
        elif kind == "choices":
            super().enqueue_choices(self.prepare(Request.from_json(op[1])), op[2])
        elif kind == "cancel":
            super().cancel(op[1])
        elif kind == "fill":
            super().fill(self._kept[op[1]], op[2])
        else:
            super().step()

    def _round(self, work: list[Any]) -> None:
        """Rank 0 shares the round: what changed since the last one, then the work it runs."""
        ops, self._ops = [*self._ops, work], []
        with self.relay.watchdog.bounded("a step"):
            self.relay.share(ops)

    def _name(self, cache: PromptCache | None) -> int | None:
        if cache is None:
            return None
        for name, kept in enumerate(self._kept):
            if kept is cache:
                return name
        raise InvalidOptionError("a cache kept across requests of a model sharded across ranks must come from the "
                                 "engine's new_cache, so that every rank holds its twin")

    def _in_flight(self) -> list[int]:
        return [s.uid for group in (self._waiting, self._prefilling, self._decoding) for s in group]

    @contextlib.contextmanager
    def _interrupts_deferred(self) -> Iterator[None]:
        """Rank 0's Ctrl-C is noted while the engine runs, to be agreed on in the next round; the
        other ranks ignore Ctrl-C (they stop when rank 0 closes). Only the main thread gets signals."""
        if not self.leader or threading.current_thread() is not threading.main_thread():
            yield
            return
        self._interrupted = False
        previous = signal.signal(signal.SIGINT, self._note_interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _note_interrupt(self, *_: Any) -> None:
        self._interrupted = True

    def _raise_if_interrupted(self) -> None:
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt


def run_front_end(front_end: Callable[[Replica | None], None], model, tokenizer: Tokenizer,
                  **engine_options: Any) -> None:
    """Run a front end (a reply, a chat, a server) on the engine `model` needs. On one machine
    that is `front_end(None)`: the front end makes its own engine. For a model sharded across
    ranks, rank 0 runs `front_end` on the `Replica` and, however it ends, lets the other ranks go;
    every other rank follows rank 0's engine until then, and runs nothing of the front end."""
    replica = Replica.for_model(model, tokenizer, **engine_options)
    if replica is None:
        front_end(None)
    elif not replica.leader:
        replica.follow()
    else:
        try:
            front_end(replica)
        finally:
            replica.close()


def pool_for(model, max_bytes: int) -> PromptCachePool:
    """A prompt-cache pool of `max_bytes` for `model`'s engine. For a model sharded across ranks
    it counts every rank's bytes of an entry (the ranks of a pipeline hold different K/V), so
    every rank's pool keeps and drops the same entries."""
    place = getattr(model, "shard", None)
    return PromptCachePool(max_bytes, cache_nbytes if place is None else summed(cache_nbytes, place.group))
