"""What a conversion tells its user: a progress bar while it runs, a report when it is done."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO


@dataclass
class Report:
    """The outcome of one conversion; `lines()` is what the CLI prints."""

    source: str
    source_kind: str
    output: Path
    source_bytes: int
    output_bytes: int
    weight_bytes: int  # all tensors written, scales and biases included
    parameters: int  # unquantized parameter count
    precisions: Counter  # "4-bit g64" / "float16" -> number of tensors
    kept_float: dict[str, str]  # layer -> why it stayed unquantized
    shards: int
    seconds: float
    peak_memory: int  # MLX's peak allocation during the conversion
    peak_rss: int  # the process's peak resident memory
    perplexity: tuple[float, float] | None = None  # (source, converted)
    perplexity_skipped: bool = False  # Ctrl-C stopped the comparison after the output was written
    source_precisions: Counter = field(default_factory=Counter)
    chosen: dict[str, str] = field(default_factory=dict)  # quantized layer -> its precision
    quantization_method: dict | None = None  # how a calibrated conversion chose the precisions

    @property
    def bits_per_weight(self) -> float:
        """Effective bits per parameter, as mlx-lm computes it."""
        return self.weight_bytes * 8 / self.parameters

    def lines(self) -> list[str]:
        out = [
            f"converted {self.source_kind} {self.source} -> {self.output}",
            f"  size:       {_size(self.source_bytes)} -> {_size(self.output_bytes)} in {self.shards} shard(s)",
            f"  bits/weight: {self.bits_per_weight:.3f} effective (scales and biases included), "
            f"{self.parameters / 1e6:.1f}M parameters",
            f"  source:     {_counts(self.source_precisions)}",
            f"  output:     {_counts(self.precisions)}",
        ]
        if self.quantization_method:
            out.extend(self._method_lines())
        if self.kept_float:
            first, why = next(iter(self.kept_float.items()))
            more = f" and {len(self.kept_float) - 1} more" if len(self.kept_float) > 1 else ""
            out.append(f"  unquantized: {len(self.kept_float)} layer(s) kept in float ({first}{more}: {why})")
        if self.perplexity:
            src, dst = self.perplexity
            out.append(f"  perplexity: source {src:.3f}  converted {dst:.3f}  ({(dst / src - 1) * 100:+.2f}%)")
        if self.perplexity_skipped:
            out.append("  perplexity: not measured (interrupted)")
        out.append(
            f"  time:       {self.seconds:.1f} s; peak memory {_size(self.peak_memory)} (MLX), "
            f"{_size(self.peak_rss)} (process RSS)"
        )
        return out


    def _method_lines(self) -> list[str]:
        """What the method did and, per kind of layer (q_proj, down_proj...), the precisions it chose."""
        m = self.quantization_method
        head = f"  method:     {m['method']}"
        if "target_bpw" in m:
            head += f" to {m['target_bpw']:g} bits/weight"
        head += f", calibrated on {m['calibration_tokens']} tokens of {m['calibration']}"
        kinds: dict[str, Counter] = {}
        for path, precision in self.chosen.items():
            kinds.setdefault(path.rpartition(".")[2], Counter())[precision] += 1
        return [head, *(f"    {kind:<14} {_counts(c)}" for kind, c in kinds.items())]


def _counts(counter: Counter) -> str:
    return ", ".join(f"{n} x {label}" for label, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class Progress:
    """A one-line bar over tensors and bytes on stderr; silent unless enabled (a TTY by default)."""

    def __init__(self, tensors: int, nbytes: int, enabled: bool | None = None, stream: TextIO | None = None):
        self.total_tensors, self.total_bytes = tensors, max(nbytes, 1)
        self.tensors = self.bytes = 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = self.last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.1 or self.tensors == self.total_tensors):
            self.last = now
            done = self.bytes / self.total_bytes
            bar = "#" * int(done * 30)
            self.stream.write(
                f"\r[{bar:<30}] {done:4.0%}  {self.tensors}/{self.total_tensors} tensors  "
                f"{_size(self.bytes)}/{_size(self.total_bytes)}  {now - self.start:.1f}s"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
