"""mlxinfer's own cache, `$MLXINFER_HOME` (default `~/.cache/mlxinfer`): where it is, and
which folders in it hold models. Below the loader (which takes their names), the store (what
`--model` means) and the demo model, which write into it (`demo.convert_into`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

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

