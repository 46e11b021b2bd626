"""Gemma 3 multimodal checkpoints (model_type "gemma3"): the text model in
`text_config`, its weights under `language_model`; the vision tower is dropped."""

from . import gemma3_text
from .multimodal import wrapper

__all__ = ["Model", "canonical", "config"]

VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

canonical, config, Model = wrapper(gemma3_text, VISION)
