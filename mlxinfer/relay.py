"""Rank 0 drives the other ranks of a sharded model; a rank that stops answering ends the group.

A sharded forward pass is a run of collectives that every rank must join in the same
order with the same shapes, so every rank runs the same generation code on the same
inputs. Rank 0 owns the terminal or the HTTP server and shares what it decided (a chat
line, the engine's commands for a step, whether a reply goes on after each token); the
others replay it without printing. Messages are JSON: only data crosses between machines.

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
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import InvalidOptionError
from .generate import generation_stream

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
        self._interrupted = False

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
            total = mx.distributed.all_sum(mx.array(values), group=self.group)
            mx.eval(total)
        return np.array(total)

    @contextlib.contextmanager
    def deferred_interrupts(self) -> Iterator[None]:
        """Rank 0: Ctrl-C while a line is handled is noted, not raised, so it takes effect
        where every rank can agree on it (`paced`). The other ranks ignore Ctrl-C: they end
        when rank 0 says so."""
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

    def paced(self, chunks: Iterator) -> Iterator:
        """A reply streamed on every rank: after each chunk rank 0 says whether it goes on
        (not when Ctrl-C was pressed, or when its reader stopped reading), so every rank
        keeps the same tokens. On Ctrl-C rank 0 then raises KeyboardInterrupt, as an
        unshared reply would."""
        ended = stopped = False
        try:
            while True:
                with self.watchdog.bounded("a token"):
                    try:
                        chunk = next(chunks)
                    except StopIteration:
                        ended = True
                        return
                    except BaseException:
                        ended = True  # the same failure on every rank: nothing left to agree on
                        raise
                yield chunk
                with self.watchdog.bounded("a token"):
                    stopped = not self.share(not self._interrupted)
                if stopped:
                    break
        finally:
            if self.leader and not (ended or stopped):  # rank 0's reader left early: the others stop too
                with self.watchdog.bounded("a token"):
                    self.share(False)
            chunks.close()
        if self.leader:
            raise KeyboardInterrupt


class SharedReader:
    """A line reader for every rank: rank 0 reads with `reader` and shares each line (None
    at the end of input, or when input cannot be read); the others return rank 0's lines."""

    def __init__(self, relay: Relay, reader=None):
        self.relay, self.reader = relay, reader

    def read(self, prompt: str) -> str | None:
        if not self.relay.leader:
            return self.relay.share()
        try:
            line = self.reader.read(prompt)
        except KeyboardInterrupt:  # at the prompt: nothing was read, nothing to share
            raise
        except BaseException:
            self.relay.share(None)
            raise
        return self.relay.share(line)
