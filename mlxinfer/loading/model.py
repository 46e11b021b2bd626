"""The public way in: `load` a model and its tokenizer by folder, name or hub id, with a LoRA
adapter on it when one is asked for; `load_tokenizer` alone. One `load` for every caller (the
Python API, the CLI, the server), whose signature shows every parameter it takes."""

from __future__ import annotations

import os

import mlx.core as mx

from ..models import CausalLM
from ..models.lora import registry
from ..text.tokenizer import Tokenizer, load_tokenizer_from_dir
from .adapters import load_adapter
from .checkpoint import TOKENIZER_FILES, load_model, resolve


def load(
    path_or_repo: str | os.PathLike, dtype: str | mx.Dtype | None = None, revision: str | None = None,
    shard: str | None = None, group=None, adapter_path: str | os.PathLike | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """Load a model and its tokenizer from a local folder, a name from `mlxinfer models` or a
    Hugging Face hub id (`checkpoint.resolve`), as the CLI's `--model` takes them; `shard="tensor"`
    (or "pipeline") splits it across the processes of a distributed `group` (see `shard`). The
    LoRA adapter in folder `adapter_path` (PEFT or mlx-lm) is applied unfused as the model's
    default: requests that name no adapter use it."""
    path = resolve(path_or_repo, revision)
    model, tokenizer = load_model(path, dtype, shard, group), load_tokenizer_from_dir(path)
    if adapter_path is not None:
        registry(model).default = load_adapter(model, adapter_path)
    return model, tokenizer


def load_tokenizer(path_or_repo: str | os.PathLike, revision: str | None = None) -> Tokenizer:
    """Only the tokenizer, of what `load` takes (downloads no weights for a hub id)."""
    return load_tokenizer_from_dir(resolve(path_or_repo, revision, TOKENIZER_FILES))
