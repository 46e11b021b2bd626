"""Tensor parallelism on one machine: decode tok/s and bytes exchanged per token at 1, 2
and 4 ranks (`mlx.launch`, ring backend over 127.0.0.1).

    python benchmarks/distributed.py                  # ~58M float32 Llama, random weights
    python benchmarks/distributed.py --ranks 1,2 --max-tokens 64 --repeat 3 --json

Here the ranks share one machine's two cores, so this measures the communication and
synchronisation overhead of sharding, not a speed-up: every rank does 1/N of the
arithmetic, but all of them run on the same cores and each block half waits for an
all_sum over loopback TCP. Bytes per token are what one rank sends per decoded token
(`mlxinfer.models.shard.bytes_per_token`: an all_sum of the hidden state per block half and
after the embedding, and the logits all_gather); beside it, the measured bytes handed to
the collectives in one decode step (the two agree once the ring's 2(N-1)/N for all_sum and
(N-1)/N for all_gather are applied).

Method: each run loads the model (sharded when N > 1), decodes `--max-tokens` greedy
tokens from a 32-token random prompt with EOS ignored, and reports the generation's own
decode tok/s; medians of `--repeat` runs per rank count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx  # noqa: E402, I001
from fixtures import build_llama_50m  # noqa: E402
from mlxinfer.cli.bench import random_prompt  # noqa: E402
from mlxinfer.models.shard import bytes_per_token, launched, resident_bytes  # noqa: E402


def worker(folder: Path, max_tokens: int, repeat: int) -> None:
    """One rank (or the lone process): decode tok/s of `repeat` generations, printed by rank 0 as JSON."""
    model, tokenizer = mlxinfer.load(folder, shard="tensor" if launched() else None)
    prompt = random_prompt(model.config.vocab_size, 32)
    rates = []
    for _ in range(repeat + 1):  # the first warms up
        last = None
        for chunk in mlxinfer.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True):
            last = chunk
        rates.append(last.stats.decode_tps)
    place = getattr(model, "shard", None)
    payload = collective_payload(model, prompt) if place is not None else 0
    if place is None or place.rank == 0:
        dtype_bytes = model.model.norm.weight.dtype.size
        print(json.dumps({"ranks": place.size if place else 1, "decode_tps": statistics.median(rates[1:]),
                          "weight_bytes": resident_bytes(model),
                          "bytes_per_token": bytes_per_token(model.config, place, dtype_bytes) if place else 0,
                          "payload_per_token": payload}),
              flush=True)


def collective_payload(model, prompt: list[int]) -> int:
    """Bytes handed to all_sum / all_gather during one decode step, counted by wrapping them."""
    from mlxinfer.models.prompt_cache import PromptCache

    counted = [0]
    originals = mx.distributed.all_sum, mx.distributed.all_gather

    def counting(original):
        def collective(x, *args, **kwargs):
            counted[0] += x.nbytes
            return original(x, *args, **kwargs)
        return collective

    cache = PromptCache.for_model(model)
    mx.eval(cache.run(model, prompt))
    mx.distributed.all_sum, mx.distributed.all_gather = (counting(f) for f in originals)
    try:
        mx.eval(cache.run(model, [1]))
    finally:
        mx.distributed.all_sum, mx.distributed.all_gather = originals
    return counted[0]


def run(folder: Path, ranks: int, max_tokens: int, repeat: int) -> dict | None:
    here = [str(Path(__file__).resolve()), "--worker", str(folder), "--max-tokens", str(max_tokens),
            "--repeat", str(repeat)]
    if ranks == 1:
        command = [sys.executable, *here]
    else:
        launcher = Path(sys.executable).parent / "mlx.launch"
        command = [str(launcher), "-n", str(ranks), "--backend", "ring", "--python", sys.executable, "--", *here]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(f"{ranks} ranks: no result ({(done.stderr or done.stdout).strip().splitlines()[-1:]})")
        return None
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker), args.max_tokens, args.repeat)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_llama_50m(Path(tmp) / "llama")
        results = [r for n in sorted({int(x) for x in args.ranks.split(",")})
                   if (r := run(folder, n, args.max_tokens, args.repeat)) is not None]
    if args.json:
        print(json.dumps(results))
        return
    print(f"\n~58M float32 Llama, {args.max_tokens} greedy tokens, median of {args.repeat}, one 2-core machine")
    print(f"  {'ranks':>5} | {'decode tok/s':>12} | {'weights/rank MiB':>16} | {'collective input/token KiB':>26} | "
          f"{'sent/token KiB':>14}")
    for r in results:
        print(f"  {r['ranks']:>5} | {r['decode_tps']:>12.1f} | {r['weight_bytes'] / 2**20:>16.1f} | "
              f"{r['payload_per_token'] / 1024:>26.1f} | {r['bytes_per_token'] / 1024:>14.1f}")


if __name__ == "__main__":
    main()
