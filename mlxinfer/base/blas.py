"""Which BLAS MLX's CPU backend calls, and making it a fast one without `LD_PRELOAD`.

MLX's Linux wheel (`mlx[cpu]`) bundles the reference BLAS, ~25x slower at float32
matmuls than OpenBLAS: a newcomer's first chat answer waits seconds for prefill.
`libmlx.so` takes `cblas_sgemm` from the dynamic linker, which looks in the global
scope before the library's own dependencies. So a BLAS opened with `RTLD_GLOBAL`
before `mlx.core` is imported wins, exactly as `LD_PRELOAD` would make it. This
module must therefore not import MLX: `mlxinfer/__init__.py` runs `preload()` first.

`MLXINFER_BLAS=off` keeps MLX's own BLAS; `MLXINFER_BLAS=/path/libblas.so` picks one.

OpenBLAS picks its kernels for the CPU once, as it loads, and one older than the CPU does not
recognise it and falls back silently to narrower ones (Debian's 0.3.21 on some newer Xeons: generic
kernels at 34 GFLOP/s float32 where its AVX-512 ones make 206). So before loading it, a child
process asks the library which kernels it picks here (remembered per library and CPU in
MLXINFER_HOME); where they are narrower than the CPU's vectors, `OPENBLAS_CORETYPE`, which the
library reads as it loads, names the widest while it loads. Where that cannot be done, `core_hint`
says so.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .cachedir import home

ENV = "MLXINFER_BLAS"
SYMBOL = "cblas_sgemm"
SLOW = "MLX is using its slow reference BLAS (float32 matmuls ~25x slower than OpenBLAS)"
INSTALL = ("install OpenBLAS (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread; Fedora: sudo dnf install "
           "openblas) and mlxinfer uses it automatically")


CORETYPE = "OPENBLAS_CORETYPE"
# The vector width (bits) of the float32 GEMM kernels behind each x86 core name `openblas_get_corename` returns.
KERNEL_BITS = {
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 512),
    **dict.fromkeys(("haswell", "zen", "sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"), 256),
    **dict.fromkeys(("katmai", "coppermine", "northwood", "prescott", "banias", "atom", "core2", "penryn", "dunnington",
                     "nehalem", "athlon", "opteron", "opteron_sse3", "barcelona", "nano", "bobcat"), 128),
}
# The widest core a CPU can run, by the /proc/cpuinfo flags its kernels need: (core, bits, what to call them).
WIDEST = [("SkylakeX", 512, "AVX-512", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
          ("Haswell", 256, "AVX2", {"avx2", "fma"})]
# Run by the child process that reports which kernels a library picks when it loads on this CPU.
PROBE = ("import ctypes, sys; name = ctypes.CDLL(sys.argv[1]).openblas_get_corename; "
         "name.restype = ctypes.c_char_p; print(name().decode())")


@dataclass
class Preload:
    """What `preload` did, for `doctor` and the one-time hint."""

    library: str | None = None
    note: str = ""
    asked_core: str | None = None  # the OPENBLAS_CORETYPE mlxinfer set while the library loaded
    own_core: str | None = None  # the kernels the library picks on its own here, when mlxinfer asked for others


STATE = Preload()


def candidates() -> list[str]:
    """Optimized BLAS libraries where Linux distributions install them, best first."""
    multiarch = f"/usr/lib/{platform.machine()}-linux-gnu"
    patterns = [f"{multiarch}/openblas-pthread/libblas.so.3", f"{multiarch}/openblas-openmp/libblas.so.3",
                f"{multiarch}/libopenblas.so.0", f"{multiarch}/blis-pthread/libblas.so.3",
                "/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0"]
    return [path for pattern in patterns for path in sorted(glob.glob(pattern))]


def _global_provider() -> str | None:
    """The file that provides `cblas_sgemm` in the process's global scope, if any."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), SYMBOL), ctypes.c_void_p).value
    except AttributeError:
        return None
    return _file_of(address)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _file_of(address: int | None) -> str | None:
    info = _DlInfo()
    if not address or not ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def preload() -> None:
    """Open an optimized BLAS globally before MLX loads, unless one already is, MLX is
    already imported (too late: its symbols are bound), or `MLXINFER_BLAS=off`."""
    if not sys.platform.startswith("linux"):
        return
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() == "off":
        STATE.note = f"{ENV}=off"
        return
    if _global_provider():
        STATE.note = "already loaded (LD_PRELOAD)"
        return
    if "mlx.core" in sys.modules:
        STATE.note = ("mlx was imported before mlxinfer, too late to choose its BLAS: import mlxinfer first, "
                      "or start Python with LD_PRELOAD set to an OpenBLAS libblas.so.3")
        warn_too_late(setting)
        return
    for path in [setting] if setting else candidates():
        try:
            with wide_kernels(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if setting:
                STATE.note = f"{ENV}={setting} could not be loaded ({e}); set it to an OpenBLAS library or unset it"
            continue
        if _global_provider():
            STATE.library = os.path.realpath(path)
            return
        STATE.note = f"{path} has no {SYMBOL}; set {ENV} to an OpenBLAS library"


@contextmanager
def wide_kernels(path: str) -> Iterator[None]:
    """While `path` loads, set OPENBLAS_CORETYPE to the widest kernels this CPU runs where the library
    would pick narrower ones by itself; then put the environment back, so that child processes decide
    for themselves. A user's own OPENBLAS_CORETYPE is left as it is."""
    STATE.asked_core = STATE.own_core = None
    widest = widest_core(cpu_flags())
    own = own_core(path) if widest is not None and CORETYPE not in os.environ else None
    narrower = own is not None and KERNEL_BITS.get(own.lower(), widest[1]) < widest[1]
    if narrower:
        STATE.asked_core, STATE.own_core = widest[0], own
        os.environ[CORETYPE] = widest[0]
    try:
        yield
    finally:
        if narrower:
            del os.environ[CORETYPE]


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86: avx2, avx512f, ...)."""
    return set(cpu_info().get("flags", "").split())


def widest_core(flags: set[str]) -> tuple[str, int, str] | None:
    """(OpenBLAS core name, vector bits, feature) of the widest float32 kernels a CPU with `flags` runs."""
    return next(((core, bits, feature) for core, bits, feature, needs in WIDEST if needs <= flags), None)


def own_core(path: str) -> str | None:
    """The core OpenBLAS at `path` picks by itself on this CPU (None: not an OpenBLAS), asked of a child
    process (once loaded, a library keeps its pick) once per library file and CPU model, then remembered."""
    stat, cpu = os.stat(path), cpu_info()
    model = " ".join(cpu.get(k, "") for k in ("vendor_id", "cpu family", "model", "stepping", "flags"))
    cpu_id = hashlib.sha256(model.encode()).hexdigest()[:16]
    key = f"{os.path.realpath(path)} {stat.st_size} {stat.st_mtime_ns} {cpu_id}"
    memo = home() / "blas-cores.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = _probe(path)
        partial = memo.with_suffix(f".{os.getpid()}")
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(known))
            partial.replace(memo)  # whole or not at all, whoever else writes it
        except OSError:
            pass
    return known[key] or None


def _probe(path: str) -> str:
    """`openblas_get_corename()` of `path` loaded in a fresh process ('' if it has none)."""
    try:
        run = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE, path], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def warn_too_late(setting: str) -> None:
    """Warn, once per process (`import mlxinfer` runs this once), that `mlx.core` was imported
    first and so keeps its reference BLAS although a faster one is installed: otherwise a script
    that imports in that order is silently ~25x slower at float32 matmuls. Quiet where nothing
    faster is here to choose, or where MLX does not run on the reference BLAS."""
    found = [setting] if setting else candidates()
    if not any(os.path.isfile(path) for path in found) or kind(in_use()) != "reference":
        return
    warnings.warn(f"mlx.core was imported before mlxinfer, so MLX keeps its slow reference BLAS although "
                  f"{found[0]} is installed (float32 matmuls ~25x slower): import mlxinfer before mlx, "
                  f"or set {ENV}=off to keep MLX's own BLAS", RuntimeWarning, stacklevel=4)


def in_use() -> str:
    """The library MLX's float32 matmuls run in, as the dynamic linker resolves it."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    provider = _global_provider() or _bundled()
    return provider or "unknown"


def _bundled() -> str | None:
    """The BLAS that `libmlx.so` brought itself (its own dependency)."""
    mlx = next((p for p in _mapped() if Path(p).name.startswith("libmlx")), None)
    if mlx is None:
        return None
    try:
        handle = ctypes.CDLL(mlx, mode=os.RTLD_NOLOAD | ctypes.RTLD_LOCAL)
        return _file_of(ctypes.cast(getattr(handle, SYMBOL), ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return None


def _mapped() -> list[str]:
    """Files mapped into this process (Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6})


def kind(library: str) -> str:
    """A BLAS library's family by its file path: OpenBLAS, BLIS, MKL, Accelerate, or the reference."""
    lowered = library.lower()
    for name in ("OpenBLAS", "BLIS", "MKL", "Accelerate"):
        if name.lower() in lowered:
            return name
    return "reference" if Path(lowered).name.startswith("libblas") else "unknown"


def running_core() -> str | None:
    """The kernels the OpenBLAS in use runs (`openblas_get_corename`), or None for another BLAS."""
    try:
        name = ctypes.CDLL(in_use(), mode=os.RTLD_NOLOAD).openblas_get_corename
    except (OSError, AttributeError):
        return None
    name.restype = ctypes.c_char_p
    return name().decode(errors="replace")


def describe() -> str:
    """`kind: file` of the BLAS in use, and OpenBLAS's kernels, for `doctor`."""
    library, core = in_use(), running_core()
    if core is None:
        return f"{kind(library)} ({library})"
    if STATE.asked_core is not None and core.lower() == STATE.asked_core.lower():
        why = f"chosen by mlxinfer: the library picks {STATE.own_core} on this CPU"
    else:
        why = f"{CORETYPE}={os.environ[CORETYPE]}" if CORETYPE in os.environ else "the library's own choice"
    return f"{kind(library)} ({library}), {core} kernels ({why})"


def hint() -> str | None:
    """How to get a fast BLAS, when MLX runs on the reference one (None otherwise)."""
    if not sys.platform.startswith("linux") or kind(in_use()) != "reference":
        return None
    return f"{SLOW}: {STATE.note or INSTALL}"


def core_hint() -> str | None:
    """One line, with the measured rate, when OpenBLAS runs kernels narrower than the CPU's vectors and
    mlxinfer could not choose wider ones (None otherwise, or where a user's OPENBLAS_CORETYPE chose them)."""
    core, widest = running_core(), widest_core(cpu_flags())
    bits = KERNEL_BITS.get((core or "").lower())
    if bits is None or widest is None or bits >= widest[1] or (CORETYPE in os.environ and STATE.asked_core is None):
        return None
    wanted, _, feature = widest
    if STATE.asked_core is not None:
        fix = (f"it did not take {CORETYPE}={STATE.asked_core}; use an OpenBLAS built with DYNAMIC_ARCH "
               f"(Debian/Ubuntu: libopenblas0-pthread)")
    else:
        fix = f"start with {CORETYPE}={wanted} set for its {feature} kernels"
    return (f"OpenBLAS runs its {bits}-bit {core} kernels on this {feature} CPU "
            f"(float32 matmul {sgemm_gflops():.0f} GFLOP/s): {fix}")


def sgemm_gflops(n: int = 256, repeat: int = 3) -> float:
    """The best of `repeat` n x n x n float32 products through the `cblas_sgemm` MLX is bound to."""
    sgemm = getattr(ctypes.CDLL(in_use(), mode=os.RTLD_NOLOAD), SYMBOL)
    a, c = (ctypes.c_float * (n * n))(), (ctypes.c_float * (n * n))()
    row_major, no_trans = 101, 111  # CBLAS enum values
    best = float("inf")
    for _ in range(repeat + 1):  # the first call warms up (threads start, pages fault in)
        start = time.perf_counter()
        sgemm(row_major, no_trans, no_trans, n, n, n, ctypes.c_float(1.0), a, n, a, n, ctypes.c_float(0.0), c, n)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9
