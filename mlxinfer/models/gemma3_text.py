"""Gemma 3 (text): Gemma 2's layers with (1 + weight) q/k norms instead of score
soft-capping, one global layer in every `sliding_window_pattern`, and a separate
RoPE base for the sliding layers."""

from typing import Any

from .config import FULL, SLIDING, ModelConfig, parse_config
from .gemma2 import gemma_fields
from .layers import CausalLM as Model

__all__ = ["Model", "config"]

# transformers' Gemma3TextConfig defaults: hub configs (the text_config of the
# multimodal checkpoints especially) leave these out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


def rope_parameters(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-layer-type RoPE in transformers 5's shape, also from the older
    `rope_theta` / `rope_local_base_freq` / `rope_scaling` (global layers only) keys."""
    given = d.get("rope_parameters") or {}
    full = {**(d.get("rope_scaling") or {}), **(given.get(FULL) or {})}
    full.setdefault("rope_theta", d.get("rope_theta", GLOBAL_THETA))
    local = dict(given.get(SLIDING) or {})
    local.setdefault("rope_theta", d.get("rope_local_base_freq", LOCAL_THETA))
    return {FULL: full, SLIDING: local}


def config(d: dict[str, Any]) -> ModelConfig:
    d = {**DEFAULTS, **d, "rope_parameters": rope_parameters(d)}
    return parse_config(
        d,
        **gemma_fields(d, period=d.get("sliding_window_pattern", 6)),
        qk_norm=True,
        final_softcap=d.get("final_logit_softcapping"),
    )
