"""Qwen3 (dense): per-head RMSNorm on queries and keys, optional attention bias."""

from typing import Any

from .config import ModelConfig, parse_config
from .layers import CausalLM as Model
from .qwen2 import layer_types

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    bias = d.get("attention_bias", False)
    return parse_config(d, qkv_bias=bias, o_bias=bias, qk_norm=True, layer_types=layer_types(d))
