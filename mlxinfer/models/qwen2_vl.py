"""Qwen2-VL (model_type "qwen2_vl"): as Qwen2.5-VL (`qwen2_5_vl`: the Qwen2 language model with
M-RoPE in sections, the placeholders, positions and delta) with the older vision tower of
`qwen2_vision` (no windows, LayerNorms, a QuickGELU MLP)."""

from __future__ import annotations

from . import qwen2_5_vl
from .qwen2_vision import Qwen2VisionTransformer

__all__ = ["Model", "canonical", "config"]

canonical = qwen2_5_vl.canonical
config = qwen2_5_vl.config


class Model(qwen2_5_vl.Model):
    vision_class = Qwen2VisionTransformer
