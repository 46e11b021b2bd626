"""`mlxinfer` under mlx.launch with Ctrl-C reaching rank 0 in the middle of a reply, for
tests/test_shard.py (not a test module): rank 0 sends itself SIGINT at its
MLXINFER_TEST_INTERRUPT_AT-th engine step, as a person pressing Ctrl-C at some token would,
but at a point the test can name."""

from __future__ import annotations

import os
import signal

import mlxinfer  # noqa: F401  (first: it binds MLX's BLAS)

from mlxinfer.cli.main import main  # noqa: E402
from mlxinfer.engine.replica import Replica  # noqa: E402

step, steps = Replica.step, [0]
AT = int(os.environ["MLXINFER_TEST_INTERRUPT_AT"])


def interrupted_step(self):
    steps[0] += 1
    if steps[0] == AT:
        os.kill(os.getpid(), signal.SIGINT)
    return step(self)


Replica.step = interrupted_step

if __name__ == "__main__":
    main()
