"""Predicted Outputs: decode speed of a code edit with and without the prediction, in one process run.

    python benchmarks/prediction.py [MODEL] [--dtype float32] [--repeat 3] [--max-tokens 600]

MODEL is anything --model accepts; by default the demo model (SmolLM2-135M-Instruct) if it is
in mlxinfer's cache, else the test suite's copy of its GGUF (~/.cache/mlxinfer-test-assets,
converted once into mlxinfer's cache). The prompt asks to rename a variable in a ~60-line
function and reply with the whole function; the prediction is the function as it stands (what
an editor sends: most of the reply is that text). Greedy decoding, plain and predicted runs
alternating; the table shows median decode tok/s of each, the ratio, the drafted tokens
accepted and rejected, and whether the two outputs were identical (they must be). Run it on
an idle machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import mlxinfer  # noqa: F401  (first: it picks MLX's BLAS)
from fixtures import SMOLLM2_GGUF, load_average
from mlxinfer.base.cachedir import is_model_folder, models_dir
from mlxinfer.cli.demo import NAME
from mlxinfer.engine.generate import stream_generate
from mlxinfer.cli.store import open_model

FUNCTION = '''def summarize_orders(orders, tax_rate=0.08, discount_threshold=100.0):
    """Summarize a list of orders into totals per customer and overall statistics."""
    total = 0.0
    per_customer = {}
    largest_order = None
    skipped = []
    for order in orders:
        if order is None:
            skipped.append(order)
            continue
        customer = order.get("customer", "unknown")
        items = order.get("items", [])
        if not items:
            skipped.append(order)
            continue
        subtotal = 0.0
        for item in items:
            price = float(item.get("price", 0.0))
            quantity = int(item.get("quantity", 1))
            if quantity <= 0:
                continue
            subtotal += price * quantity
        if subtotal >= discount_threshold:
            subtotal *= 0.95
        tax = subtotal * tax_rate
        order_total = subtotal + tax
        total += order_total
        if customer not in per_customer:
            per_customer[customer] = {"orders": 0, "spent": 0.0}
        per_customer[customer]["orders"] += 1
        per_customer[customer]["spent"] += order_total
        if largest_order is None or order_total > largest_order["total"]:
            largest_order = {"customer": customer, "total": order_total}
    count = sum(entry["orders"] for entry in per_customer.values())
    if count:
        average = total / count
    else:
        average = 0.0
    best_customer = None
    best_spent = -1.0
    for customer, entry in per_customer.items():
        if entry["spent"] > best_spent:
            best_customer = customer
            best_spent = entry["spent"]
    report = {
        "total": round(total, 2),
        "average": round(average, 2),
        "orders": count,
        "customers": len(per_customer),
        "best_customer": best_customer,
        "largest_order": largest_order,
        "skipped": len(skipped),
    }
    if total > 10000:
        report["tier"] = "gold"
    elif total > 1000:
        report["tier"] = "silver"
    else:
        report["tier"] = "bronze"
    return report
'''
PREDICTION = f"```python\n{FUNCTION}```"
MESSAGES = [{"role": "user", "content": "Rename the variable `total` to `grand_total` in this function and reply with "
             f"the whole function, nothing else:\n\n{PREDICTION}"}]


def default_model() -> str:
    demo = models_dir() / NAME
    if is_model_folder(demo):
        return str(demo)
    if SMOLLM2_GGUF.is_file():
        return str(SMOLLM2_GGUF)
    sys.exit(f"no model: the demo model is not in {models_dir()} and {SMOLLM2_GGUF} is missing; pass a MODEL")


def decode_run(model, tok, max_tokens: int, **options) -> tuple[list[int], dict]:
    chunks = list(stream_generate(model, tok, MESSAGES, max_tokens=max_tokens, temperature=0.0, **options))
    s = chunks[-1].stats
    return [c.token for c in chunks if c.token is not None], {
        "tps": s.decode_tps, "tokens": s.generated_tokens, "accepted": s.accepted,
        "rejected": s.drafted - s.accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="anything --model accepts (default: the demo model)")
    ap.add_argument("--dtype", help="e.g. float32 (default: the checkpoint's)")
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"load average before: {load_average()}")
    model, tok, where = open_model(args.model or default_model(), args.dtype)
    print(f"model: {where} ({args.dtype or 'as stored'}); prompt {len(tok.apply_chat_template(MESSAGES, tokenize=True))} "
          f"tokens, prediction {len(tok.encode(PREDICTION, add_special_tokens=False))} tokens")
    decode_run(model, tok, 16)  # warm-up
    decode_run(model, tok, 16, prediction=PREDICTION)
    runs: dict[str, list[dict]] = {"plain": [], "predicted": []}
    outputs: dict[str, list[list[int]]] = {"plain": [], "predicted": []}
    for _ in range(args.repeat):
        for mode, options in (("plain", {}), ("predicted", {"prediction": PREDICTION})):
            tokens, run = decode_run(model, tok, args.max_tokens, **options)
            runs[mode].append(run)
            outputs[mode].append(tokens)
    same = all(t == outputs["plain"][0] for ts in outputs.values() for t in ts)
    plain, predicted = (statistics.median(r["tps"] for r in runs[m]) for m in ("plain", "predicted"))
    last = runs["predicted"][-1]
    print(f"{'mode':<10} {'tok/s':>7} {'tokens':>7} {'accepted':>9} {'rejected':>9}")
    for mode in runs:
        r = runs[mode][-1]
        print(f"{mode:<10} {statistics.median(x['tps'] for x in runs[mode]):7.1f} {r['tokens']:7d} "
              f"{r['accepted']:9d} {r['rejected']:9d}")
    print(f"predicted / plain: {predicted / plain:.2f}x (median of {args.repeat}); "
          f"{last['accepted'] / max(last['tokens'], 1):.0%} of the reply's tokens were accepted drafts; "
          f"outputs identical: {same}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
