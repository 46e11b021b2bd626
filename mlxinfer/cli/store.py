"""What `--model` means on the command line: the demo model when none is given, a `.gguf`
file converted once into our cache, a folder, or a name `mlxinfer models` lists (resolved by
`loading.store`, which the server shares).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..base.cachedir import Notify, is_model_folder, models_dir, named_model, stderr_line
from ..base.errors import ModelNotFoundError
from ..convert.sources import is_gguf
from ..loading.model import load
from ..models.shard import launched
from .demo import convert_into, demo_model
from .terminal import spinner


def resolve_model(spec: str | None, notify: Notify = stderr_line) -> Path | str:
    """A model folder for `spec`: the demo model when None, a folder as is, a `.gguf` file
    converted once into the cache, a name from `mlxinfer models`; otherwise `spec` itself
    (a hub id, which `mlxinfer.load` resolves or rejects)."""
    if spec is None:
        return demo_model(notify)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if not is_gguf(path):
            raise ModelNotFoundError(
                f"'{spec}' is a file but not a GGUF file; pass a model folder, a hub id, a .gguf file "
                "or a name from `mlxinfer models`"
            )
        return gguf_in_cache(path, notify)
    if path.suffix == ".gguf":
        raise ModelNotFoundError(f"no GGUF file at '{spec}'; check the path")
    return named_model(spec) or spec


def gguf_key(path: Path) -> str:
    """Identifies a GGUF file by its size and first and last MiB (its header holds the
    metadata), so a copy elsewhere reuses the conversion without hashing gigabytes."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(path.stat().st_size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:8]


def gguf_in_cache(path: Path, notify: Notify) -> Path:
    """The MLX folder converted from `path`: made on first use, reused afterwards."""
    out = models_dir() / f"{path.stem}-{gguf_key(path)}"
    if not is_model_folder(out):
        notify(f"mlxinfer: converting {path.name} into {out} (once; later runs reuse it)")
        convert_into(path, out)
    return out


def open_model(spec: str | None, dtype: str | None = None, notify: Notify = stderr_line, pipeline: bool = False,
               adapter: str | None = None):
    """(model, tokenizer, folder or hub id) for a `--model` value, with a spinner while loading;
    `adapter`: a LoRA adapter folder applied unfused as the model's default."""
    where = resolve_model(spec, notify)
    with spinner(f"loading {spec or Path(where).name}"):
        # one rank of several (mlx.launch): this rank's part of the model
        split = "pipeline" if pipeline else "tensor"
        model, tokenizer = load(where, dtype=dtype, shard=split if launched() else None, adapter_path=adapter)
    return model, tokenizer, where
