"""What a conversion reads, presented as one `Source` whose tensors carry Hugging Face names
and load one at a time; this module reads folders (local or hub id), `gguf_source` reads GGUF
files, and `api.open_source` chooses between them."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxinfer.base.errors import ConversionError
from mlxinfer.base.files import checkpoint_file
from mlxinfer.loading.checkpoint import (
    TOKENIZER_FILES,
    _quant_params,
    hf_quant_method,
    read_config,
    read_weights,
    weight_files,
)
from mlxinfer.models import build_model

from .gguf_file import MAGIC, Packed
from .quantize import DTYPES, MODES, QuantSpec, dtype_name

Tensor = mx.array | Packed
PACKED = ("weight", "scales", "biases")


@dataclass(frozen=True)
class SourceTensor:
    """One parameter of the source under its Hugging Face name; `read` loads it afresh each call,
    so nothing stays in memory after the caller drops the result."""

    name: str
    shape: tuple[int, ...]  # the float (unquantized) shape
    stored: str  # how the source holds it, for the report: "float16", "Q4_1", "4-bit g64"
    precision: QuantSpec | None  # the MLX quantization that best keeps the source's own; None for floats
    read: Callable[[], Tensor]


@dataclass
class Source:
    kind: str  # "Hugging Face folder", "MLX folder" or "GGUF file"
    location: Path
    config: dict[str, Any]  # config.json contents, without any quantization entries
    tensors: dict[str, SourceTensor]
    origin: dict[str, str]  # tensor name -> file it is stored in, for error messages
    dtype: mx.Dtype  # the float dtype the source is in; the output keeps it unless --dtype says otherwise
    nbytes: int  # size of the weights on disk
    write_extras: Callable[[Path], None]  # tokenizer, chat template and generation settings
    close: Callable[[], None] = lambda: None


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def open_folder(folder: Path) -> Source:
    """A Hugging Face checkpoint or an MLX one (quantized layers are read as `Packed`)."""
    config = read_config(folder)
    quant = config.get("quantization") or {}
    if config.get("quantization_config") and not quant:
        method = config["quantization_config"].get("quant_method", "an unknown method")
        raise ConversionError(
            f"'{folder}' is quantized with {method}, which cannot be converted; use the unquantized original"
        )
    files = weight_files(folder)
    raw, origin = read_weights(files)  # lazy: only shapes and dtypes are looked at here
    model = build_model(config)
    stored = model.sanitize(raw)
    params = dict(tree_flatten(model.parameters()))
    modules = dict(model.named_modules())
    tensors: dict[str, SourceTensor] = {}

    def reader(name: str) -> Callable[[], mx.array]:
        as_stored = name in origin and stored[name] is raw.get(name)  # not renamed, stacked or reshaped
        return partial(_lazy, folder / origin[name], name) if as_stored else partial(_built, files, model, name)

    for name, array in stored.items():
        path, _, leaf = name.rpartition(".")
        if f"{path}.scales" not in stored or leaf not in PACKED:  # floats, a quantized layer's bias among them
            tensors[name] = SourceTensor(name, tuple(array.shape), dtype_name(array.dtype), None, reader(name))
        elif leaf == "weight":
            spec = _packed_spec(path, modules[path], quant, stored)
            parts = {p: reader(f"{path}.{p}") for p in PACKED if p != "biases" or spec.affine}
            tensors[name] = SourceTensor(name, tuple(params[name].shape), str(spec), spec,
                                         partial(_read_packed, parts, spec))
    return Source(
        kind="MLX folder" if quant and not hf_quant_method(config) else "Hugging Face folder",
        location=folder,
        config={k: v for k, v in config.items() if k not in ("quantization", "quantization_config")},
        tensors=tensors,
        origin=origin,
        dtype=_folder_dtype(config, stored),
        nbytes=sum(f.stat().st_size for f in files),
        write_extras=partial(copy_tokenizer_files, folder),
    )


def _packed_spec(path: str, module: nn.Module, quant: dict[str, Any], stored: dict[str, mx.array]) -> QuantSpec:
    """A quantized layer's settings: config.json's per-layer entry, else read off the tensor shapes."""
    params = quant.get(path) or _quant_params(path, module, stored)
    if not isinstance(params, dict) or not all(type(params.get(k)) is int for k in ("bits", "group_size")):
        raise ConversionError(f"config.json's quantization entry for '{path}' needs integer bits and group_size, "
                              f"got {params!r:.80}; fix config.json")
    mode = params.get("mode", quant.get("mode", "affine"))
    if mode not in MODES:
        raise ConversionError(f"layer '{path}' uses {mode!r} quantization, which MLX does not have; fix config.json")
    return QuantSpec(params["bits"], params["group_size"], mode)


def _read_packed(parts: dict[str, Callable[[], mx.array]], spec: QuantSpec) -> Packed:
    return Packed(parts["weight"](), parts["scales"](), parts["biases"]() if "biases" in parts else None, spec)


def _built(files: list[Path], model: nn.Module, name: str) -> mx.array:
    """A tensor the model's `sanitize` builds from stored ones (stacked experts, a reshaped kernel),
    rebuilt from fresh lazy loads, so, like `_lazy`, nothing stays in memory."""
    return model.sanitize(read_weights(files)[0])[name]


def _lazy(file: Path, name: str) -> mx.array:
    """A fresh lazily loaded tensor: once evaluated and dropped, its memory is freed again."""
    return mx.load(str(file))[name]


def _folder_dtype(config: dict[str, Any], shapes: dict[str, mx.array]) -> mx.Dtype:
    """config.json's torch_dtype/dtype when it names a float type (mlx-lm casts to it too),
    else the float dtype holding most of the values."""
    named = config.get("torch_dtype") or config.get("dtype")
    if named in DTYPES:
        return getattr(mx, named)
    sizes = Counter()
    for array in shapes.values():
        if mx.issubdtype(array.dtype, mx.floating):
            sizes[array.dtype] += array.size
    return sizes.most_common(1)[0][0] if sizes else mx.float16


def copy_tokenizer_files(folder: Path, out: Path) -> None:
    """The tokenizer, chat template and generation settings, as mlx-lm's converter copies them;
    a link out of the folder is refused (`checkpoint_file`), never copied into the output."""
    for name in TOKENIZER_FILES:
        if name != "config.json" and (file := checkpoint_file(folder, name)) is not None:
            shutil.copyfile(file, out / name)
