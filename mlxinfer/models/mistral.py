"""Mistral: Llama layers where every layer attends over a sliding window when one is set."""

from typing import Any

from .config import FULL, SLIDING, ModelConfig, parse_config
from .layers import CausalLM as Model

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    kind = SLIDING if d.get("sliding_window") else FULL
    return parse_config(d, layer_types=(kind,) * d.get("num_hidden_layers", 0))
