"""Gemma 3 multimodal checkpoints (model_type "gemma3"): the text model in
`text_config`, its weights under `language_model`; the vision tower is dropped."""

from typing import Any

import mlx.core as mx

from . import gemma3_text
from .config import ModelConfig
from .layers import CausalLM

__all__ = ["Model", "config"]

# Older hub checkpoints prefix `language_model.model.`, transformers 5 saves `model.language_model.`.
PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def config(d: dict[str, Any]) -> ModelConfig:
    text = dict(d.get("text_config") or {})
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if "quantization" in d:
        text["quantization"] = d["quantization"]
    return gemma3_text.config(text)


def text_name(name: str) -> str:
    for old, new in PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class Model(CausalLM):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text = {text_name(k): v for k, v in weights.items() if not k.startswith(VISION)}
        return super().sanitize(text)
