"""One engine, stepped alike on every rank of a model sharded across ranks.

A sharded forward pass is a run of collectives that every rank must join in the same order
with the same shapes, so every forward pass of a sharded model runs in an engine round. Rank
0's front end (`generate`, `chat`, `serve`) drives a `Replica` as it would a `BatchGenerator`;
the other ranks run `Replica.follow`. Each round rank 0 shares what it did to the engine since
the last one (requests queued, as their typed `Request`'s JSON; sequences cancelled; kept caches
made) and what the round runs (a step, or a kept cache refilled); every rank applies that and
runs the same work. Sampling draws on a random state seeded alike on every rank
(`shard.agreed_seed`), in the same order, so every rank picks the same tokens.

Ctrl-C on rank 0 while the engine runs is noted, not raised: the next round cancels every
sequence in flight on every rank, and only then does rank 0 raise KeyboardInterrupt, so all
ranks stop a reply at the same token and keep the same cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Any, Iterator, Sequence

from .batch import BatchGenerator
from .prepared import Prepared
from ..models.prompt_cache import PromptCache
from ..base.errors import InvalidOptionError
from .text_stream import Chunk
from .relay import Relay
from .request import Request


class Replica(BatchGenerator):
    """A `BatchGenerator` whose every change and step rank 0 shares with the other ranks."""

    def __init__(self, model, tokenizer, relay: Relay, **engine_options: Any):
        super().__init__(model, tokenizer, **engine_options)
        self.relay = relay
        self._ops: list[list[Any]] = []  # rank 0: what was done to the engine since the last round
        self._kept: list[PromptCache] = []  # caches callers keep across requests, by the name every rank knows
        self._interrupted = False

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
        """Rank 0: the other ranks stop following."""
        if self.leader:
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
