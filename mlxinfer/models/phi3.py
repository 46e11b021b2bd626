"""Phi-3 / Phi-3.5 / Phi-4-mini: fused `qkv_proj` and `gate_up_proj`, LongRoPE
(`longrope`, formerly `su`) for the 128k-context variants, optional partial rotary
and, like Mistral, a sliding window on every layer when one is set."""

from dataclasses import replace
from typing import Any

from ..base.errors import ConfigError
from .config import ModelConfig
from .layers import CausalLM as Model
from .mistral import config as mistral_config

__all__ = ["Model", "config"]

LONGROPE_ALIASES = ("su", "yarn", "longrope")  # transformers' Phi3Config reads all three as LongRoPE
LONGROPE_KEYS = ("short_factor", "long_factor", "original_max_position_embeddings")


def config(d: dict[str, Any]) -> ModelConfig:
    cfg = mistral_config(d)
    rope = cfg.rope
    if rope.kind in LONGROPE_ALIASES:
        params = {**rope.params}
        if d.get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        missing = [k for k in LONGROPE_KEYS if not params.get(k)]
        if missing:
            raise ConfigError(f"config.json's longrope scaling has no '{missing[0]}'; the checkpoint's config is incomplete")
        rope = replace(rope, kind="longrope", params=params)
    return replace(cfg, rope=rope, fused_qkv=True, fused_gate_up=True)
