"""Builds the optional CPU quantized-matmul extension (mlxinfer.kernels._cpu_qmm) with CMake.

Optional on purpose: without a C++ compiler (or with MLXINFER_BUILD_CPU_QMM=0) the build
is skipped with a warning and the package installs anyway; mlxinfer then uses MLX's own
quantized matmul, its first run says why (the reason is kept beside the package as
REASON_FILE), and `mlxinfer doctor` says how to get the fast path. CMake and Ninja come
from the package index where the machine has none (_build/backend.py).
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = Path(__file__).resolve().parent / "mlxinfer" / "kernels" / "_cpu"
REASON_FILE = "_cpu_qmm.not-built"  # beside the extension: why it was not built, for the first run's hint


class OptionalCMakeBuild(build_ext):
    """Runs CMake for the extension; any failure becomes a warning, not a failed install."""

    def run(self) -> None:
        if os.environ.get("MLXINFER_BUILD_CPU_QMM", "1") == "0":
            self._skip("MLXINFER_BUILD_CPU_QMM=0")
            return
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any build failure leaves the pure-MLX path
            self._skip(str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            return
        self._reason_file().unlink(missing_ok=True)

    def build_extension(self, ext: Extension) -> None:
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found")
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        with tempfile.TemporaryDirectory(prefix="mlxinfer-cpu-qmm-") as build:
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            self._call([cmake, "-S", str(SOURCES), "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                        f"-DPython_EXECUTABLE={sys.executable}"])
            self._call([cmake, "--build", build, "--parallel", str(os.cpu_count() or 1)])
            built = Path(build) / f"_cpu_qmm{sysconfig.get_config_var('EXT_SUFFIX')}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built, target)

    @staticmethod
    def _call(cmd: list[str]) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cmd[0]).name} failed: {lines[-1] if lines else result.returncode}")

    def _reason_file(self) -> Path:
        return Path(self.get_ext_fullpath("mlxinfer.kernels._cpu_qmm")).with_name(REASON_FILE)

    def _skip(self, reason: str) -> None:
        print(f"mlxinfer: the CPU quantized-matmul extension was not built ({reason}); "
              "MLX's quantized matmul will be used. `mlxinfer doctor` explains how to build it.",
              file=sys.stderr)
        path = self._reason_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(reason + "\n", encoding="utf-8")


setup(ext_modules=[Extension("mlxinfer.kernels._cpu_qmm", sources=[])], cmdclass={"build_ext": OptionalCMakeBuild})
