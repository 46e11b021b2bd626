"""Which models this machine has, under the names `--model`, the server and `mlxinfer models` use.

mlxinfer's own cache (`cachedir.models_dir`, where conversions and pulls land) is listed by
folder name; the Hugging Face cache by repo id; other folders by path. Below the CLI and the
server so both list, resolve, copy and delete by the same names; what converts or fetches
(`convert.pull`) lives above it.

A model pulled into the cache, or a `.gguf` file `--model` converts, is named by `cache_name`:
the repo's (or file's) name in lowercase and how it is stored, `smollm2-135m-instruct-4bit`, so
the name is the same on every run and on every machine. The demo model keeps the name it always
had (`SmolLM2-135M-Instruct`), and a GGUF conversion made before under its older content-keyed
name (`tiny.Q4_1-1a2b3c4d`) is reused under it, so caches made before stay valid.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.cachedir import is_model_folder, models_dir
from ..base.errors import MlxinferError, ModelExistsError, ModelNotFoundError, StoreError
from ..base.files import checkpoint_file, write_problem
from ..base.safetensors import safetensors_header
from ..models import FAMILIES
from .checkpoint import read_config, weight_files
from .quant_summary import bits_per_weight, quantization_summary


@dataclass(frozen=True)
class LocalModel:
    """One model found on this machine, as `mlxinfer models` lists it."""

    name: str  # what --model accepts
    where: str  # "mlxinfer" (our cache), "huggingface" (the HF cache) or "folder"
    path: Path
    family: str
    parameters: int
    quantization: str
    size: int
    error: str | None = None  # why a folder that looks like a model cannot be read ("broken")

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "path": str(self.path)}


def local_models(folders: Iterable[Path] = ()) -> list[LocalModel]:
    """Models in our cache, the Hugging Face cache, and in (or directly under) `folders`."""
    found: list[tuple[str, str, Path]] = []
    if models_dir().is_dir():
        found += [(p.name, "mlxinfer", p) for p in sorted(models_dir().iterdir())
                  if not p.name.startswith(".") and is_model_folder(p)]  # a dot folder is a copy or conversion under way
    found += [(repo, "huggingface", p) for repo, p in huggingface_models()]
    for folder in folders:
        candidates = [folder] if is_model_folder(folder) else sorted(p for p in folder.iterdir() if p.is_dir())
        found += [(str(p), "folder", p) for p in candidates if is_model_folder(p)]
    seen: set[Path] = set()
    out = []
    for name, where, path in found:
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        out.append(describe(name, where, path))
    return out


def huggingface_models() -> list[tuple[str, Path]]:
    """(repo id, snapshot folder) for every cached hub model that has weights."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
    )
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: (bool(r.refs), r.last_modified), reverse=True)
        snapshot = next((r.snapshot_path for r in revisions if is_model_folder(r.snapshot_path)), None)
        if snapshot is not None:
            out.append((repo.repo_id, snapshot))
    return out


def describe(name: str, where: str, path: Path) -> LocalModel:
    """A model folder's listing entry; a folder whose config or weights cannot be read is
    listed as "broken" with the reason, so one damaged folder does not hide the others."""
    try:
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        config = read_config(path)
        headers = [safetensors_header(f) for f in weight_files(path)]  # as loading reads them: links checked
    except (MlxinferError, OSError) as e:
        return LocalModel(name, where, path, "broken", 0, "?", 0, error=str(e) or type(e).__name__)
    tensors = {k: v for h in headers for k, v in h.items()}
    model_type = config.get("model_type", "?")
    family = model_type if model_type in FAMILIES else f"{model_type} (unsupported)"
    return LocalModel(name, where, path, family, parameter_count(tensors, config), quantization(tensors, config), size)


def _layer_quant(config: dict[str, Any], layer: str) -> dict[str, Any]:
    q = config.get("quantization") or {}
    own = q.get(layer)
    return own if isinstance(own, dict) else q


def parameter_count(tensors: dict[str, Any], config: dict[str, Any]) -> int:
    """Parameters as the unquantized model has them (tied embeddings counted once); a
    quantized weight packs 32/bits values per uint32, a Hugging Face MXFP4 `*_blocks`
    tensor two per byte (its `*_scales` are not parameters)."""
    total = 0
    for name, info in tensors.items():
        base = name.rsplit(".", 1)[0]
        quantized = f"{base}.scales" in tensors
        if quantized and name.endswith((".scales", ".biases")):
            continue
        if name.endswith("_scales") and f"{name.removesuffix('_scales')}_blocks" in tensors:
            continue
        n = 1
        for d in info["shape"]:
            n *= d
        if quantized and name.endswith(".weight"):
            n = n * 32 // (_layer_quant(config, base).get("bits") or 4)
        elif name.endswith("_blocks"):
            n *= 2
        total += n
    return total


def stored_weights(path: Path) -> dict[str, Any]:
    """How a model folder's weights are stored, for `mlxinfer inspect`: the bits chosen per layer
    (or the float type), bits per weight over every stored tensor, and config.json's
    "quantization_method" (how a calibrated conversion chose them) when it has one."""
    config = read_config(path)
    headers = {k: v for f in weight_files(path) for k, v in safetensors_header(f).items()}
    quant = config.get("quantization")
    sizes = {name: (tuple(e["shape"]), e["data_offsets"][1] - e["data_offsets"][0]) for name, e in headers.items()}
    return {
        "precision": quantization_summary(quant, headers) or quantization(headers, config),
        "bits_per_weight": bits_per_weight(quant, sizes),
        "method": config.get("quantization_method"),
    }


def quantization(tensors: dict[str, Any], config: dict[str, Any]) -> str:
    """'4-bit g64', with '(mixed)' when some layers differ; else the float dtype."""
    q = config.get("quantization")
    if q:
        mode = q.get("mode", "affine")
        label = f"{q.get('bits', '?')}-bit g{q.get('group_size', '?')}" if mode == "affine" else str(mode)
        layers = [v for v in q.values() if isinstance(v, (dict, bool))]
        own = (q.get("bits"), q.get("group_size"))
        if any(v is False or (isinstance(v, dict) and (v.get("bits"), v.get("group_size")) != own) for v in layers):
            label += " (mixed)"
        return label
    dtypes = Counter(info["dtype"] for info in tensors.values())
    names = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
    return names.get(dtypes.most_common(1)[0][0], "?") if dtypes else "?"


# names, and changes to our cache

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")
_UNSAFE = re.compile(r"[^a-z0-9._+-]+")


def cache_name(base: str, precision: str) -> str:
    """The name a model pulled into our cache gets: `base` (a repo or file name) in lowercase with
    anything but letters, digits and `._+-` made a dash, then how it is stored (`4bit`,
    `mixed-4-6`, `bf16`, a GGUF's `q4_k_m`), unless the base already ends with it
    (`SmolLM2-135M-Instruct-4bit` stays `smollm2-135m-instruct-4bit`)."""
    stem = _UNSAFE.sub("-", base.lower()).strip("-.") or "model"
    tag = _UNSAFE.sub("-", precision.lower()).strip("-.")
    return stem if not tag or stem.endswith(f"-{tag}") else f"{stem}-{tag}"


def check_new_name(name: str) -> Path:
    """The folder in our cache a new model called `name` takes; refused when the name is not one
    a folder and `--model` can carry, or when a model (or anything else) already has it."""
    if not _NAME.fullmatch(name):
        raise StoreError(f"'{name}' cannot name a model: use letters, digits and . _ : + - (no /), "
                         "starting with a letter or digit, at most 128 characters")
    folder = models_dir() / name
    if os.path.lexists(folder):
        raise ModelExistsError(f"a model named '{name}' is already in mlxinfer's cache ({folder}); "
                               f"`mlxinfer rm {name}` first to replace it, or choose another name", name)
    return folder


def find(name: str) -> LocalModel | None:
    """The model `name` stands for, as `mlxinfer models` lists it: a folder in our cache, a repo id
    in the Hugging Face cache, or a model folder's path; None when it is none of these."""
    if _NAME.fullmatch(name) and is_model_folder(models_dir() / name):
        return describe(name, "mlxinfer", models_dir() / name)
    hub = dict(huggingface_models()) if "/" in name else {}
    if name in hub:
        return describe(name, "huggingface", hub[name])
    path = Path(name).expanduser()
    return describe(name, "folder", path) if is_model_folder(path) else None


def remove(name: str) -> LocalModel:
    """Delete the model `name` from our cache and return what it was. Only our cache: a Hugging
    Face cache snapshot or a folder of the user's is refused, saying how to delete it. The folder
    is first renamed to a hidden name, so a crash halfway leaves nothing listed half-deleted."""
    found = removable(name)
    doomed = found.path.with_name(f".{found.path.name}.removing-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(found.path, doomed)
    except OSError as e:
        raise StoreError(f"cannot delete '{name}' ({write_problem(e)}); check {models_dir()}") from None
    shutil.rmtree(doomed, ignore_errors=True)
    return found


def removable(name: str) -> LocalModel:
    """The model `remove(name)` would delete, or the error it would raise: so a command can ask
    "delete this?" only about what it may delete."""
    found = find(name)
    if found is None:
        raise ModelNotFoundError(f"no model named '{name}' in mlxinfer's cache; `mlxinfer models` lists the names")
    if found.where == "huggingface":
        raise StoreError(f"'{name}' is in the Hugging Face cache, not mlxinfer's; delete it with "
                         f"`hf cache rm model/{name}` (older huggingface_hub: `huggingface-cli delete-cache`)")
    if found.where != "mlxinfer":
        raise StoreError(f"'{name}' is a folder of yours ({found.path}), not in mlxinfer's cache; "
                         "mlxinfer deletes only what it made: remove the folder yourself")
    return found


def copy(source_name: str, new_name: str) -> LocalModel:
    """A copy of the model `source_name` (any name `mlxinfer models` lists) in our cache under
    `new_name`, as Ollama's `/api/copy` makes one. Files are hard-linked where the file system
    allows (a copy costs no space; every writer replaces files, never edits them) and copied
    otherwise; a file linking outside its folder is refused as loading refuses it. The copy
    appears whole or not at all."""
    found = find(source_name)
    if found is None:
        raise ModelNotFoundError(f"no model named '{source_name}'; `mlxinfer models` lists the names")
    target = check_new_name(new_name)
    stage = target.with_name(f".{new_name}.copy-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        stage.mkdir(parents=True)
        for entry in sorted(found.path.iterdir()):
            src = checkpoint_file(found.path, entry.name)  # refuses a link that leaves the folder
            if src is not None:
                _link_or_copy(src.resolve(), stage / entry.name)
        os.rename(stage, target)  # fails, rather than merging, if the name was taken meanwhile
    except OSError as e:
        shutil.rmtree(stage, ignore_errors=True)
        raise StoreError(f"cannot copy '{source_name}' to '{new_name}' ({write_problem(e)}); "
                         f"check the space and permissions of {models_dir()}") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return describe(new_name, "mlxinfer", target)


def _link_or_copy(src: Path, dst: Path) -> None:
    with contextlib.suppress(OSError):
        os.link(src, dst)
        return
    shutil.copy2(src, dst)


@dataclass(frozen=True)
class ModelDetails:
    """What `mlxinfer show` (and Ollama's `/api/show`) say about one model: its listing, how it
    was quantized (per layer, bits per weight, and config.json's "quantization_method" when a
    calibrated conversion chose the bits), the context it runs with, and its chat template."""

    model: LocalModel
    context_length: int | None
    precision: str  # `quantization_summary`: '180 x 4-bit g64 (180 layers); embedding ...', or the float type
    bits_per_weight: float
    method: dict[str, Any] | None
    template: str | None
    config: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {**self.model.as_dict(), "context_length": self.context_length, "precision": self.precision,
                "bits_per_weight": self.bits_per_weight, "quantization_method": self.method,
                "template": self.template}


def details(name: str) -> ModelDetails:
    """The details of the model `name` (any name `mlxinfer models` lists), read from its files
    without loading its weights."""
    from ..models import model_config
    from ..text.tokenizer import load_tokenizer_from_dir

    found = find(name)
    if found is None:
        raise ModelNotFoundError(f"no model named '{name}'; `mlxinfer models` lists the names")
    if found.error is not None:
        raise ModelNotFoundError(f"'{name}' cannot be read ({found.error}); pull or convert it again")
    config = read_config(found.path)
    weights = stored_weights(found.path)
    try:
        context = model_config(config).max_position_embeddings
    except MlxinferError:  # a family we do not run: the listing says so; its context is unknown
        context = None
    return ModelDetails(found, context, weights["precision"], weights["bits_per_weight"], weights["method"],
                        load_tokenizer_from_dir(found.path).chat_template, config)
