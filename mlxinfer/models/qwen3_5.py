"""Qwen3.5 multimodal checkpoints (model_type "qwen3_5"): the Qwen3.5 text model in
`text_config`, its weights under `language_model`; the vision encoder is dropped."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import multimodal, qwen3_5_text
from .config import ModelConfig
from .multimodal import text_config, text_weights

__all__ = ["Model", "canonical", "config", "VISION"]

VISION = ("model.visual.", "visual.", "vision_tower.")


def canonical(d: dict[str, Any]) -> dict[str, Any]:
    return multimodal.canonical(d, tied=False)


def config(d: dict[str, Any]) -> ModelConfig:
    return qwen3_5_text.config(text_config(d, tied=False))


class Model(qwen3_5_text.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(text_weights(weights, VISION))
