"""What the server has done, in Prometheus's text format (version 0.0.4), for `GET /metrics` (`health`).

One `Metrics` object holds the counts. Two places feed it, each where something ends:
the `Counted` middleware when an HTTP response ends (by route, method and status), and
the engine thread when a sequence ends (its tokens, finish reason, time to first token and
time per output token). Gauges (running and waiting requests, K/V bytes, the prompt
cache's hits) are read from the engine thread's health snapshot when scraped.

The format is a few lines of text, written here rather than through `prometheus_client`
(which would be one more runtime dependency, with process-global registries) and
checked against `prometheus_client`'s parser in the tests. Times are measured from when
a request reaches the engine's front (before its prompt is rendered), as a client sees them.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable


from ..decode.sources import Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a first token takes a prefill (milliseconds to a minute on a laptop); a later one a decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """Observations counted into upper bounds (`buckets`, then +Inf), with their sum."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf; not cumulative
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def samples(self, name: str) -> list[tuple[str, dict[str, str], float]]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            running += n
            out.append((f"{name}_bucket", {"le": _number(bound)}, running))
        return [*out, (f"{name}_sum", {}, self.total), (f"{name}_count", {}, running)]


class Metrics:
    """The server's counters and histograms, safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[tuple[str, str, int]] = Counter()  # (route, method, status)
        self.finished: Counter[str] = Counter()  # sequences by finish reason
        self.prompt_tokens = self.prefilled_tokens = self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(PER_TOKEN_BUCKETS)

    def responded(self, route: str, method: str, status: int) -> None:
        with self._lock:
            self.responses[(route, method, status)] += 1

    def sequence_ended(self, reason: str, stats: Stats | None, arrived: float, first: float | None,
                       now: float, choice: int = 0) -> None:
        """A sequence ended (`first`: when its first token came; None if none did). The n choices
        of a request share one prompt, counted with its first choice."""
        with self._lock:
            self.finished[reason] += 1
            if stats is not None:
                self.prompt_tokens += stats.prompt_tokens if choice == 0 else 0
                self.prefilled_tokens += stats.prefill_tokens
                self.generated_tokens += stats.generated_tokens
            if first is not None:
                self.ttft.observe(first - arrived)
                if stats is not None and stats.generated_tokens > 1:
                    self.per_token.observe((now - first) / (stats.generated_tokens - 1))

    def text(self, health: dict[str, Any]) -> str:
        """Every metric in the text format, with the gauges of `health` (the engine thread's snapshot)."""
        pool = health.get("prompt_cache") or {}
        with self._lock:
            families = [
                ("mlxinfer_http_requests_total", "counter", "HTTP responses by route, method and status.",
                 [("mlxinfer_http_requests_total", {"route": r, "method": m, "status": str(s)}, n)
                  for (r, m, s), n in sorted(self.responses.items())]),
                ("mlxinfer_sequences_finished_total", "counter", "Generations ended, by finish reason.",
                 [("mlxinfer_sequences_finished_total", {"reason": r}, n) for r, n in sorted(self.finished.items())]),
                _one("mlxinfer_prompt_tokens_total", "counter", "Prompt tokens of ended generations.",
                     self.prompt_tokens),
                _one("mlxinfer_prefill_tokens_total", "counter",
                     "Prompt tokens actually run (the rest came from the prompt cache).", self.prefilled_tokens),
                _one("mlxinfer_generation_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("mlxinfer_time_to_first_token_seconds", "histogram",
                 "From a request reaching the engine to its first token.",
                 self.ttft.samples("mlxinfer_time_to_first_token_seconds")),
                ("mlxinfer_time_per_output_token_seconds", "histogram",
                 "A generation's time per token after its first.",
                 self.per_token.samples("mlxinfer_time_per_output_token_seconds")),
            ]
        families += [
            _one("mlxinfer_requests_running", "gauge", "Sequences in the engine's batch.", health.get("active", 0)),
            _one("mlxinfer_requests_waiting", "gauge", "Requests queued for a place in the batch.",
                 health.get("queued", 0)),
            _one("mlxinfer_kv_cache_bytes", "gauge", "K/V cache bytes held by running sequences.",
                 health.get("cache_bytes", 0)),
            _one("mlxinfer_prompt_cache_hits_total", "counter", "Prompts that reused a cached prefix.",
                 pool.get("hits", 0)),
            _one("mlxinfer_prompt_cache_misses_total", "counter", "Prompts that found no cached prefix.",
                 pool.get("misses", 0)),
            _one("mlxinfer_prompt_cache_reused_tokens_total", "counter", "Prompt tokens the prompt cache supplied.",
                 pool.get("reused_tokens", 0)),
            _one("mlxinfer_prompt_cache_bytes", "gauge", "Bytes held by the prompt cache.", pool.get("nbytes", 0)),
            _one("mlxinfer_prompt_cache_entries", "gauge", "Conversations held by the prompt cache.",
                 pool.get("entries", 0)),
        ]
        return "".join(_family(*f) for f in families)


def _one(name: str, kind: str, help_text: str, value: float) -> tuple:
    return name, kind, help_text, [(name, {}, value)]


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for sample, labels, value in samples:
        inner = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
        lines.append(f"{sample}{{{inner}}} {_number(value)}" if inner else f"{sample} {_number(value)}")
    return "\n".join(lines) + "\n"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Counted:
    """ASGI middleware: every HTTP response counted when it ends, by the route that served
    it ("unmatched" for unknown paths), method and status (500 if none was sent)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.responded(_route(scope), scope["method"], status)


def _route(scope) -> str:
    """The path a request matched with its parameters named (`/v1/models/{name}`), so each
    route is one label however many models are asked for; "unmatched" if none matched."""
    if "route" not in scope:
        return "unmatched"
    path = scope["path"]
    for name, value in scope.get("path_params", {}).items():
        head, found, tail = path.rpartition(str(value)) if str(value) else ("", "", path)
        if found:
            path = f"{head}{{{name}}}{tail}"
    return path
