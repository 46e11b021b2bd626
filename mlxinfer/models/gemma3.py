"""Gemma 3 multimodal checkpoints (model_type "gemma3"): the text model in
`text_config`, its weights under `language_model`; the vision tower is dropped."""

from typing import Any

import mlx.core as mx

from . import gemma3_text, multimodal
from .config import ModelConfig
from .layers import CausalLM
from .multimodal import text_config, text_weights

__all__ = ["Model", "canonical", "config"]

VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def canonical(d: dict[str, Any]) -> dict[str, Any]:
    return multimodal.canonical(d)


def config(d: dict[str, Any]) -> ModelConfig:
    return gemma3_text.config(text_config(d))


class Model(CausalLM):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(text_weights(weights, VISION))
