"""SmolLM3: Llama layers of which every `no_rope_layer_interval`-th (4th) uses no RoPE
(`no_rope_layers` holds 0 for those), optionally a sliding window on those NoPE layers."""

from typing import Any

from ..base.errors import ConfigError
from .config import FULL, SLIDING, ModelConfig, _require, parse_config
from .layers import CausalLM as Model

__all__ = ["Model", "config"]


def rope_flags(d: dict[str, Any]) -> list[int]:
    """1 for a layer with RoPE, 0 for one without: the config's list, else transformers' rule."""
    layers = _require(d, "num_hidden_layers")
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = d.get("no_rope_layer_interval", 4)
        return [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ConfigError(f"config.json lists {len(flags)} no_rope_layers for {layers} layers; fix the file")
    return flags


def layer_types(d: dict[str, Any], flags: list[int]) -> tuple[str, ...]:
    """Explicit `layer_types`, else transformers' rule: with `use_sliding_window`, the NoPE layers slide."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    slide = d.get("use_sliding_window") and d.get("sliding_window")
    return tuple(SLIDING if slide and not rope else FULL for rope in flags)


def config(d: dict[str, Any]) -> ModelConfig:
    bias = d.get("attention_bias", False)
    flags = rope_flags(d)
    return parse_config(
        d,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=d.get("mlp_bias", False),
        tie_word_embeddings=d.get("tie_word_embeddings", True),
        nope_layers=frozenset(i for i, rope in enumerate(flags) if not rope),
        layer_types=layer_types(d, flags),
    )
