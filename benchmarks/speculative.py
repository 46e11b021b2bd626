"""Plain vs draft-model vs prompt-lookup decoding, in one process run.

    python benchmarks/speculative.py TARGET [--draft DRAFT] [--draft-layers N] [--repeat 2]

TARGET is any model folder (the issue's setting: SmolLM2-135M converted to
float32). The draft is DRAFT (e.g. the same model at 4 bits) or, with
--draft-layers, the target's first N layers (a truncated-layer variant sharing
its weights). Two prompts: (a) a code edit that repeats its input, (b) an open
chat question; temperatures 0 and 0.7. Modes run alternately within each
repeat; the table shows median decode tok/s, speedup over plain, and acceptance.
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
PROMPTS = {
    "code-edit": "Add a new item <li><a href=\"/shop\">Shop</a></li> after Blog in this HTML menu "
    "and reply with the whole menu:\n\n```html\n" + NAV + "\n```",
    "open-chat": "Tell me a short story about a lighthouse keeper who befriends a seagull.",
}


def truncated(model, layers: int):
    """The target's first `layers` blocks with its own norm and head: a free draft."""
    draft = copy.copy(model)
    draft.model = copy.copy(model.model)
    draft.model.layers = model.model.layers[:layers]
    return draft


def decode_run(model, tok, prompt: str, temperature: float, max_tokens: int, **spec) -> dict:
    messages = [{"role": "user", "content": prompt}]
    last = None
    for last in mlxinfer.stream_generate(model, tok, messages, max_tokens=max_tokens, temperature=temperature,
                                         seed=0, ignore_eos=True, **spec):
        pass
    s = last.stats
    return {"tps": s.decode_tps, "acceptance": s.acceptance_rate, "mean_accepted": s.mean_accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--draft", help="draft model folder")
    ap.add_argument("--draft-layers", type=int, help="use the target's first N layers as the draft")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=6)
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
        if spec:
            spec["num_draft_tokens"] = args.num_draft_tokens

    rows = []
    for name, prompt in PROMPTS.items():
        for temperature in (0.0, 0.7):
            decode_run(model, tok, prompt, temperature, 8)
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.repeat):
                for mode, spec in modes.items():
                    runs[mode].append(decode_run(model, tok, prompt, temperature, args.max_tokens, **spec))
            plain = statistics.median(r["tps"] for r in runs["plain"])
            for mode, rs in runs.items():
                tps = statistics.median(r["tps"] for r in rs)
                rows.append({"prompt": name, "temperature": temperature, "mode": mode, "decode_tps": tps,
                             "speedup": tps / plain, "acceptance": statistics.median(r["acceptance"] for r in rs),
                             "mean_accepted": statistics.median(r["mean_accepted"] for r in rs)})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'prompt':<10} {'temp':>4} {'mode':<10} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'acc/round':>9}")
    for r in rows:
        print(f"{r['prompt']:<10} {r['temperature']:>4} {r['mode']:<10} {r['decode_tps']:7.1f} "
              f"{r['speedup']:7.2f}x {r['acceptance']:7.0%} {r['mean_accepted']:9.2f}")


if __name__ == "__main__":
    main()
