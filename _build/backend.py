"""setuptools' build backend, asking for CMake and Ninja from the package index where the
machine has none, so `pip install` builds the CPU extension (setup.py) wherever a C++
compiler exists: a fresh Linux machine often has g++ but no cmake, and without this the
extension was skipped with a warning that `pip install -q` hides (decode ~6x slower).

Where cmake (or a build tool for it) is installed, nothing more is fetched. Building with
MLXINFER_BUILD_CPU_QMM=0 fetches nothing either: the extension is not built at all."""

from __future__ import annotations

import os
import shutil

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403  (the rest of the backend, unchanged)


def _build_tools() -> list[str]:
    if os.environ.get("MLXINFER_BUILD_CPU_QMM", "1") == "0":
        return []
    tools = [] if shutil.which("cmake") else ["cmake>=3.24"]
    if not (shutil.which("ninja") or shutil.which("make")):
        tools.append("ninja>=1.11")
    return tools


def get_requires_for_build_wheel(config_settings=None):
    return build_meta.get_requires_for_build_wheel(config_settings) + _build_tools()


def get_requires_for_build_editable(config_settings=None):
    return build_meta.get_requires_for_build_editable(config_settings) + _build_tools()
