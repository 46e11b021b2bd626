"""The CPU extension's quantized GEMM (every prefill product of a quantized model) against the
machine's peak FLOP rate and against dequantize + BLAS (the path prompts past 256 rows took
before), on SmolLM2-135M's projections and a 1.5B model's (Qwen2.5-1.5B: hidden 1536,
intermediate 8960), at 256 to 2048 rows.

The roofline is the extension's `peak_gflops()`: every pool thread running multiply-add chains
in registers at the widest vector width the loops use. Both paths run alternately in one process
(best of --repeat runs each), so machine load hits both; the load is printed with the numbers.

    python benchmarks/cpu_gemm.py [--rows 256 512 1024 2048] [--bits 4] [--group 32] [--repeat 5] [--large]
"""

from __future__ import annotations

import argparse

import mlxinfer  # noqa: F401  (first: it binds a fast BLAS before mlx.core loads)
import mlx.core as mx

from mlxinfer.cli.bench import Quiet
from mlxinfer.cli.doctor import best_cpu_seconds
from mlxinfer.kernels import quantized_matmul

# (name, outputs, inputs) of one layer's products
SMOLLM2 = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
QWEN_1_5B = [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="also a 1.5B model's shapes (slow)")
    args = parser.parse_args()
    ext = quantized_matmul.extension()
    if ext is None:
        raise SystemExit(f"the CPU extension is {quantized_matmul.reason()}")
    mx.set_default_device(mx.cpu)
    quiet = Quiet()
    peak = ext.peak_gflops()
    print(f"roofline: {peak:.0f} GFLOP/s ({ext.simd()} multiply-adds on {ext.threads()} threads); "
          f"{args.bits}-bit weights, groups of {args.group}, half scales as a GGUF's")
    print(f"{'model':<9}{'layer':<9}{'rows':>6}{'GEMM ms':>10}{'GFLOP/s':>9}{'of peak':>9}"
          f"{'deq+BLAS ms':>13}{'GFLOP/s':>9}{'speed-up':>10}")
    models = [("135M", SMOLLM2)] + ([("1.5B", QWEN_1_5B)] if args.large else [])
    for model, layers in models:
        for name, out, inputs in layers:
            w = mx.random.normal((out, inputs), key=mx.random.key(0))
            packed, scales, biases = mx.quantize(w, group_size=args.group, bits=args.bits)
            half = scales.astype(mx.float16), biases.astype(mx.float16)
            for rows in args.rows:
                x = mx.random.normal((rows, inputs), key=mx.random.key(rows))
                mx.eval(x, packed, scales, biases, *half)
                ours = best_cpu_seconds(lambda: ext.affine_quantized_matmul(x, packed, *half, args.group, args.bits),
                                    args.repeat)
                blas = best_cpu_seconds(lambda: x @ mx.dequantize(packed, scales, biases, group_size=args.group,
                                                              bits=args.bits).T, args.repeat)
                flops = 2 * rows * out * inputs / 1e9
                print(f"{model:<9}{name:<9}{rows:>6}{ours * 1e3:>10.2f}{flops / ours:>9.0f}{flops / ours / peak:>9.0%}"
                      f"{blas * 1e3:>13.2f}{flops / blas:>9.0f}{blas / ours:>9.2f}x")
    print(quiet.report()[0])


if __name__ == "__main__":
    main()
