"""What `--model` means on the command line: the demo model when none is given, a `.gguf`
file converted once into our cache, a folder, or a name `mlxinfer models` lists (resolved by
`loading.store`, which the server shares).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..base.cachedir import Notify, is_model_folder, models_dir, named_model, stderr_line
from ..base.errors import ModelNotFoundError
from ..convert.pull import gguf_cache_name, gguf_key, record_gguf, recorded_gguf
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


def gguf_in_cache(path: Path, notify: Notify) -> Path:
    """The MLX folder converted from `path` as stored: made on first use, reused afterwards. It is
    named as `mlxinfer pull` names it (`tiny-q4_1`), which also reuses a pulled one; the file's
    key is added when another file has that name, and a folder made under the older name
    (`tiny.Q4_1-<key>`) is reused as it is."""
    key = gguf_key(path)
    readable = models_dir() / gguf_cache_name(path.name)
    keyed, older = readable.with_name(f"{readable.name}-{key}"), models_dir() / f"{path.stem}-{key}"
    for out in (readable, keyed):
        if is_model_folder(out) and recorded_gguf(out) == key:
            return out
    if is_model_folder(older):
        return older
    out = keyed if os.path.lexists(readable) else readable
    notify(f"mlxinfer: converting {path.name} into {out} (once; later runs reuse it)")
    convert_into(path, out)
    record_gguf(out, path)
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
