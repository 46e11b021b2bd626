"""Qwen3.5-MoE multimodal checkpoints (model_type "qwen3_5_moe"): the Qwen3.5-MoE text model
in `text_config`, its weights under `language_model`; the vision encoder is dropped."""

from . import qwen3_5_moe_text
from .multimodal import wrapper
from .qwen3_5 import VISION

__all__ = ["Model", "canonical", "config"]

canonical, config, Model = wrapper(qwen3_5_moe_text, VISION, tied=False)
