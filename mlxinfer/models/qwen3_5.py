"""Qwen3.5 multimodal checkpoints (model_type "qwen3_5"): the Qwen3.5 text model in
`text_config`, its weights under `language_model`; the vision encoder is dropped."""

from . import qwen3_5_text
from .multimodal import wrapper

__all__ = ["Model", "canonical", "config", "VISION"]

VISION = ("model.visual.", "visual.", "vision_tower.")

canonical, config, Model = wrapper(qwen3_5_text, VISION, tied=False)
