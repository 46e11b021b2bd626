"""Llama 2/3/3.1/3.2, SmolLM/SmolLM2, TinyLlama, DeepSeek-R1-Distill-Llama."""

from typing import Any

from .config import ModelConfig, parse_config
from .layers import CausalLM as Model

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    bias = d.get("attention_bias", False)
    return parse_config(d, qkv_bias=bias, o_bias=bias, mlp_bias=d.get("mlp_bias", False))
