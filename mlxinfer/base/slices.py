"""Model work cut into slices: a generator that yields after each piece of at most one prefill
chunk of work and returns its result.

Why: a server runs such work (inspection, embeddings) on its engine thread, one slice between
engine steps, so the streams being decoded never wait longer than one chunk for it
(`serve.engine_thread.EngineThread.run_slices`); a library caller runs it whole (`run_whole`).
"""

from __future__ import annotations

from typing import Generator, TypeVar

T = TypeVar("T")
Slices = Generator[None, None, T]


def run_whole(slices: Slices[T]) -> T:
    """Every slice, one after the other; the work's result."""
    while True:
        try:
            next(slices)
        except StopIteration as end:
            return end.value
