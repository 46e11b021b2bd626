"""Fast by default on Linux: `import mlxinfer` makes MLX use an installed OpenBLAS without LD_PRELOAD.

The oracle is the dynamic linker itself: with LD_DEBUG=bindings it prints which file each of
libmlx's symbols was bound to, so the tests see the `cblas_sgemm` MLX really calls.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS choice is Linux-only")

OPENBLAS = sorted(glob.glob(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-*/libblas.so.3"))
needs_openblas = pytest.mark.skipif(not OPENBLAS, reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLXINFER_BLAS", "LD_DEBUG")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


def sgemm_binding(code: str, **env: str) -> str:
    """The file libmlx's cblas_sgemm was bound to, as ld.so reports it."""
    stderr = run(code, LD_DEBUG="bindings", **env).stderr
    found = re.findall(r"binding file \S*libmlx\.so \[0\] to (\S+) \[0\]: normal symbol `cblas_sgemm'", stderr)
    assert found, "ld.so reported no binding of libmlx's cblas_sgemm"
    return os.path.realpath(found[-1])


@needs_openblas
@pytest.mark.parametrize("first", ["import mlxinfer", "from mlxinfer.convert import convert", "import mlxinfer.cli.main"])
def test_openblas_used_without_ld_preload(first):
    bound = sgemm_binding(f"{first}\nimport mlx.core")
    assert "openblas" in bound, bound


@needs_openblas
def test_doctor_names_the_blas_the_linker_bound_and_its_speed():
    code = "import json, mlxinfer.cli.doctor as d; print(json.dumps(dict(d.environment())))"
    bound = sgemm_binding(code)
    env = json.loads(run(code).stdout)
    assert env["BLAS"].startswith("OpenBLAS") and bound in env["BLAS"]
    assert float(env["float32 matmul"].split()[0]) > 0
    assert "BLAS advice" not in env


def test_opting_out_keeps_the_wheels_blas_and_says_how_to_get_a_fast_one():
    code = "import json, mlxinfer.cli.doctor as d; print(json.dumps(dict(d.environment())))"
    bound = sgemm_binding(code, MLXINFER_BLAS="off")
    env = json.loads(run(code, MLXINFER_BLAS="off").stdout)
    assert "openblas" not in bound and bound in env["BLAS"] and env["BLAS"].startswith("reference")
    assert "reference BLAS" in env["BLAS advice"] and "\n" not in env["BLAS advice"]


def test_mlx_imported_first_is_too_late_and_the_advice_says_so():
    code = "import mlx.core, mlxinfer.base.blas as b; print(b.hint())"
    bound = sgemm_binding(code)
    assert "openblas" not in bound
    assert "import mlxinfer first" in run(code).stdout


@needs_openblas
def test_mlx_imported_first_warns_once_saying_what_to_do():
    """mlx.core, then mlxinfer (then `convert` and the CLI, which import it again): one warning, at
    the script's own import line, saying to import mlxinfer first. None where nothing is lost:
    mlxinfer first, MLXINFER_BLAS=off, or MLX already bound to OpenBLAS by LD_PRELOAD."""
    late = run("import mlx.core\nimport mlxinfer\nimport mlxinfer.convert\nimport mlxinfer.cli.main").stderr
    assert late.count("Warning") == 1 and "<string>:2: RuntimeWarning" in late, late
    assert "import mlxinfer before mlx" in late and "MLXINFER_BLAS=off" in late
    assert "Warning" not in run("import mlxinfer\nimport mlx.core").stderr
    assert "Warning" not in run("import mlx.core\nimport mlxinfer", MLXINFER_BLAS="off").stderr
    assert "Warning" not in run("import mlx.core\nimport mlxinfer", LD_PRELOAD=OPENBLAS[0]).stderr


def test_a_blas_that_cannot_be_loaded_is_named_in_the_advice(tmp_path):
    out = run("import mlxinfer.base.blas as b; print(b.hint())", MLXINFER_BLAS=str(tmp_path / "missing.so")).stdout
    assert "could not be loaded" in out and "missing.so" in out


def test_cli_says_it_once_per_machine(tmp_path):
    code = "from mlxinfer.cli.main import main; main(['models', '--supported'])"
    env = dict(MLXINFER_BLAS="off", MLXINFER_HOME=str(tmp_path))
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    first, second = (subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True,
                                    text=True, timeout=120) for _ in range(2))
    assert first.returncode == second.returncode == 0
    assert first.stderr.count("reference BLAS") == 1 and "reference BLAS" not in first.stdout
    assert "reference BLAS" not in second.stderr
