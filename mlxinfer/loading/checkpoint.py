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

from ..base.cachedir import named_model
from ..base.errors import ConfigError, CorruptCheckpointError, InvalidOptionError, ModelNotFoundError
from ..base.files import checkpoint_file, read_checkpoint_file
from ..text.images import read_image_processor
from ..kernels import quantized_matmul
from ..models import CausalLM, build_model
from ..models.config import check_config
from ..models.layers import QuantizedEmbedding, QuantizedLinear, fuse_projections
from ..models.pooling import MODES as POOLING_MODES
from ..models.pooling import EmbeddingConfig
from ..base.safetensors import check_safetensors
from ..models.shard import (
    Shard,
    Stage,
    check_same_model,
    layer_ranges,
    layer_sizes,
    materialize,
    shard_config,
    shard_weights,
    shrink_vocab,
    stage_weights,
    world,
    wrap_reductions,
)

TOKENIZER_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
]
# a sentence-transformers pipeline, its input modalities and its pooling (`<index>_Pooling/config.json`)
EMBEDDING_FILES = ["modules.json", "sentence_bert_config.json", "*_Pooling/config.json"]
# a vision-language checkpoint's image preprocessing (`images.read_image_processor`)
IMAGE_FILES = ["preprocessor_config.json", "processor_config.json"]
MODEL_FILES = ["*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES, *EMBEDDING_FILES, *IMAGE_FILES]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(path_or_repo: str | os.PathLike, revision: str | None = None, patterns=MODEL_FILES) -> Path:
    """A local folder as is, a name from `mlxinfer models` (a folder in our cache, as the CLI's
    `--model` takes it), or a hub id downloaded (or found in the HF cache)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_repo)
    if path.suffix == ".gguf" and path.is_file():
        raise ModelNotFoundError(f"'{name}' is a GGUF file, not a model folder; convert it once "
                                 f"(`mlxinfer convert {name} -o FOLDER`) and load the folder")
    if path.exists():
        raise ModelNotFoundError(f"'{name}' is a file, not a model folder; pass the folder that holds config.json")
    named = named_model(name)
    if named is not None:
        return named
    if not _REPO_ID.match(name):
        raise ModelNotFoundError(f"no model folder at '{name}' and no model of that name in `mlxinfer models`; "
                                 "pass an existing folder, a name it lists or a hub id like 'org/model' (docs/python-api.md)")
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
    """config.json as a dict whose known keys are checked (`check_config`), errors naming the
    file; a Hugging Face quantization MLX runs as stored gets mlx-lm's `quantization` entry."""
    file = path / "config.json"
    raw = read_checkpoint_file(path, file.name)
    if raw is None:
        raise ModelNotFoundError(f"no config.json in '{path}'; is this a model folder?")
    return with_mlx_quantization(check_config(_json(file, raw), str(file)))


# Hugging Face quantization methods whose tensors MLX runs as stored, once the family's
# `sanitize` has named them as MLX does: gpt-oss's MXFP4 experts (E2M1 codes, two to a byte,
# and an E8M0 exponent per 32) are MLX's mxfp4 mode bit for bit.
AS_STORED = {"mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}


def hf_quant_method(config: dict[str, Any]) -> str | None:
    """The `quant_method` of a Hugging Face `quantization_config` (mlx-lm's copy has none)."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method if isinstance(method, str) else None


def with_mlx_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """`config`, with mlx-lm's `quantization` entry where its Hugging Face quantization is one
    MLX runs as stored (so the quantized layers are built as such, never dequantized)."""
    method = hf_quant_method(config)
    if config.get("quantization") or method not in AS_STORED:
        return config
    return {**config, "quantization": AS_STORED[method]}


def checkpoint_json(path: Path, name: str) -> Any:
    """The JSON file `name` of the checkpoint in `path` (None if it has none)."""
    raw = read_checkpoint_file(path, name)
    return None if raw is None else _json(path / name, raw)


def _json(file: Path, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too-long integers
        raise ConfigError(f"{file} is not valid JSON ({e})") from None


def read_embedding_config(path: Path) -> EmbeddingConfig:
    """How the checkpoint makes sentence embeddings, from its sentence-transformers files:
    `modules.json` lists the pipeline (Transformer, Pooling, Normalize, ...), the Transformer
    module's `sentence_bert_config.json` its input modalities, and the Pooling module's
    `config.json` its modes. Without them: mean pooling. A module this does not run (Dense,
    a LayerNorm, ...) makes a `refusal`, raised only when the model is asked to embed (it may
    still generate)."""
    modules = checkpoint_json(path, "modules.json")
    if modules is None:
        return EmbeddingConfig()
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{path / 'modules.json'} is not a list of modules; the checkpoint is damaged")
    modes: tuple[str, ...] = ("mean",)
    normalize = as_message = False
    for module in modules:
        kind, folder = str(module.get("type", "")).rsplit(".", 1)[-1], str(module.get("path", ""))
        if kind == "Transformer":
            as_message = _message_modality(path, folder)
        elif kind == "Pooling":
            modes = _pooling_modes(path, folder)
        elif kind == "Normalize":
            normalize = True
        else:
            return EmbeddingConfig(refusal=f"its sentence-transformers pipeline has a {kind[:40]!r} module, which "
                                           "mlxinfer does not run (it runs Transformer, Pooling and Normalize)")
    return EmbeddingConfig(modes, normalize, as_message)


def _module_file(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _message_modality(path: Path, folder: str) -> bool:
    """Whether sentence-transformers (6 and later) formats a text as a chat message for this
    Transformer module: its `modality_config` has a 'message' entry, which it then always uses."""
    config = checkpoint_json(path, _module_file(folder, "sentence_bert_config.json"))
    modalities = config.get("modality_config") if isinstance(config, dict) else None
    return isinstance(modalities, dict) and "message" in modalities


# The older Pooling config's flags, in the order their vectors are concatenated.
LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _pooling_modes(path: Path, folder: str) -> tuple[str, ...]:
    """The Pooling module's modes, from its config.json in sentence-transformers 6's form
    (`pooling_mode`: a mode or a list) or the older one (a `pooling_mode_<mode>` flag each)."""
    name = _module_file(folder, "config.json")
    config = checkpoint_json(path, name)
    if not isinstance(config, dict):
        raise ConfigError(f"the Pooling module's {path / name} is missing or not an object; the checkpoint is damaged")
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in LEGACY_POOLING.items() if config.get(key))
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) else ()
    if not modes or not all(m in POOLING_MODES for m in modes):
        raise ConfigError(f"{path / name} names pooling {mode!r:.80}; expected one or more of "
                          f"{', '.join(POOLING_MODES)}")
    return modes


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, as its index lists them when it has one; every one
    inside the folder (an index or a link must not make us read files elsewhere)."""
    index = path / "model.safetensors.index.json"
    raw = read_checkpoint_file(path, index.name)
    if raw is not None:
        names = _index_shards(index, raw)
        listed = [checkpoint_file(path, n) for n in names]
        missing = [n for n, f in zip(names, listed) if f is None]
        if missing:
            raise CorruptCheckpointError(
                f"shard '{missing[0]}' listed in {index.name} is missing from '{path}'; re-download the checkpoint"
            )
        files = [f for f in listed if f is not None]
    else:
        found = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
        files = [f for f in (checkpoint_file(path, p.name) for p in found) if f is not None]
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CorruptCheckpointError(
            f"'{path}' holds only pickle weights ({pickles[0]}), which are unsafe to load; "
            "convert them to safetensors first (e.g. with the safetensors library)"
        )
    raise CorruptCheckpointError(f"no .safetensors weights in '{path}'")


def _index_shards(index: Path, raw: bytes) -> list[str]:
    """The shard names in a `model.safetensors.index.json` (`raw`, its bytes): plain .safetensors
    names inside its folder."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"cannot read {index} ({e}); re-download the checkpoint") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(
            f"{index} has no 'weight_map' object of tensor -> file names; re-download the checkpoint"
        )
    names = sorted(set(weight_map.values()))
    for name in names:
        parts = Path(name).parts
        if not name.endswith(".safetensors") or Path(name).is_absolute() or ".." in parts or "\\" in name:
            raise CorruptCheckpointError(
                f"{index} lists shard '{name[:80]}', which is not a .safetensors file inside the model folder; "
                "refusing to read it"
            )
    return names


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


# MLX's floating-point quantization modes and the (bits, group size) each fixes: E2M1 or E4M3
# codes with a power-of-two (E8M0) scale per 32 weights, or an E4M3 scale per 16 (nvfp4);
# scales only, no biases.
FLOAT_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}


def _quant_params(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict[str, Any]:
    """Bits, group size and mode of a layer, read off its packed weight and scales (a layer
    without biases is in the floating-point mode of its bits and group size)."""
    in_dims = module.weight.shape[-1]
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    bits, group_size = packed.shape[-1] * 32 // in_dims, in_dims // scales.shape[-1]
    floating = (m for m, fixed in FLOAT_MODES.items() if fixed == (bits, group_size))
    mode = "affine" if f"{path}.biases" in weights else next(floating, "affine")
    return {"bits": bits, "group_size": group_size, "mode": mode}


def quantize_like_checkpoint(model: nn.Module, quant: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers exactly where the checkpoint has quantized tensors,
    honouring mlx-lm's per-layer overrides in config.json."""

    def predicate(path: str, module: nn.Module):
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return _quant_params(path, module, weights)

    try:
        nn.quantize(
            model,
            group_size=quant.get("group_size", 64),
            bits=quant.get("bits", 4),
            mode=quant.get("mode", "affine"),
            class_predicate=predicate,
        )
    except ValueError as e:  # MLX refuses a bits/group size/mode the config (or tensor shapes) gave
        raise CorruptCheckpointError(f"config.json's quantization cannot be applied ({str(e).splitlines()[0]})") from None


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


def base_model_layout(weights: dict[str, mx.array]) -> bool:
    """Whether the tensors are a bare base model's (`layers.0...`, no `model.` prefix, no LM
    head): what transformers' AutoModel saves, and so what a sentence-transformers model and
    embedding checkpoints such as Qwen3-Embedding hold."""
    return "embed_tokens.weight" in weights and not any(k.startswith(("model.", "lm_head.")) for k in weights)


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


def half_scales(model: CausalLM, weights: dict[str, mx.array]) -> set[str]:
    """The half-precision scales and biases that stay so when the rest becomes float32: those of
    affine-quantized linear layers and embeddings where the CPU extension reads them exactly (it
    computes in float32 either way), so a token reads fewer bytes (a GGUF Q4_1 weight: 5 bits, not
    6). Embeddings then look up in float32."""
    if not quantized_matmul.half_scales_read_exactly():
        return set()
    kept = set()
    for name, module in model.named_modules():
        if type(module) not in (QuantizedLinear, QuantizedEmbedding) or module.mode != "affine":
            continue
        parts = [f"{name}.scales", f"{name}.biases"]
        if all(p in weights and weights[p].dtype in HALF for p in parts):
            kept.update(parts)
            if isinstance(module, QuantizedEmbedding):
                module.dtype = mx.float32
    return kept


def load_model(path: Path, dtype: str | mx.Dtype | None = None, shard: str | None = None, group=None) -> CausalLM:
    """Build and fill the model in a local checkpoint folder; with `shard="tensor"` and a
    distributed group of more than one process (`group`, default: the one `mlx.launch`
    started), only this rank's part of it."""
    requested = parse_dtype(dtype)
    config = read_config(path)
    files = weight_files(path)
    place = placement(shard, group)
    if place is not None:
        check_same_model(path, files, place)
        if shard == "tensor":
            config = shard_config(config, place.size)
    model = build_model(config)
    weights, origin = read_weights(files)
    if base_model_layout(weights):
        weights = {f"model.{k}": v for k, v in weights.items()}
        if "lm_head" in model:
            model.drop_head()
    weights = model.sanitize(weights)
    if place is not None and shard == "tensor":
        shrink_vocab(model, place)
        weights = shard_weights(weights, place, config)
    elif place is not None:
        mine = layer_ranges(layer_sizes(weights, len(model.layers)), place.size)[place.rank]
        model.model.layers = model.model.layers[mine.start : mine.stop]
        weights = stage_weights(weights, mine)
    if config.get("quantization"):
        quantize_like_checkpoint(model, config["quantization"], weights)
    check_weights(model, weights, origin, path)
    target = compute_dtype(weights, requested)
    if target is not None:
        kept = half_scales(model, weights) if requested is None else set()
        weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and k not in kept else v
                   for k, v in weights.items()}
    if place is not None:
        weights = materialize(weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    fuse_projections(model)
    model.sentence_embedding = read_embedding_config(path)
    if model.image_token_id is not None:
        model.image_processor = read_image_processor(path, config)
    if place is not None and shard == "tensor":
        wrap_reductions(model, place)
    if place is not None:
        if shard == "pipeline":
            model.model = Stage(model.model, place, mine.start)
        model.shard = place
    mx.eval(held_arrays(model))
    return model


OURS = __package__.partition(".")[0] + "."  # our own modules' objects: walked for the arrays they hold


def held_arrays(model: nn.Module) -> list[mx.array]:
    """Every array the model holds, parameters or not: modules' underscored members and the
    arrays of our own plain objects in them (a RoPE's frequency table, which M-RoPE computes
    lazily at construction; a vision tower's constants). Loading evaluates them all because an
    array left lazy is a graph on the loading thread's stream, and another thread evaluating it
    (a server's engine thread) fails ("There is no Stream(cpu, 0) in current thread")."""
    found: list[mx.array] = []
    seen: set[int] = set()
    todo: list[Any] = [model]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, mx.array):
            found.append(item)
            continue
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        if isinstance(item, nn.Module) or type(item).__module__.startswith(OURS):
            todo.extend(getattr(item, "__dict__", {}).values())
    return found


def placement(shard: str | None, group=None) -> Shard | None:
    """Where this process's part of a sharded model lies (None: the whole model here)."""
    if shard is None:
        return None
    if shard not in ("tensor", "pipeline"):
        raise InvalidOptionError(f"shard must be 'tensor' or 'pipeline', got {shard!r}")
    group = group if group is not None else world()
    return Shard.of(group) if group is not None and group.size() > 1 else None
