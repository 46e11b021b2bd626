"""Qwen2/2.5 and DeepSeek-R1-Distill-Qwen: biased q/k/v projections; optional
sliding window on layers from `max_window_layers` on."""

from typing import Any

from .config import FULL, SLIDING, ModelConfig, parse_config
from .layers import CausalLM as Model

__all__ = ["Model", "config", "layer_types"]


def layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Qwen's rule when config.json predates explicit `layer_types`."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    sliding = d.get("use_sliding_window", False) and d.get("sliding_window")
    first = d.get("max_window_layers", 0)
    return tuple(SLIDING if sliding and i >= first else FULL for i in range(d.get("num_hidden_layers", 0)))


def config(d: dict[str, Any]) -> ModelConfig:
    return parse_config(d, qkv_bias=True, layer_types=layer_types(d))
