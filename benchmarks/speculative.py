"""Plain vs draft-model vs prompt-lookup decoding, in one process run.

    python benchmarks/speculative.py TARGET [--draft DRAFT] [--draft-layers N] [--repeat 2]

TARGET is any model folder (the issue's setting: SmolLM2-135M converted to
float32). The draft is DRAFT (e.g. the same model at 4 bits) or, with
--draft-layers, the target's first N layers (a truncated-layer variant sharing
its weights). Two prompts: (a) a code edit that repeats its input, (b) an open
chat question; temperatures 0 and 0.7. Modes run alternately within each
repeat, and repeat i samples with seed i, so at temperature 0.7 the medians
cover several sampled answers; the table shows median decode tok/s, the
median and worst of the per-seed speedups over plain (each mode runs right
after plain with the same seed), and acceptance.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import mlxinfer

NAV = """<nav class="site-menu">
  <ul>
    <li><a href="/">Home</a></li>
    <li><a href="/about">About us</a></li>
    <li><a href="/blog">Blog</a></li>
    <li><a href="/projects">Projects</a></li>
    <li><a href="/careers">Careers</a></li>
    <li><a href="/contact">Contact</a></li>
  </ul>
</nav>"""
NAV_SHOP = NAV.replace("Blog</a></li>\n", "Blog</a></li>\n    <li><a href=\"/shop\">Shop</a></li>\n")
PROMPTS = {
    # A second edit in a code-editing chat: the answer repeats the file with one change.
    "code-edit": [
        {"role": "user", "content": "Add a Shop item after Blog in this HTML menu and reply with the whole menu:"
         "\n\n```html\n" + NAV + "\n```"},
        {"role": "assistant", "content": "```html\n" + NAV_SHOP + "\n```"},
        {"role": "user", "content": "Now add an FAQ item after Careers and reply with the whole menu again."},
    ],
    "open-chat": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper who befriends a seagull."}],
}


def truncated(model, layers: int):
    """The target's first `layers` blocks with its own norm and head: a free draft."""
    draft = copy.copy(model)
    draft.model = copy.copy(model.model)
    draft.model.layers = model.model.layers[:layers]
    return draft


def decode_run(model, tok, messages: list[dict], temperature: float, max_tokens: int, seed: int, **spec) -> dict:
    last = None
    for last in mlxinfer.stream_generate(model, tok, messages, max_tokens=max_tokens, temperature=temperature,
                                         seed=seed, ignore_eos=True, **spec):
        pass
    s = last.stats
    return {"tps": s.decode_tps, "acceptance": s.acceptance_rate, "mean_accepted": s.mean_accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--draft", help="draft model folder")
    ap.add_argument("--draft-layers", type=int, help="use the target's first N layers as the draft")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, help="default: the library's (8 lookup, 4 draft model)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model, tok = mlxinfer.load(args.target)
    modes: dict[str, dict] = {"plain": {}, "lookup": {"prompt_lookup": True}}
    if args.draft:
        modes["draft"] = {"draft_model": mlxinfer.load(args.draft)[0]}
    if args.draft_layers:
        modes[f"draft-{args.draft_layers}L"] = {"draft_model": truncated(model, args.draft_layers)}
    for spec in modes.values():
        if spec and args.num_draft_tokens:
            spec["num_draft_tokens"] = args.num_draft_tokens

    rows = []
    for name, prompt in PROMPTS.items():
        for temperature in (0.0, 0.7):
            decode_run(model, tok, prompt, temperature, 8, 0)
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for seed in range(args.repeat):
                for mode, spec in modes.items():
                    runs[mode].append(decode_run(model, tok, prompt, temperature, args.max_tokens, seed, **spec))
            for mode, rs in runs.items():
                speedups = [r["tps"] / p["tps"] for r, p in zip(rs, runs["plain"])]
                rows.append({"prompt": name, "temperature": temperature, "mode": mode,
                             "decode_tps": statistics.median(r["tps"] for r in rs),
                             "speedup": statistics.median(speedups), "min_speedup": min(speedups),
                             "acceptance": statistics.median(r["acceptance"] for r in rs),
                             "mean_accepted": statistics.median(r["mean_accepted"] for r in rs)})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'prompt':<10} {'temp':>4} {'mode':<10} {'tok/s':>7} {'speedup':>8} {'worst':>6} {'accept':>7} {'acc/round':>9}")
    for r in rows:
        print(f"{r['prompt']:<10} {r['temperature']:>4} {r['mode']:<10} {r['decode_tps']:7.1f} "
              f"{r['speedup']:7.2f}x {r['min_speedup']:5.2f}x {r['acceptance']:7.0%} {r['mean_accepted']:9.2f}")


if __name__ == "__main__":
    main()
