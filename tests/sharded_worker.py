"""Run under `mlx.launch -n N` by tests/test_shard.py (not a test module): load a model
sharded across the ranks, and write what rank R computed to OUT/rank{R}.json: logits of
a fixed prompt (run into a fresh KV cache), the KV heads that cache holds per layer (and the
shapes of each recurrent layer's state), a greedy
generation, the bytes of its parameters, and the split as `inspect` reports it.

    sharded_worker.py MODEL OUT [DTYPE] [MODEL_FOR_RANK_1]     (MLXINFER_TEST_SHARD=pipeline: by layers;
                                                               MLXINFER_TEST_ADAPTER=DIR: with that LoRA adapter)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlxinfer  # noqa: F401  (first: it binds MLX's BLAS)
import mlx.core as mx  # noqa: E402, I001

from mlxinfer.cache import make_cache  # noqa: E402
from mlxinfer.shard import layout, resident_bytes  # noqa: E402


def main() -> None:
    model_path, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else "") or None
    group = mx.distributed.init()
    if len(sys.argv) > 4 and group.rank() == 1:  # a different checkpoint on rank 1: must be refused
        model_path = Path(sys.argv[4])
    model, tokenizer = mlxinfer.load(model_path, dtype=dtype, shard=os.environ.get("MLXINFER_TEST_SHARD", "tensor"),
                                     adapter_path=os.environ.get("MLXINFER_TEST_ADAPTER"))
    prompt = list(range(3, 40))
    cache = make_cache(model)
    logits = model(mx.array([prompt]), cache)[0].astype(mx.float32)
    tokens = [c.token for c in mlxinfer.stream_generate(model, tokenizer, prompt, max_tokens=12, temperature=0.0,
                                                        ignore_eos=True)]
    (out / f"rank{group.rank()}.json").write_text(json.dumps({
        "rank": group.rank(), "size": group.size(), "logits": logits.tolist(), "tokens": tokens,
        "bytes": resident_bytes(model), "cached_kv_heads": [c.keys[0].shape[1] for c in cache if hasattr(c, "keys")],
        "state_shapes": [[list(a.shape) for a in c.state] for c in cache if not hasattr(c, "keys")],
        "layout": layout(model)}))


if __name__ == "__main__":
    main()
