"""An agent loop on a hybrid model: how much history each turn prefills again, with the
prompt-cache pool (what `mlxinfer serve` runs) and without it.

    python benchmarks/agent_loop.py                  # builds a ~58M float32 Qwen3.5-style hybrid
    python benchmarks/agent_loop.py PATH --turns 8   # any checkpoint mlxinfer loads

Each turn resends the whole conversation, as an agent framework does over the API: the history
so far, the previous reply as the template renders it back (its first `--rewrite` tokens
dropped, as Qwen's template drops a reply's thinking), and a tool result of `--tool-tokens`
tokens; the model replies with `--reply-tokens`. A recurrent layer's state cannot be cut back
to where the rewritten reply diverges; the pool reuses the state checkpointed at the end of
the previous turn's prompt (`cache.StateCache`), so a turn prefills the reply's rewrite and
the new tool result only. Without the pool every turn prefills everything. The table shows
per turn the prompt length, the tokens prefilled and the time to first token, for both.
Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlxinfer  # noqa: F401  (first: it picks MLX's BLAS)
import numpy as np  # noqa: E402, I001
from fixtures import build_hybrid  # noqa: E402
from mlxinfer.engine.batch import BatchGenerator  # noqa: E402
from mlxinfer.engine.pool import PromptCachePool  # noqa: E402


def turn(engine: BatchGenerator, prompt: list[int], reply_tokens: int) -> tuple[list[int], int, float]:
    """One request through the engine: (reply ids, tokens prefilled, seconds to the first token)."""
    start = time.perf_counter()
    uid = engine.submit(prompt, max_tokens=reply_tokens, ignore_eos=True, temperature=0.0)
    reply, first, stats = [], None, None
    for u, chunk in engine.stream():
        assert u == uid
        first = first or time.perf_counter()
        reply.append(chunk.token)
        stats = chunk.stats
    return reply, stats.prefill_tokens, first - start


def loop(model, tok, args, pooled: bool) -> list[tuple[int, int, float]]:
    """(prompt tokens, prefilled, TTFT) per turn; the same conversation either way (greedy)."""
    pool = PromptCachePool(2**31 - 1) if pooled else None
    engine = BatchGenerator(model, tok, max_batch=1, pool=pool)
    rng = np.random.default_rng(0)
    history = rng.integers(2, model.config.vocab_size, args.system_tokens).tolist()
    rows = []
    for _ in range(args.turns):
        reply, prefilled, ttft = turn(engine, history, args.reply_tokens)
        rows.append((len(history), prefilled, ttft))
        history = history + reply[args.rewrite :] + rng.integers(2, model.config.vocab_size, args.tool_tokens).tolist()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="checkpoint folder (default: build a ~58M float32 hybrid)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500, help="system prompt and tool definitions")
    ap.add_argument("--tool-tokens", type=int, default=300, help="each turn's tool result")
    ap.add_argument("--reply-tokens", type=int, default=24)
    ap.add_argument("--rewrite", type=int, default=8, help="leading reply tokens the template drops")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else build_hybrid(Path(tmp))
        model, tok = mlxinfer.load(path)
        with_pool, without = loop(model, tok, args, True), loop(model, tok, args, False)
    print(f"{'turn':>4} {'prompt':>7} | {'pool: prefilled':>15} {'TTFT s':>7} | {'no pool: prefilled':>18} {'TTFT s':>7}")
    for i, ((n, a, ta), (_, b, tb)) in enumerate(zip(with_pool, without), 1):
        print(f"{i:>4} {n:>7} | {a:>15} {ta:>7.2f} | {b:>18} {tb:>7.2f}")
    later = slice(1, None)  # turn 1 has nothing to reuse either way
    a = sum(r[1] for r in with_pool[later]), sum(r[2] for r in with_pool[later])
    b = sum(r[1] for r in without[later]), sum(r[2] for r in without[later])
    print(f"turns 2-{args.turns}: {a[0]} tokens prefilled in {a[1]:.2f} s with the pool, {b[0]} in {b[1]:.2f} s "
          f"without ({b[1] / max(a[1], 1e-9):.1f}x the time to first tokens)")


if __name__ == "__main__":
    main()
