"""OLMo 3: OLMo 2's layers, three sliding-window layers to each full one, RoPE scaling
(YaRN in the long-context checkpoints) on the full-attention layers only."""

from typing import Any

from .config import FULL, SLIDING, ModelConfig
from .olmo2 import Model
from .olmo2 import config as olmo2_config

__all__ = ["Model", "config"]

DEFAULT_THETA = 500_000.0  # transformers' Olmo3Config default


def layer_types(d: dict[str, Any]) -> list[str]:
    """Explicit `layer_types`, else transformers' rule: every 4th layer full, the others sliding."""
    if d.get("layer_types"):
        return list(d["layer_types"])
    return [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(d.get("num_hidden_layers", 0))]


def rope_parameters(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-layer-type RoPE as transformers 5 saves it, also from hub configs' `rope_theta` +
    `rope_scaling`. Scaling applies to the full-attention layers only, as in transformers, and
    (as in mlx-lm and llama.cpp) `rope_theta` to both kinds: transformers would give a sliding
    layer its default base instead, a difference no released checkpoint shows (theirs is it)."""
    given = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if FULL in given or SLIDING in given:
        return {**given, FULL: {**(given.get(FULL) or {}), **scaling}}
    theta = given.get("rope_theta", d.get("rope_theta", DEFAULT_THETA))
    full = {**scaling, **given}
    full.setdefault("rope_theta", theta)
    return {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": theta}}


def config(d: dict[str, Any]) -> ModelConfig:
    return olmo2_config({**d, "layer_types": layer_types(d), "rope_parameters": rope_parameters(d)})
