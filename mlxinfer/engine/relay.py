"""Rank 0 drives the other ranks of a sharded model; a rank that stops answering ends the group.

A sharded forward pass is a run of collectives that every rank must join in the same
order with the same shapes, so every rank runs the same engine on the same inputs
(`replica.Replica`). Rank 0 owns the terminal or the HTTP server and shares what it
decided (the engine's commands for each round); the others replay it without printing.
Messages are JSON: only data crosses between machines. Whatever else the ranks must agree on
(rank 0's random seed, a size every rank measures alike) crosses the same way: one all_sum
(`rank_sum`).

A rank that dies is noticed by `mlx.launch`, which stops the others. A rank that hangs
(or a machine that drops off the network) leaves the others blocked inside a collective,
so every step that waits on the other ranks runs under a watchdog: past
MLXINFER_PEER_TIMEOUT seconds (default 300) the process ends with one line, and
`mlx.launch` then stops the rest. Waiting for the next request is not bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from ..base.errors import InvalidOptionError
from .runtime import generation_stream

HEAD = 4096  # bytes shared in the first all_sum: a length, then the start of the message
DEFAULT_PEER_TIMEOUT = 300.0


def peer_timeout() -> float:
    """Seconds a step may wait on the other ranks (MLXINFER_PEER_TIMEOUT)."""
    value = os.environ.get("MLXINFER_PEER_TIMEOUT")
    if value is None:
        return DEFAULT_PEER_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise InvalidOptionError(f"MLXINFER_PEER_TIMEOUT must be a number of seconds above 0, got {value!r}")
    return seconds


def rank_sum(values: np.ndarray, group) -> np.ndarray:
    """`values` added up over every rank of `group`, back on the host: the one collective by which
    the ranks come to agree (on rank 0's message, rank 0's seed, a size each rank measured)."""
    total = mx.distributed.all_sum(mx.array(values), group=group)
    mx.eval(total)
    return np.array(total)


def agreed_seed(group) -> int:
    """One random seed for every rank (rank 0's), so sampled tokens agree everywhere."""
    mine = int.from_bytes(os.urandom(4), "little") >> 2 if group.rank() == 0 else 0
    return int(rank_sum(np.array([mine], np.int32), group)[0])


def summed(measure: Callable[[Any], int], group) -> Callable[[Any], int]:
    """`measure` added up over the ranks (one all_sum): the same number on every rank, so a
    decision taken on it (a pool keeping or dropping a cache) is the same everywhere."""
    def total(x: Any) -> int:
        return int(rank_sum(np.array([measure(x)], np.int64), group)[0])
    return total


class Watchdog:
    """Ends the process with one line when a bounded wait outlasts its limit. It runs on
    its own thread, which MLX lets run while the main thread waits in a collective."""

    def __init__(self, seconds: float, rank: int):
        self.seconds, self.rank = seconds, rank
        self._deadline: float | None = None
        self._what = ""
        self._changed = threading.Condition()
        threading.Thread(target=self._watch, name="mlxinfer-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def bounded(self, what: str) -> Iterator[None]:
        with self._changed:
            self._deadline, self._what = time.monotonic() + self.seconds, what
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._deadline = None

    def chunks(self, chunks: Iterator, what: str = "a token") -> Iterator:
        """`chunks` with each one's wait bounded."""
        while True:
            with self.bounded(what):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk

    def _watch(self) -> None:
        with self._changed:
            while True:
                if self._deadline is None:
                    self._changed.wait()
                elif time.monotonic() < self._deadline:
                    self._changed.wait(self._deadline - time.monotonic())
                else:
                    line = (f"error: rank {self.rank}: {self._what} waited {self.seconds:g} s on the other ranks "
                            "(one is hung or unreachable); every rank stops (MLXINFER_PEER_TIMEOUT sets the limit)\n")
                    os.write(2, line.encode())
                    os._exit(1)


class Relay:
    """Rank 0's decisions, shared with every rank of `group`."""

    def __init__(self, group):
        self.group, self.rank = group, group.rank()
        self.leader = self.rank == 0
        self.watchdog = Watchdog(peer_timeout(), self.rank)

    def share(self, message: Any = None) -> Any:
        """Rank 0's `message` on every rank (the others' argument is not used): its JSON
        in one all_sum of HEAD bytes, and a second one for what does not fit."""
        data = json.dumps(message).encode() if self.leader else b""
        head = np.zeros(HEAD, np.uint8)
        if self.leader:
            head[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
            head[4 : 4 + min(len(data), HEAD - 4)] = np.frombuffer(data[: HEAD - 4], np.uint8)
        head = self._sum(head)
        size = int.from_bytes(head[:4].tobytes(), "little")
        body = head[4 : 4 + min(size, HEAD - 4)].tobytes()
        if size > HEAD - 4:
            rest = np.zeros(size - (HEAD - 4), np.uint8)
            if self.leader:
                rest[:] = np.frombuffer(data[HEAD - 4 :], np.uint8)
            body += self._sum(rest).tobytes()
        return json.loads(body)

    def _sum(self, values: np.ndarray) -> np.ndarray:
        with mx.stream(generation_stream()):  # after any step still running there, as on every rank
            return rank_sum(values, self.group)
