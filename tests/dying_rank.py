"""`mlxinfer` under mlx.launch with rank 1 dying after a few forward passes, for
tests/test_shard.py (not a test module): rank 0 must end with one line, not hang.
With MLXINFER_TEST_FAULT=hang rank 1 stops answering instead (as a frozen machine
would: alive, its connections open, its own watchdog silent)."""

from __future__ import annotations

import os
import time

import mlxinfer  # noqa: F401  (first: it binds MLX's BLAS)
import mlx.core as mx  # noqa: E402, I001

from mlxinfer.models.prompt_cache import PromptCache  # noqa: E402
from mlxinfer.cli.main import main  # noqa: E402

run, calls = PromptCache.run, [0]
HANG = os.environ.get("MLXINFER_TEST_FAULT") == "hang"
if HANG and os.environ.get("MLX_RANK") == "1":
    os.environ["MLXINFER_PEER_TIMEOUT"] = "3600"


def dying_run(self, model, tokens, *inputs):
    calls[0] += 1
    if calls[0] == 6 and mx.distributed.init().rank() == 1:
        if HANG:
            time.sleep(3600)
        os._exit(3)
    return run(self, model, tokens, *inputs)


PromptCache.run = dying_run

if __name__ == "__main__":
    main()
