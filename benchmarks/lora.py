"""LoRA serving: 8 streams over 4 different adapters in one batch, against 8 streams on the base
and against mlx-lm, which runs one adapter per loaded model (so the 4 adapters one after another).

    python benchmarks/lora.py                  # ~58M float32 Llama, float32 and 4-bit bases, rank 8
    python benchmarks/lora.py --tiny           # a hidden-64 Llama: checks that the script runs, in seconds
    python benchmarks/lora.py --max-tokens 128 --repeat 5 --bits 4

Adapters are written in mlx-lm's format (`adapters.safetensors` + `adapter_config.json`): random
rank-8 A and B on every attention and MLP projection of every layer, so both engines load the
same files. The 4-bit base is `mlxinfer convert --bits 4 --dtype float32` of the float one (the
adapters stay float beside it).

Method (as benchmarks/batch.py): N random 32-token prompts, greedy, EOS ignored, `--max-tokens`
each; the clock starts when every sequence has its first token and stops at the last, so
prefill is outside it; aggregate decode tok/s = tokens in between / that time. Rows:
  base      8 streams, no adapter (on the same adapted model: the base rows' own path)
  mixed     8 streams, adapters A, B, C, D twice each, all in one batch
  mlx-lm    the same 8 streams through mlx-lm's BatchGenerator, one adapter's 2 streams at a
            time on a model loaded with that adapter (load time not counted)
The table shows medians of `--repeat` runs and mixed/base (target >= 0.8) and mixed/mlx-lm.
Run it on an idle machine: it prints the load before and other processes' CPU during it, and warns when busy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx  # noqa: E402, I001
import numpy as np  # noqa: E402
from fixtures import build_llama_50m, mlx_lm_steps, ours, timed, write_word_tokenizer  # noqa: E402
from mlxinfer.cli.bench import Quiet, random_prompt  # noqa: E402

ADAPTERS = 4
STREAMS = 8
RANK = 8
TARGET = 0.8  # mixed adapters vs base-only, aggregate decode
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def build_tiny(folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(folder)
    write_word_tokenizer(folder, 512)
    return folder


def write_adapter(base: Path, out: Path, seed: int) -> Path:
    """A random rank-RANK adapter in mlx-lm's format on every projection of every layer."""
    config = json.loads((base / "config.json").read_text())
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                in_dims, out_dims = shapes[name]
                prefix = f"model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_a"] = mx.array(rng.normal(0, in_dims ** -0.5, (in_dims, RANK)), mx.float32)
                tensors[f"{prefix}.lora_b"] = mx.array(rng.normal(0, 0.02, (RANK, out_dims)), mx.float32)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), tensors)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": layers,
        "lora_parameters": {"rank": RANK, "scale": 2.0, "dropout": 0.0}}))
    return out


def mlx_lm_sequential(folder: Path, adapters: list[Path], prompts: list[list[int]], max_tokens: int) -> float:
    """mlx-lm's aggregate decode tok/s over the adapters one after another (2 streams each)."""
    import mlx_lm

    tokens, seconds = 0, 0.0
    per = len(prompts) // len(adapters)
    for i, adapter in enumerate(adapters):
        model, _ = mlx_lm.load(str(folder), adapter_path=str(adapter))
        run = timed(mlx_lm_steps(model, prompts[i * per : (i + 1) * per], max_tokens), per)
        decoded = sum(len(t) - 1 for t in run.tokens)
        tokens, seconds = tokens + decoded, seconds + (decoded / run.decode_tps if run.decode_tps else 0.0)
    return tokens / seconds if seconds else 0.0


def mixed_steps(model, tokenizer, prompts: list[list[int]], names: list[str], max_tokens: int):
    engine = mlxinfer.BatchGenerator(model, tokenizer, max_batch=len(prompts))
    index = {engine.submit(p, adapter=a, max_tokens=max_tokens, temperature=0.0, ignore_eos=True): i
             for i, (p, a) in enumerate(zip(prompts, names))}
    while engine.active:
        yield [(index[uid], c.token) for uid, c in engine.step() if c.token is not None]


def bench(folder: Path, adapters: list[Path], max_tokens: int, repeat: int, with_mlx_lm: bool) -> dict:
    model, tokenizer = mlxinfer.load(folder)
    names = [mlxinfer.load_adapter(model, a, f"a{i}") for i, a in enumerate(adapters)]
    prompts = [random_prompt(model.config.vocab_size, 32, seed=i) for i in range(STREAMS)]
    rows = [names[i % len(names)] for i in range(STREAMS)]
    base, mixed, theirs = [], [], []
    for _ in range(repeat):
        base.append(timed(ours(model, tokenizer, prompts, max_tokens), STREAMS).decode_tps)
        mixed.append(timed(mixed_steps(model, tokenizer, prompts, rows, max_tokens), STREAMS).decode_tps)
        if with_mlx_lm:
            by_adapter = [prompts[i] for name in names for i in range(STREAMS) if rows[i] == name]
            theirs.append(mlx_lm_sequential(folder, adapters, by_adapter, max_tokens))
    result = {"base_tps": statistics.median(base), "mixed_tps": statistics.median(mixed)}
    result["mixed_over_base"] = result["mixed_tps"] / result["base_tps"]
    if with_mlx_lm:
        result["mlx_lm_sequential_tps"] = statistics.median(theirs)
        result["mixed_over_mlx_lm"] = result["mixed_tps"] / result["mlx_lm_sequential_tps"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="A hidden-64 Llama (checks that the script runs).")
    parser.add_argument("--bits", nargs="*", type=int, default=[0, 4], help="Bases: 0 float32, 4 4-bit.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-mlx-lm", action="store_true", help="Skip mlx-lm's sequential runs.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from mlxinfer.convert import convert

    quiet = Quiet()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = (build_tiny if args.tiny else build_llama_50m)(root / "base")
        adapters = [write_adapter(folder, root / f"adapter{i}", seed=i) for i in range(ADAPTERS)]
        for bits in args.bits:
            path = folder
            if bits:
                path = root / f"base-{bits}bit"
                convert(folder, path, quantize=True, bits=bits, dtype="float32", progress=False)
            results["float32" if not bits else f"{bits}-bit"] = bench(path, adapters, args.max_tokens, args.repeat,
                                                                       not args.no_mlx_lm)
    load_line, busy = quiet.report()
    if args.json:
        print(json.dumps({**results, "load_before": quiet.before, "busy": busy}, indent=2))
        return
    print(f"{STREAMS} streams, {ADAPTERS} adapters of rank {RANK}, {args.max_tokens} tokens each, "
          f"median of {args.repeat} (aggregate decode tok/s)")
    print(f"{'base':>8} {'base tok/s':>11} {'mixed tok/s':>12} {'mixed/base':>11} {'mlx-lm seq':>11} {'mixed/mlx-lm':>13}")
    for name, r in results.items():
        theirs = f"{r['mlx_lm_sequential_tps']:.1f}" if "mlx_lm_sequential_tps" in r else "-"
        ratio = f"{r['mixed_over_mlx_lm']:.2f}x" if "mixed_over_mlx_lm" in r else "-"
        print(f"{name:>8} {r['base_tps']:>11.1f} {r['mixed_tps']:>12.1f} {r['mixed_over_base']:>10.2f}x "
              f"{theirs:>11} {ratio:>13}")
    print(f"target: mixed/base >= {TARGET}")
    print(load_line)


if __name__ == "__main__":
    main()
