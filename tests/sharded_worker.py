"""Run under `mlx.launch -n N` by tests/test_shard.py (not a test module): for each job, load a
model sharded across the ranks, and write what rank R computed to OUT/rank{R}.json: logits of
a fixed prompt (run into a fresh KV cache), the KV heads that cache holds per layer (and the
shapes of each recurrent layer's state), a greedy
generation, the bytes of its parameters, and the split as `inspect` reports it.

    sharded_worker.py JOBS     (JOBS: a JSON file, a list of {"model", "out", "dtype", "split"}; optional:
                                "adapter", a LoRA adapter to load with the model, and "model_for_rank_1",
                                another checkpoint there, to be refused)

The jobs run one after another in one launch, as each would in a launch of its own: a launch
costs every rank a Python start, mlxinfer's import and MLX's ring set-up. A job that fails
writes OUT/rank{R}.error (its traceback, also printed) and the next job runs; the exit status
is then 1.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import mlxinfer  # noqa: F401  (first: it binds MLX's BLAS)
import mlx.core as mx  # noqa: E402, I001

from mlxinfer.models.cache import make_cache  # noqa: E402
from mlxinfer.models.shard import layout, resident_bytes  # noqa: E402


def run(job: dict, group) -> None:
    model_path = job["model_for_rank_1"] if group.rank() == 1 and "model_for_rank_1" in job else job["model"]
    model, tokenizer = mlxinfer.load(Path(model_path), dtype=job["dtype"], shard=job["split"],
                                     adapter_path=job.get("adapter"))
    prompt = list(range(3, 40))
    cache = make_cache(model)
    logits = model(mx.array([prompt]), cache)[0].astype(mx.float32)
    tokens = [c.token for c in mlxinfer.stream_generate(model, tokenizer, prompt, max_tokens=12, temperature=0.0,
                                                        ignore_eos=True)]
    (Path(job["out"]) / f"rank{group.rank()}.json").write_text(json.dumps({
        "rank": group.rank(), "size": group.size(), "logits": logits.tolist(), "tokens": tokens,
        "bytes": resident_bytes(model), "cached_kv_heads": [c.keys[0].shape[1] for c in cache if hasattr(c, "keys")],
        "state_shapes": [[list(a.shape) for a in c.state] for c in cache if not hasattr(c, "keys")],
        "layout": layout(model)}))


def main() -> None:
    group = mx.distributed.init()
    failed = False
    for job in json.loads(Path(sys.argv[1]).read_text()):
        try:
            run(job, group)
        except Exception:
            failed = True
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            (Path(job["out"]) / f"rank{group.rank()}.error").write_text(error)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
