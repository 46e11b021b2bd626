"""Time each custom kernel against its MLX reference on realistic inputs.

On Metal both run and the kernel's disagreement with the reference is shown;
elsewhere only the references run, so their regressions show too.

    python benchmarks/kernels.py [--repeat N]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from mlxinfer import kernels
from mlxinfer.kernels.selfcheck import CASES, Sizes, timed

SWEEPS = {
    "attention": [replace(Sizes(), keys=n) for n in (1024, 4096, 16384)],
    "sampling": [replace(Sizes(), vocab=v, rows=1) for v in (32000, 152064, 262144)],
    "verify": [replace(Sizes(), vocab=v, rows=4) for v in (32000, 152064, 262144)],
}
SIZE_OF = {"attention": lambda s: f"{s.keys} keys (mean of 2)", "sampling": lambda s: f"V={s.vocab}",
           "verify": lambda s: f"k={s.drafts} V={s.vocab}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat
    metal = kernels.metal_available()
    print(f"kernels on {'Metal' if metal else 'CPU (references only)'}; median ms per call over {repeat} runs")
    print(f"{'kernel':<11}{'size':<20}{'reference ms':>14}" + (f"{'kernel ms':>11}{'speed-up':>10}{'error':>10}"
                                                           if metal else ""))
    for case in CASES:
        for sizes in SWEEPS[case.name]:
            inputs = case.inputs(sizes, np.random.default_rng(0))
            expected, ref_ms = timed(case.reference, inputs, repeat)
            line = f"{case.name:<11}{SIZE_OF[case.name](sizes):<20}{ref_ms:>14.3f}"
            if metal:
                got, kernel_ms = timed(case.kernel, inputs, repeat)
                line += f"{kernel_ms:>11.3f}{ref_ms / kernel_ms:>9.1f}x{case.error(expected, got):>10.2e}"
            print(line)


if __name__ == "__main__":
    main()
