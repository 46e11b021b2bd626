"""Which BLAS MLX's CPU backend calls, and making it a fast one without `LD_PRELOAD`.

MLX's Linux wheel (`mlx[cpu]`) bundles the reference BLAS, ~25x slower at float32
matmuls than OpenBLAS: a newcomer's first chat answer waits seconds for prefill.
`libmlx.so` takes `cblas_sgemm` from the dynamic linker, which looks in the global
scope before the library's own dependencies. So a BLAS opened with `RTLD_GLOBAL`
before `mlx.core` is imported wins, exactly as `LD_PRELOAD` would make it. This
module must therefore not import MLX: `mlxinfer/__init__.py` runs `preload()` first.

`MLXINFER_BLAS=off` keeps MLX's own BLAS; `MLXINFER_BLAS=/path/libblas.so` picks one.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ENV = "MLXINFER_BLAS"
SYMBOL = "cblas_sgemm"
SLOW = "MLX is using its slow reference BLAS (float32 matmuls ~25x slower than OpenBLAS)"
INSTALL = ("install OpenBLAS (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread; Fedora: sudo dnf install "
           "openblas) and mlxinfer uses it automatically")


@dataclass
class Preload:
    """What `preload` did, for `doctor` and the one-time hint."""

    library: str | None = None
    note: str = ""


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
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if setting:
                STATE.note = f"{ENV}={setting} could not be loaded ({e}); set it to an OpenBLAS library or unset it"
            continue
        if _global_provider():
            STATE.library = os.path.realpath(path)
            return
        STATE.note = f"{path} has no {SYMBOL}; set {ENV} to an OpenBLAS library"


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


def describe() -> str:
    """`kind: file` of the BLAS in use, for `doctor`."""
    library = in_use()
    return f"{kind(library)} ({library})"


def hint() -> str | None:
    """How to get a fast BLAS, when MLX runs on the reference one (None otherwise)."""
    if not sys.platform.startswith("linux") or kind(in_use()) != "reference":
        return None
    return f"{SLOW}: {STATE.note or INSTALL}"
