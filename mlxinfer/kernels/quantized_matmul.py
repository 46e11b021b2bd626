"""x @ W.T for an affine-quantized W: the one place quantized linear layers (and the
quantized LM head) choose how to multiply.

On MLX's CPU backend `mx.quantized_matmul` is slow (a 4-bit matrix-vector product
reads ~0.5 GB/s), and costs as much per extra row as for the first. So off Metal:

- with the compiled primitive `mlxinfer.kernels._cpu_qmm` (built by setup.py where a C++
  compiler is found), every row count runs it: 1-4 rows (decode) unpack the weights once per
  4 rows, 5 or more (batches, speculative verification, prompts) dequantize them once per block
  of rows into a cache-blocked GEMM (AVX-512 or AVX2, all cores). Every row is accumulated in
  float32 in the same order whatever the number of rows, so a sequence's result never depends
  on its batch, and prefill no longer depends on the system BLAS: on SmolLM2-135M (2 cores) the
  GEMM ran 1.4-2x faster than dequantize + a good BLAS at 256-2048 rows, and 5-6x faster than
  a BLAS running its generic kernels (OpenBLAS 0.3.21 on newer Xeons);
- without it, from `DEQUANTIZE_ROWS` rows the weights are dequantized once and the product
  goes to BLAS (a 512-token prefill through a 1536x576 4-bit layer: 36 ms, against 679 ms for
  MLX's quantized matmul); fewer rows (or `MLXINFER_CPU_QMM=off`) take MLX's quantized matmul.

The floating-point modes (mxfp4, as gpt-oss ships its experts; mxfp8, nvfp4) always go to
MLX's quantized matmul: the extension is affine-only, and on the CPU MLX's mxfp4 product was
no slower than dequantize + BLAS at 1 to 512 rows (1024 x 1024).

On Metal MLX's own kernels always run. The extension is checked when first loaded: it
must be built against the MLX release in use and agree with `mx.quantized_matmul` on a
small product, or it stays unused and `reason()` says why.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from ..base.errors import InvalidOptionError

DEQUANTIZE_ROWS = 8
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
MODES = ("auto", "off")
# What this package calls in the extension: a build from older sources lacks some.
ENTRY_POINTS = ("affine_quantized_matmul", "affine_gather_quantized_matmul", "attention", "decode_layer_in",
                "decode_layer_out", "logsumexp", "peak_gflops")
_loaded: list[ModuleType | None] = []
_why_not: list[str] = []
# Beside the package: why setup.py did not build the extension (no C++ compiler, ...), for the first run's hint.
REASON_FILE = Path(__file__).resolve().parent / "_cpu_qmm.not-built"


def mode() -> str:
    """`MLXINFER_CPU_QMM`: `auto` (the extension where it applies) or `off` (pure MLX)."""
    value = os.environ.get("MLXINFER_CPU_QMM", "auto")
    if value not in MODES:
        raise InvalidOptionError(f"MLXINFER_CPU_QMM must be one of {', '.join(MODES)}, got {value!r}")
    return value


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.32.4' or '0.32.4.dev2025+abc'."""
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


def _self_check(ext: ModuleType) -> str | None:
    """Why the extension must not be used (None if it may): a product against MLX's."""
    key = mx.random.key(0)
    w = mx.random.normal((40, 128), key=key)
    x = mx.random.normal((3, 128), key=mx.random.split(key)[0])
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    with mx.stream(mx.cpu):
        expected = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=32, bits=4)
    try:
        got = ext.affine_quantized_matmul(x, packed, scales, biases, 32, 4)
        error = mx.abs(got - expected).max().item()
    except (TypeError, ValueError, RuntimeError) as e:
        return f"it fails on a test product ({e})"
    return None if error < 1e-3 else f"it disagrees with mx.quantized_matmul (max abs error {error:.2g})"


def extension() -> ModuleType | None:
    """The compiled module if it is built, matches this MLX and passes its check (once per process)."""
    if not _loaded:
        ext, why = None, None
        try:
            from . import _cpu_qmm as ext
        except ImportError as e:  # `from` says "cannot import name" whether the file is missing or broken
            missing = importlib.util.find_spec(f"{__package__}._cpu_qmm") is None
            why = _not_built() if missing else f"built but unloadable ({e})"
        if ext is not None and _release(ext.mlx_version) != _release(mx.__version__):
            why = f"built for MLX {ext.mlx_version}, but MLX {mx.__version__} is installed"
        if ext is not None and why is None and not all(hasattr(ext, name) for name in ENTRY_POINTS):
            why = "built from older sources than this mlxinfer's; reinstall it (pip install -e .) to rebuild"
        if ext is not None and why is None:
            why = _self_check(ext)
        _loaded.append(ext if why is None else None)
        _why_not.append(why or "")
    return _loaded[0]


def _not_built() -> str:
    try:
        return f"not built ({REASON_FILE.read_text(encoding='utf-8').strip()[:200]})"
    except OSError:
        return "not built"


def reason() -> str:
    """Why the extension is unavailable ('' when it is available)."""
    extension()
    return _why_not[0]


def implementation(rows: int = 1) -> str:
    """What a product over `rows` rows runs here: 'cpu-extension', 'dequantize+blas' or 'mlx'."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "mlx"
    if mode() == "auto" and extension() is not None:
        return "cpu-extension"
    return "dequantize+blas" if rows >= DEQUANTIZE_ROWS else "mlx"


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
                     bits: int, mode: str = "affine") -> mx.array:
    """x [..., in] @ dequantize(w).T -> [..., out] by the fastest way this device has."""
    if mode != "affine" or biases is None or bits not in BITS or group_size not in GROUP_SIZES:
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode)
    impl = implementation(x.size // x.shape[-1])
    if impl == "cpu-extension":
        return extension().affine_quantized_matmul(x, w, scales, biases, group_size, bits)
    scales, biases = like(x, scales, biases)
    if impl == "dequantize+blas":
        return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def half_scales_read_exactly() -> bool:
    """Whether quantized layers here may keep half-precision scales and biases beside float32
    activations: the extension reads them as stored and computes in float32 (so the result is the
    one float32 scales give) while reading fewer bytes per weight (4-bit, group 32: 20 instead of 24
    bytes per group). The loader keeps them so only then; the other paths cast them first (`like`)."""
    return implementation(1) == "cpu-extension"


def like(x: mx.array, scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array]:
    """Scales and biases in x's dtype: MLX's kernels would otherwise dequantize in the half
    precision the scales are kept in (see `half_scales_read_exactly`)."""
    if scales.dtype == x.dtype or not mx.issubdtype(scales.dtype, mx.floating):
        return scales, biases
    return scales.astype(x.dtype), biases.astype(x.dtype)


def gather_quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                            indices: mx.array, group_size: int, bits: int, mode: str = "affine",
                            sorted_indices: bool = False) -> mx.array:
    """mx.gather_qmm with transposed stacked experts w [experts, out, ...]: x [..., 1, in]
    broadcast against indices [...] -> [..., 1, out]. Off Metal with the extension, routed rows run
    it, one row per token and expert (18-26x quicker than MLX's gather_qmm at 64-2048 routed rows)."""
    rows = indices.size
    fast = (mode == "affine" and biases is not None and bits in BITS and group_size in GROUP_SIZES
            and x.shape[-2] == 1 and implementation(rows) == "cpu-extension")
    if not fast:
        if mode == "affine" and biases is not None:
            scales, biases = like(x, scales, biases)
        return mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=group_size,
                             bits=bits, mode=mode, sorted_indices=sorted_indices)
    batch = mx.broadcast_shapes(x.shape[:-2], indices.shape)
    flat_x = mx.broadcast_to(x, (*batch, 1, x.shape[-1])).reshape(-1, x.shape[-1])
    flat_indices = mx.broadcast_to(indices, batch).reshape(-1)
    y = extension().affine_gather_quantized_matmul(flat_x, w, scales, biases, flat_indices, group_size, bits)
    return y.reshape(*batch, 1, w.shape[-2])


def hint() -> str | None:
    """How to get the fast path, when quantized matmuls run MLX's slow CPU kernel because the
    extension is missing (None otherwise, and on Metal or with MLXINFER_CPU_QMM=off)."""
    if mx.default_device().type != mx.DeviceType.cpu or mode() == "off" or extension() is not None:
        return None
    return (f"quantized models decode several times slower here: the CPU extension is {reason()}; install a C++ "
            "compiler (Debian/Ubuntu: sudo apt-get install g++) and reinstall mlxinfer to build it")


def describe() -> str:
    """One line for `mlxinfer doctor`: which path quantized matmuls take, and how to get the fast one."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "MLX's kernels (GPU); the CPU extension is not used"
    ext = extension()
    if ext is None:
        return (f"MLX's quantized_matmul (slow on CPU): the CPU extension is {reason()}; for the fast path "
                "reinstall mlxinfer (pip install -e .) where a C++ compiler and CMake are installed")
    if mode() == "off":
        return f"MLX's quantized_matmul: MLXINFER_CPU_QMM=off (the CPU extension, {ext.simd()}, is built)"
    return (f"CPU extension ({ext.simd()}, {ext.threads()} threads) at every row count (a cache-blocked GEMM "
            f"from 5 rows, no BLAS); mxfp4/mxfp8/nvfp4 layers: MLX's quantized_matmul")
