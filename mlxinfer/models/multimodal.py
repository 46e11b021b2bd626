"""Multimodal checkpoints run as their text model: the text config in `text_config`, the
text weights under a language-model prefix, the vision tower dropped."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx

# Older hub checkpoints (and mlx-lm) prefix `language_model.model.`, transformers 5 saves `model.language_model.`.
PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}


def text_config(d: dict[str, Any], tied: bool = True) -> dict[str, Any]:
    """The text model's config.json: `text_config`, with the keys the wrapper keeps at its top
    level (the LM head's tying, `tied` when neither says; mlx-lm's quantization). A config
    without one is the text model's already (`canonical`)."""
    if "text_config" not in d:
        return dict(d)
    text = dict(d.get("text_config") or {})
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", text.get("tie_word_embeddings", tied))
    if "quantization" in d:
        text["quantization"] = d["quantization"]
    return text


def text_name(name: str) -> str:
    for old, new in PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def text_weights(weights: dict[str, mx.array], vision: tuple[str, ...]) -> dict[str, mx.array]:
    """The text model's tensors under its own names; those under the `vision` prefixes dropped."""
    return {text_name(k): v for k, v in weights.items() if not k.startswith(vision)}


def canonical(d: dict[str, Any], tied: bool = True) -> dict[str, Any]:
    """The text model's config under the wrapper's model_type (its weights keep the wrapper's
    names): the sizes at the top level, where a rank's config (`shard.shard_config`) divides them."""
    return {**text_config(d, tied), "model_type": d["model_type"]}


def wrapper(text: ModuleType, vision: tuple[str, ...], tied: bool = True) -> tuple[Any, Any, type]:
    """(canonical, config, Model) of a multimodal family around the text family `text`: its
    config read from `text_config` (the LM head tied as `tied` when neither level says), its
    weights from under the language-model prefix, those under the `vision` prefixes dropped."""

    def canonical_config(d: dict[str, Any]) -> dict[str, Any]:
        return canonical(d, tied)

    def config(d: dict[str, Any]):
        return text.config(text_config(d, tied))

    class Model(text.Model):
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            return super().sanitize(text_weights(weights, vision))

    return canonical_config, config, Model
