"""Find a checkpoint (local folder or hub id), read its config and safetensors,
and build the MLX model, quantized the way mlx-lm writes quantized models."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import ConfigError, CorruptCheckpointError, InvalidOptionError, ModelNotFoundError
from .models import CausalLM, build_model
from .tokenizer import Tokenizer, load_tokenizer_from_dir

TOKENIZER_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
]
MODEL_FILES = ["*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(path_or_repo: str | os.PathLike, revision: str | None = None, patterns=MODEL_FILES) -> Path:
    """A local folder as is, or a hub id downloaded (or found in the HF cache)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_repo)
    if path.exists():
        raise ModelNotFoundError(f"'{name}' is a file, not a model folder; pass the folder that holds config.json")
    if not _REPO_ID.match(name):
        raise ModelNotFoundError(f"no model folder at '{name}'; pass an existing folder or a hub id like 'org/model'")
    return _download(name, revision, patterns)


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"hub repo '{repo_id}' has no revision '{revision}'") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"hub repo '{repo_id}' does not exist (or is private); check the id or pass a local folder"
        ) from None
    except Exception as e:  # network, offline mode, cache misses: all mean "not available here"
        why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") else "the hub could not be reached"
        raise ModelNotFoundError(
            f"'{repo_id}' is not in the local Hugging Face cache and {why} ({type(e).__name__}); "
            "pass a local folder path instead"
        ) from None


def read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"no config.json in '{path}'; is this a model folder?")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON ({e})") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, as its index lists them when it has one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CorruptCheckpointError(
                f"shard '{missing[0]}' listed in {index.name} is missing from '{path}'; re-download the checkpoint"
            )
        return [path / n for n in names]
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CorruptCheckpointError(
            f"'{path}' holds only pickle weights ({pickles[0]}), which are unsafe to load; "
            "convert them to safetensors first (e.g. with the safetensors library)"
        )
    raise CorruptCheckpointError(f"no .safetensors weights in '{path}'")


def check_safetensors(file: Path) -> None:
    """Fail with the tensor's name if the file ends before its header says it should."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{file.name} is truncated ({size} bytes); re-download or re-convert it")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise CorruptCheckpointError(
                f"{file.name} is truncated inside its header ({size} bytes, header needs {8 + n}); re-download it"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CorruptCheckpointError(f"{file.name} has a corrupt safetensors header; re-download it") from None
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = 8 + n + info["data_offsets"][1]
        if end > size:
            raise CorruptCheckpointError(
                f"{file.name} is truncated: tensor '{name}' needs {end} bytes but the file has {size}; "
                "re-download or re-convert it"
            )


def read_weights(files: list[Path]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """All tensors (lazily memory-mapped by mx.load) and the file each came from."""
    weights: dict[str, mx.array] = {}
    origin: dict[str, str] = {}
    for file in files:
        check_safetensors(file)
        try:
            shard = mx.load(str(file))
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read {file.name}: {e}") from None
        weights.update(shard)
        origin.update(dict.fromkeys(shard, file.name))
    return weights, origin


def _quant_params(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict[str, int]:
    """Bits and group size of a layer, read off its packed weight and scales."""
    in_dims = module.weight.shape[-1]
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    return {"bits": packed.shape[-1] * 32 // in_dims, "group_size": in_dims // scales.shape[-1]}


def quantize_like_checkpoint(model: nn.Module, quant: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers exactly where the checkpoint has quantized tensors,
    honouring mlx-lm's per-layer overrides in config.json."""

    def predicate(path: str, module: nn.Module):
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return _quant_params(path, module, weights)

    nn.quantize(
        model,
        group_size=quant.get("group_size", 64),
        bits=quant.get("bits", 4),
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def check_weights(model: nn.Module, weights: dict[str, mx.array], origin: dict[str, str], folder: Path) -> None:
    """Every parameter present with the shape the config implies; nothing extra."""
    expected = dict(tree_flatten(model.parameters()))
    missing = [k for k in expected if k not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CorruptCheckpointError(
            f"checkpoint in '{folder}' is missing tensor '{missing[0]}'{more}; the weights do not match config.json"
        )
    extra = [k for k in weights if k not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CorruptCheckpointError(
            f"{_source(origin, extra[0])} has tensor '{extra[0]}'{more} that the model in config.json does not use"
        )
    for name, param in expected.items():
        found = weights[name].shape
        if tuple(found) != tuple(param.shape):
            raise CorruptCheckpointError(
                f"tensor '{name}' in {_source(origin, name)} has shape {tuple(found)} but config.json implies "
                f"{tuple(param.shape)}"
            )


def _source(origin: dict[str, str], name: str) -> str:
    """The file a tensor came from; tensors `sanitize` builds (stacked experts) come from several."""
    return origin.get(name, "the checkpoint")


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    choices = ("float16", "bfloat16", "float32")
    if dtype not in choices:
        raise InvalidOptionError(f"dtype '{dtype}' is not supported; choose one of {', '.join(choices)}")
    return getattr(mx, dtype)


HALF = (mx.float16, mx.bfloat16)


def compute_dtype(weights: dict[str, mx.array], requested: mx.Dtype | None) -> mx.Dtype | None:
    """The dtype floating tensors are cast to: as requested, else as stored, except
    that off Metal half precision becomes float32: MLX's CPU backend has no fast
    half-precision kernels (a quantized SmolLM2 decodes ~35x faster in float32)."""
    if requested is not None or mx.metal.is_available():
        return requested
    stored = {v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)}
    return mx.float32 if stored & set(HALF) else None


def load_model(path: Path, dtype: str | mx.Dtype | None = None) -> CausalLM:
    """Build and fill the model in a local checkpoint folder."""
    requested = parse_dtype(dtype)
    config = read_config(path)
    model = build_model(config)
    weights, origin = read_weights(weight_files(path))
    weights = model.sanitize(weights)
    if config.get("quantization"):
        quantize_like_checkpoint(model, config["quantization"], weights)
    check_weights(model, weights, origin, path)
    target = compute_dtype(weights, requested)
    if target is not None:
        weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def load(
    path_or_repo: str | os.PathLike, dtype: str | mx.Dtype | None = None, revision: str | None = None
) -> tuple[CausalLM, Tokenizer]:
    """Load a model and its tokenizer from a local folder or a Hugging Face hub id."""
    path = resolve(path_or_repo, revision)
    return load_model(path, dtype), load_tokenizer_from_dir(path)


def load_tokenizer(path_or_repo: str | os.PathLike, revision: str | None = None) -> Tokenizer:
    """Only the tokenizer (downloads no weights for a hub id)."""
    return load_tokenizer_from_dir(resolve(path_or_repo, revision, TOKENIZER_FILES))
