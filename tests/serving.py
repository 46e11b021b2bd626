"""The real `mlxinfer serve` in a subprocess, for the server tests (not a test module): a
free loopback port, readiness by /health, raw POSTs. All traffic goes to 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of `n` consecutive free loopback ports: mlx.launch's ring backend listens on its
    --starting-port and the n - 1 after it, by default 32323 for every launch on the machine."""
    for _ in range(100):
        start = free_port()
        try:
            with contextlib.ExitStack() as held:
                for port in range(start, start + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return start
        except (OSError, OverflowError):
            continue
    raise RuntimeError(f"no {n} consecutive free loopback ports")


def answers_health(url: str, proc: subprocess.Popen, seconds: float, output=None) -> bool:
    """Wait until the server at `url` answers /health (True) or `seconds` pass (False); fail
    at once with its output (`output()`, or what is left in its pipes) if its process exits first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return True
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                pytest.fail(f"the server exited: {output() if output else proc.communicate()}")
            time.sleep(0.1)
    return False


class Server:
    """A `serve` subprocess on a free loopback port, ready when /health answers."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, script: list[str] | None = None,
                 descriptors: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = script or [sys.executable, "-m", "mlxinfer"]

        def limit() -> None:  # in the child: at most `descriptors` open files, as `ulimit -n` sets
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

        self.proc = subprocess.Popen([*command, "serve", "--port", str(self.port), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                                     preexec_fn=limit if descriptors else None)
        self.lines: list[str] = []  # its output, read as it comes so a full pipe never blocks it
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        if not answers_health(self.url, self.proc, 180, lambda: (self._reader.join(5), "".join(self.lines))[1]):
            self.proc.kill()
            pytest.fail("the server did not start in 180 s")

    def health(self) -> dict:
        return json.load(urllib.request.urlopen(f"{self.url}/health", timeout=5))

    def wait_for(self, condition, seconds: float = 60.0) -> dict:
        """Health once `condition` holds (polled; `seconds` is only a hang guard)."""
        deadline = time.monotonic() + seconds
        while True:
            health = self.health()
            if condition(health) or time.monotonic() > deadline:
                return health
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(30)
        return rc, "".join(self.lines)


def marker(tokenizer, word: str) -> list[int]:
    """Token ids that `word` becomes inside a sentence (its first and last piece may merge with neighbours)."""
    return tokenizer.encode(f" {word} ", add_special_tokens=False)[1:-1]


def post(url: str, body: bytes | dict, key: str | None = KEY, path: str = "/v1/chat/completions",
         headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a raw POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    request = urllib.request.Request(url + path, data=data, headers=h)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


@dataclass
class While:
    """What another client's streamed completion saw while some work ran (`tokens_while`)."""

    tokens: int  # tokens it received meanwhile
    longest_gap: float  # its longest wait for a token meanwhile, in seconds
    seconds: float  # how long the work took
    result: Any  # what the work returned


def tokens_while(url: str, work: Callable[[], Any], no_end: Sequence[int], key: str | None = KEY,
                 max_tokens: int = 200) -> While:
    """Another client's stream, watched while `work` runs. The stream starts first and `work` runs
    once tokens flow; the stream must outlast `work` (`no_end`: token ids biased away, the
    tokenizer's ends, and `max_tokens`). A server that runs `work` in one piece (or holds the
    GIL or the event loop for it) gives the stream no token meanwhile; one that runs it in slices
    between engine steps gives it about one token a slice."""
    body = {"prompt": "once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in no_end}}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    arrivals: list[float] = []
    flowing, ended = threading.Event(), threading.Event()

    def read() -> None:
        with urllib.request.urlopen(request, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 3:
                        flowing.set()
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert flowing.wait(60), "the stream gave no tokens"
    start = time.monotonic()
    result = work()
    end = time.monotonic()
    assert not ended.is_set(), "the stream ended before the work did: give it more tokens"
    reader.join(120)
    seen = [t for t in arrivals if start < t < end]
    marks = [max([t for t in arrivals if t <= start], default=start), *seen, end]
    return While(len(seen), max(b - a for a, b in zip(marks, marks[1:])), end - start, result)
