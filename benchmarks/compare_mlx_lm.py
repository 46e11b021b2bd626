"""mlxinfer vs mlx-lm on the same checkpoint, prompt and settings, in one process.

Runs the two engines alternately (so drift in machine load hits both), reports
our/their ratios for prefill and decode tok/s, and the decode roofline: bytes
read per token (weights + KV cache) divided by the measured memory bandwidth.

    python benchmarks/compare_mlx_lm.py                 # builds a ~50M float32 Llama
    python benchmarks/compare_mlx_lm.py --hybrid        # a ~58M float32 Qwen3.5-style hybrid instead
    python benchmarks/compare_mlx_lm.py PATH --repeat 5 # any folder both can load

On Linux, preload OpenBLAS first (see README).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx  # noqa: E402, I001
from fixtures import build_hybrid, build_llama_50m  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlxinfer.models.config import RECURRENT  # noqa: E402
from mlxinfer.cli.bench import (Run, Quiet, memory_bandwidth, random_prompt, ratios, run_once,  # noqa: E402
                            summarize, weight_bytes)


def as_multimodal(folder: Path) -> Path:
    """The text model's config wrapped as a `qwen3_5` checkpoint's (`text_config`): the shape
    mlx-lm reads Qwen3.5 in (it has no `qwen3_5_text`); mlxinfer runs either."""
    text = json.loads((folder / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    (folder / "config.json").write_text(json.dumps(wrapped))
    return folder


def run_mlx_lm(model, tokenizer, prompt: list[int], gen_tokens: int) -> Run:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    mx.reset_peak_memory()
    start = time.perf_counter()
    stamps, last = [], None
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=gen_tokens,
                                     sampler=make_sampler(0.0)):
        stamps.append(time.perf_counter())
        last = r
    # decode rate measured as ours is, (n - 1) tokens over first-to-last token time: mlx-lm's own
    # generation_tps divides n tokens by n - 1 step times, which favours it by 1/n
    decode_tps = (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)
    return Run(last.prompt_tps, decode_tps, stamps[0] - start, mx.get_peak_memory())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="checkpoint folder (default: build a ~50M float32 Llama)")
    ap.add_argument("--hybrid", action="store_true",
                    help="build a ~58M float32 Qwen3.5-style hybrid (Gated DeltaNet + attention) instead")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx_lm

    quiet = Quiet()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        elif args.hybrid:
            path = as_multimodal(build_hybrid(Path(tmp)))
        else:
            path = build_llama_50m(Path(tmp))
        ours, our_tok = mlxinfer.load(path)
        theirs, their_tok = mlx_lm.load(str(path))
        prompt = random_prompt(ours.config.vocab_size, args.prompt_tokens)
        run_once(ours, our_tok, prompt, 8)
        run_mlx_lm(theirs, their_tok, prompt, 8)
        our_runs, their_runs = [], []
        for _ in range(args.repeat):
            our_runs.append(run_once(ours, our_tok, prompt, args.gen_tokens))
            their_runs.append(run_mlx_lm(theirs, their_tok, prompt, args.gen_tokens))

    load_line, busy = quiet.report()
    a, b = summarize(our_runs), summarize(their_runs)
    bandwidth = memory_bandwidth()
    weights = weight_bytes(ours)
    cfg = ours.config
    act_bytes = ours.model.norm.weight.dtype.size
    attention_layers = sum(t not in RECURRENT for t in cfg.layer_types) if cfg.layer_types else cfg.num_hidden_layers
    kv_per_token = 2 * attention_layers * cfg.num_key_value_heads * cfg.head_dim * act_bytes  # a state's is fixed
    mean_context = args.prompt_tokens + args.gen_tokens / 2
    bytes_per_token = weights + kv_per_token * mean_context
    roofline = bandwidth / bytes_per_token
    result = {
        "model": args.model or ("qwen3.5-hybrid-58m-float32" if args.hybrid else "llama-50m-float32") + " (random)",
        "params_m": sum(p.size for _, p in tree_flatten(ours.parameters())) / 1e6,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeat": args.repeat,
        "mlxinfer": a.as_dict(), "mlx_lm": b.as_dict(),
        "prefill_ratio": a.prefill_tps[0] / b.prefill_tps[0],
        "decode_ratio": a.decode_tps[0] / b.decode_tps[0],
        "bandwidth_gbs": bandwidth / 1e9, "bytes_per_token_mb": bytes_per_token / 1e6,
        "roofline_tps": roofline,
        "mlxinfer_roofline_frac": a.decode_tps[0] / roofline,
        "mlx_lm_roofline_frac": b.decode_tps[0] / roofline,
        "decode_ratios": [r.decode_tps / t.decode_tps for r, t in zip(our_runs, their_runs)],
        "prefill_ratios": [r.prefill_tps / t.prefill_tps for r, t in zip(our_runs, their_runs)],
        "load_before": quiet.before, "busy": busy,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}: {args.prompt_tokens} prompt + {args.gen_tokens} generated, "
          f"{args.repeat} alternating runs, medians")
    print(load_line)
    print(f"{'':14}{'mlxinfer':>12}{'mlx-lm':>12}{'ratio':>9}  each run")
    print(f"{'prefill tok/s':14}{a.prefill_tps[0]:12.1f}{b.prefill_tps[0]:12.1f}{result['prefill_ratio']:9.3f}  "
          f"{ratios([r.prefill_tps for r in our_runs], [r.prefill_tps for r in their_runs])}")
    print(f"{'decode tok/s':14}{a.decode_tps[0]:12.1f}{b.decode_tps[0]:12.1f}{result['decode_ratio']:9.3f}  "
          f"{ratios([r.decode_tps for r in our_runs], [r.decode_tps for r in their_runs])}")
    print(f"{'peak MiB':14}{a.peak_memory[0] / 2**20:12.1f}{b.peak_memory[0] / 2**20:12.1f}")
    print(f"roofline: {bytes_per_token / 1e6:.1f} MB/token at {bandwidth / 1e9:.1f} GB/s = {roofline:.1f} tok/s; "
          f"mlxinfer {result['mlxinfer_roofline_frac']:.0%}, mlx-lm {result['mlx_lm_roofline_frac']:.0%}")


if __name__ == "__main__":
    main()
