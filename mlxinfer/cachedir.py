"""mlxinfer's own cache, `$MLXINFER_HOME` (default `~/.cache/mlxinfer`): where it is,
which folders in it hold models, and how a checkpoint is converted into it. Below both
the store (what `--model` means) and the demo model, which each write into it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import ConversionError

HOME_ENV = "MLXINFER_HOME"
Notify = Callable[[str], None]


def stderr_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "mlxinfer").expanduser()


def models_dir() -> Path:
    return home() / "models"


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def named_model(name: str) -> Path | None:
    """The folder in our cache that `mlxinfer models` lists as `name` (the demo model, a converted
    GGUF), or None. Here, below the loader and the CLI's `--model`, so both take the same names."""
    if "/" in name or name in ("", ".", ".."):
        return None
    folder = models_dir() / name
    return folder if is_model_folder(folder) else None


def convert_into(source: Path, out: Path, progress: bool | None = None) -> None:
    """Convert `source` into `out` (written atomically by the converter); a concurrent run
    that finished first is as good as ours."""
    from convert import convert

    try:
        convert(source, out, progress=progress)
    except ConversionError:
        if not is_model_folder(out):
            raise
