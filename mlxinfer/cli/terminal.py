"""How mlxinfer looks in a terminal: colour (only where wanted), a spinner for slow
steps, the one-line stats shown after every reply, and typed text made safe to use."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from ..decode.sources import Stats

DIM, CYAN, RESET = "\x1b[2m", "\x1b[36m", "\x1b[0m"


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org) or TERM=dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def typed_text(text: str | bytes) -> str:
    """What the user typed, as text every tokenizer accepts: bytes that are not UTF-8 become
    U+FFFD. Python keeps such bytes in argv (and prompt_toolkit in terminal input) as lone
    surrogates, which the tokenizer would crash on, so they are turned back into the bytes
    they stood for and replaced the same way."""
    if isinstance(text, str):
        try:
            text = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # surrogates that never were bytes
            text = text.encode("utf-8", "surrogatepass")
    return text.decode("utf-8", "replace")


def paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{RESET}" if color and text else text


def size(n: float) -> str:
    """Bytes as B/KB/MB/GB (decimal units, as disk tools show them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def stats_line(stats: Stats, cache_tokens: int | None = None, cache_bytes: int | None = None) -> str:
    """TTFT, prefill and decode speed, token counts and cache size in one line."""
    cached = size(stats.cache_bytes if cache_bytes is None else cache_bytes)
    parts = [
        f"TTFT {stats.ttft * 1000:.0f} ms",
        f"prefill {stats.prefill_tokens} tok {stats.prefill_tps:.0f} tok/s",
        f"decode {stats.generated_tokens} tok {stats.decode_tps:.1f} tok/s",
        f"cache {cache_tokens} tok {cached}" if cache_tokens is not None else f"cache {cached}",
    ]
    if getattr(stats, "drafted", 0):
        parts.append(f"accepted {stats.accepted}/{stats.drafted} drafted ({stats.accepted / stats.drafted:.0%})")
    if getattr(stats, "speedup", 0):
        parts.append(f"{stats.speedup:.2f}x plain")
    return "[" + " | ".join(parts) + "]"


@contextlib.contextmanager
def spinner(message: str, stream: TextIO = sys.stderr, delay: float = 0.3) -> Iterator[None]:
    """Show `message`, a spinner and the elapsed seconds while the block runs, on a
    terminal only, and only once it has taken longer than `delay`."""
    if not (hasattr(stream, "isatty") and stream.isatty()):
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def spin() -> None:
        if done.wait(delay):
            return
        for frame in itertools.cycle("|/-\\"):
            stream.write(f"\r{message} {frame} {time.monotonic() - start:.1f}s")
            stream.flush()
            if done.wait(0.1):
                break
        stream.write("\r\x1b[K")
        stream.flush()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class PullBar:
    """How `mlxinfer pull` shows its progress events (`convert.pull.PullProgress`): on a terminal
    one line redrawn in place with bytes, total, rate and percent; elsewhere (a log, a pipe) plain
    lines, one per step and one per tenth of a download, so a log stays short."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.interval, self.clock = stream or sys.stderr, interval, clock
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.status: str | None = None
        self.started = self.drawn = 0.0
        self.first = 0
        self.tenth = -1

    def __call__(self, event) -> None:
        now = self.clock()
        if event.status != self.status:
            self._end_line()
            self.status, self.started, self.first, self.tenth = event.status, now, event.completed or 0, -1
            if event.completed is None:
                self.stream.write(f"{event.status}\n")
        if event.completed is None:
            self.stream.flush()
            return
        line = self._line(event, now)
        if self.live:
            if now - self.drawn >= self.interval or event.completed == event.total:
                self.stream.write(f"\r\x1b[K{line}")
                self.drawn = now
        else:
            tenth = event.completed * 10 // event.total if event.total else 0
            if tenth != self.tenth:
                self.stream.write(f"{line}\n")
                self.tenth = tenth
        self.stream.flush()

    def _line(self, event, now: float) -> str:
        elapsed = now - self.started
        rate = (event.completed - self.first) / elapsed if elapsed > 0.2 else None
        done = size(event.completed) + (f" / {size(event.total)}" if event.total else "")
        percent = f" {event.completed * 100 // event.total:3d}%" if event.total else ""
        return f"{event.status}{percent}  {done}" + (f"  {size(rate)}/s" if rate is not None else "")

    def _end_line(self) -> None:
        if self.live and self.status is not None and self.drawn:
            self.stream.write("\n")
        self.drawn = 0.0

    def close(self) -> None:
        self._end_line()
        self.stream.flush()
