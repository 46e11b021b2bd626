"""Benchmark harness in the spirit of llama-bench: fixed random prompts, EOS
ignored, greedy, warm-up excluded, median and spread over repeats."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..engine.generate import stream_generate


@dataclass(frozen=True)
class Run:
    prefill_tps: float
    decode_tps: float
    ttft: float
    peak_memory: int


@dataclass(frozen=True)
class Summary:
    """Median and (min, max) of each figure over the repeats."""

    prefill_tps: tuple[float, float, float]
    decode_tps: tuple[float, float, float]
    ttft: tuple[float, float, float]
    peak_memory: tuple[float, float, float]
    runs: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(runs: list[Run]) -> Summary:
    def spread(values: list[float]) -> tuple[float, float, float]:
        return (statistics.median(values), min(values), max(values))

    return Summary(
        spread([r.prefill_tps for r in runs]),
        spread([r.decode_tps for r in runs]),
        spread([r.ttft for r in runs]),
        spread([float(r.peak_memory) for r in runs]),
        len(runs),
    )


def random_prompt(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, n).tolist()


def run_once(model, tokenizer, prompt: list[int], gen_tokens: int, **options) -> Run:
    stats = None
    for chunk in stream_generate(model, tokenizer, prompt, max_tokens=gen_tokens, ignore_eos=True, **options):
        stats = chunk.stats
    return Run(stats.prefill_tps, stats.decode_tps, stats.ttft, stats.peak_memory)


def bench(
    model, tokenizer, prompt_tokens: int = 512, gen_tokens: int = 128, repeat: int = 5, warmup: int = 1, **options
) -> Summary:
    prompt = random_prompt(model.config.vocab_size, prompt_tokens)
    for _ in range(warmup):
        run_once(model, tokenizer, prompt, min(gen_tokens, 8), **options)
    return summarize([run_once(model, tokenizer, prompt, gen_tokens, **options) for _ in range(repeat)])


def weight_bytes(model) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def _matvec_rate(rows: int, cols: int, count: int, repeat: int) -> float:
    ws = [mx.random.normal((rows, cols)) for _ in range(count)]
    x = mx.random.normal((1, cols))
    mx.eval(ws, x)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval([x @ w.T for w in ws])
        best = min(best, time.perf_counter() - t)
    return sum(w.nbytes for w in ws) / best


def memory_bandwidth(repeat: int = 5) -> float:
    """Bytes per second streamed by float32 matrix-vector products (the operation
    decode is made of), best over shapes from 1 MB to 512 MB, 256 MB in all or
    more so caches cannot hold them: the roofline's denominator."""
    shapes = [(32768, 4096, 1), (4096, 4096, 4), (2048, 2048, 16), (1024, 1024, 64)]
    return max(_matvec_rate(rows, cols, count, repeat) for rows, cols, count in shapes)


def load_average() -> float:
    """The machine's 1-minute load average (what `uptime` shows first)."""
    return os.getloadavg()[0]


def _busy_seconds() -> float | None:
    """CPU seconds all processes have used since boot (Linux's /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Quiet:
    """Whether the machine was quiet around a comparison: the load average before it, and the
    CPU that other processes used while it ran (the load average after it counts the
    benchmark's own threads, so it cannot say). A peer whose threads spin (llama.cpp) loses
    far more to other work than we do, so a ratio measured on a busy machine flatters us."""

    LIMIT = 0.5  # cores: the load before, and the other processes' use during, must stay below it

    def __init__(self) -> None:
        self.before = load_average()
        self._busy, self._ours, self._start = _busy_seconds(), _own_seconds(), time.perf_counter()

    def report(self) -> tuple[str, bool]:
        """A line saying how quiet it was, with a loud warning when it was not; and whether it was busy."""
        line = f"load average before {self.before:.2f}, after {load_average():.2f} (this run's own threads count there)"
        others = None
        if self._busy is not None:
            wall = time.perf_counter() - self._start
            others = max(_busy_seconds() - self._busy - (_own_seconds() - self._ours), 0.0) / wall
            line += f"; other processes used {others:.2f} cores during it"
        busy = self.before > self.LIMIT or (others is not None and others > self.LIMIT)
        if busy:
            line += (f"\n*** WARNING: the machine was busy (above {self.LIMIT} cores of other work): these ratios are "
                     "not fit to report; rerun on an idle machine ***")
        return line, busy


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def ratios(ours: list[float], theirs: list[float]) -> str:
    """Each alternating run's ratio, so a drift or an outlier shows beside the median."""
    return " ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs))
