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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS choice is Linux-only")

OPENBLAS = sorted(glob.glob(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-*/libblas.so.3"))
needs_openblas = pytest.mark.skipif(not OPENBLAS, reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")
ROOT = Path(__file__).resolve().parents[1]


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


# OpenBLAS's kernels. The stand-in below picks its kernels ("core") once, as it loads, as OpenBLAS
# does: OPENBLAS_CORETYPE when it takes it, else its own pick. The code under test runs in a fresh
# process (a BLAS loaded globally into this one could take MLX's matmuls), without MLX, given the
# CPU flags each case names, so that no case depends on the CPU running it.
FAKE_OPENBLAS = r"""
#include <stdlib.h>
#include <string.h>
static char core[64] = OWN_CORE;
__attribute__((constructor)) static void pick(void) {
  const char *asked = getenv("OPENBLAS_CORETYPE");
  if (TAKES_CORETYPE && asked && *asked) strncpy(core, asked, sizeof core - 1);
}
char *openblas_get_corename(void) { return core; }
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float sum = 0;
      for (int l = 0; l < k; l++) sum += a[i * lda + l] * b[l * ldb + j];
      c[i * ldc + j] = alpha * sum + beta * c[i * ldc + j];
    }
}
"""
# blas.py alone: a stand-in `mlxinfer` package keeps mlxinfer/__init__.py (and MLX) out.
ALONE = """
import json, os, sys, types
package = types.ModuleType("mlxinfer")
package.__path__ = [sys.argv[1]]
sys.modules["mlxinfer"] = package
import mlxinfer.base.blas as blas
blas.cpu_flags = lambda: set(sys.argv[2].split())
blas.preload()
print(json.dumps({"asked": blas.STATE.asked_core, "own": blas.STATE.own_core, "running": blas.running_core(),
                  "describe": blas.describe(), "hint": blas.core_hint(), "env": os.environ.get("OPENBLAS_CORETYPE")}))
"""
AVX512 = "sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl"
AVX2 = "sse2 avx avx2 fma"
C_COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def fake_openblas(tmp_path):
    """Build the stand-in: fake_openblas(own core, takes OPENBLAS_CORETYPE) -> its path."""
    if C_COMPILER is None:
        pytest.skip("no C compiler")
    source = tmp_path / "fake_openblas.c"
    source.write_text(FAKE_OPENBLAS)

    def build(own: str, takes_coretype: bool = True, name: str = "libopenblas.so.0") -> Path:
        library = tmp_path / own / name
        library.parent.mkdir(exist_ok=True)
        subprocess.run([C_COMPILER, "-shared", "-fPIC", "-O2", f'-DOWN_CORE="{own}"',
                        f"-DTAKES_CORETYPE={int(takes_coretype)}", str(source), "-o", str(library)], check=True)
        return library

    return build


def preload_alone(library: Path, flags: str, home: Path, **env: str) -> dict:
    """What preload does with `library` (as MLXINFER_BLAS) on a CPU with `flags`, seen from inside."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_DEBUG", "OPENBLAS_CORETYPE")}
    env = {**clean, "MLXINFER_BLAS": str(library), "MLXINFER_HOME": str(home), **env}
    out = subprocess.run([sys.executable, "-c", ALONE, str(ROOT / "mlxinfer"), flags], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("flags, wide", [(AVX512, "SkylakeX"), (AVX2, "Haswell")])
def test_openblas_on_narrow_kernels_is_given_the_widest_the_cpu_runs(fake_openblas, tmp_path, flags, wide):
    """The library picks SSE kernels (Prescott) by itself: it is loaded with OPENBLAS_CORETYPE asking
    for the CPU's widest, runs them, doctor says why, and the environment is as it was."""
    state = preload_alone(fake_openblas("Prescott"), flags, tmp_path / "home")
    assert (state["asked"], state["own"], state["running"]) == (wide, "Prescott", wide)
    assert f"{wide} kernels (chosen by mlxinfer: the library picks Prescott" in state["describe"]
    assert state["hint"] is None and state["env"] is None


def test_the_librarys_own_pick_is_asked_once_per_library_and_cpu_and_remembered(fake_openblas, tmp_path):
    library, home = fake_openblas("Prescott"), tmp_path / "home"
    preload_alone(library, AVX512, home)
    memo = home / "blas-cores.json"
    (key, own), = json.loads(memo.read_text()).items()
    assert own == "Prescott" and str(library) in key
    memo.write_text(json.dumps({key: "Nehalem"}))  # remembered, not asked again: the memo's answer is used
    assert preload_alone(library, AVX512, home)["own"] == "Nehalem"


@pytest.mark.parametrize("own, flags", [("SkylakeX", AVX512), ("Cooperlake", AVX512), ("Haswell", AVX2),
                                        ("Prescott", "sse2 sse3"), ("POWER10", AVX512)])
def test_kernels_as_wide_as_the_cpu_or_unknown_are_left_alone(fake_openblas, tmp_path, own, flags):
    state = preload_alone(fake_openblas(own), flags, tmp_path / "home")
    assert (state["asked"], state["running"], state["hint"], state["env"]) == (None, own, None, None)
    assert state["describe"].endswith(f"{own} kernels (the library's own choice)")


def test_a_users_coretype_is_kept_and_named(fake_openblas, tmp_path):
    state = preload_alone(fake_openblas("SkylakeX"), AVX512, tmp_path / "home", OPENBLAS_CORETYPE="Prescott")
    assert (state["asked"], state["running"], state["hint"], state["env"]) == (None, "Prescott", None, "Prescott")
    assert state["describe"].endswith("Prescott kernels (OPENBLAS_CORETYPE=Prescott)")
    assert not (tmp_path / "home" / "blas-cores.json").exists()  # nothing to ask the library


def test_a_library_that_ignores_the_coretype_is_reported_in_one_line_with_its_rate(fake_openblas, tmp_path):
    state = preload_alone(fake_openblas("Prescott", takes_coretype=False), AVX512, tmp_path / "home")
    assert (state["asked"], state["running"]) == ("SkylakeX", "Prescott")
    hint = state["hint"]
    assert hint.startswith("OpenBLAS runs its 128-bit Prescott kernels on this AVX-512 CPU (float32 matmul ")
    assert "GFLOP/s): it did not take OPENBLAS_CORETYPE=SkylakeX" in hint and "\n" not in hint


def test_narrow_kernels_loaded_before_mlxinfer_are_reported_with_the_fix(fake_openblas, tmp_path):
    """LD_PRELOAD loaded the library before mlxinfer could choose: the line says what to set."""
    library = fake_openblas("Nehalem")
    state = preload_alone(library, AVX2, tmp_path / "home", LD_PRELOAD=str(library))
    assert (state["asked"], state["running"]) == (None, "Nehalem")
    assert "128-bit Nehalem kernels on this AVX2 CPU" in state["hint"]
    assert state["hint"].endswith("start with OPENBLAS_CORETYPE=Haswell set for its AVX2 kernels")


def test_a_blas_without_corename_is_not_asked_about_kernels(tmp_path):
    """BLIS, or a reference BLAS: no core to report, nothing set."""
    if C_COMPILER is None:
        pytest.skip("no C compiler")
    (tmp_path / "blas.c").write_text("void cblas_sgemm(void) {}\n")
    library = tmp_path / "libblas.so.3"
    subprocess.run([C_COMPILER, "-shared", "-fPIC", str(tmp_path / "blas.c"), "-o", str(library)], check=True)
    state = preload_alone(library, AVX512, tmp_path / "home")
    assert (state["asked"], state["running"], state["hint"], state["env"]) == (None, None, None, None)
    assert list(json.loads((tmp_path / "home" / "blas-cores.json").read_text()).values()) == [""]  # asked once


@needs_openblas
@pytest.mark.skipif(not OPENBLAS or "avx2" not in Path("/proc/cpuinfo").read_text(), reason="Haswell kernels need AVX2")
def test_the_real_openblas_takes_the_coretype_set_before_it_loads(tmp_path):
    """The mechanism on the installed OpenBLAS: told that the library would pick SSE kernels by itself,
    preload asks for Haswell's through the environment, and the library runs them."""
    code = ALONE.replace("blas.preload()", "blas.own_core = lambda path: 'Prescott'\nblas.preload()")
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "mlxinfer"), AVX2],
                         env={**clean, "MLXINFER_BLAS": OPENBLAS[0]}, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    state = json.loads(out)
    assert (state["asked"], state["running"], state["env"]) == ("Haswell", "Haswell", None)


def test_doctor_and_the_first_command_say_the_kernels_line(monkeypatch, tmp_path, capsys):
    import mlxinfer.cli.doctor as doctor
    import mlxinfer.cli.main as cli

    line = "OpenBLAS runs its 128-bit Prescott kernels on this AVX-512 CPU (float32 matmul 34 GFLOP/s): ..."
    monkeypatch.setattr("mlxinfer.base.blas.hint", lambda: None)
    monkeypatch.setattr("mlxinfer.base.blas.core_hint", lambda: line)
    monkeypatch.setattr("mlxinfer.kernels.quantized_matmul.hint", lambda: None)
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path))
    assert dict(doctor.environment())["BLAS advice"] == line
    cli.hints_once()
    cli.hints_once()
    assert capsys.readouterr().err == f"mlxinfer: {line}\n"
