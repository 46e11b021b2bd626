"""Gemma 2: GeGLU, (1 + weight) RMSNorms around both sublayers, embeddings scaled
by sqrt(hidden), `query_pre_attn_scalar` attention scale, soft-capped attention
scores and logits, sliding-window and global layers alternating."""

from typing import Any

from .config import FULL, SLIDING, ModelConfig, _require, parse_config
from .layers import CausalLM as Model

__all__ = ["Model", "config", "gemma_fields"]


def layer_types(d: dict[str, Any], period: int) -> tuple[str, ...]:
    """Explicit `layer_types`, else every `period`-th layer global and the rest sliding."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(d.get("num_hidden_layers", 0)))


def gemma_fields(d: dict[str, Any], period: int) -> dict[str, Any]:
    """What every Gemma generation sets the same way."""
    return {
        "hidden_act": d.get("hidden_activation", "gelu_pytorch_tanh"),
        "norm_offset": 1.0,
        "embed_scale": _require(d, "hidden_size") ** 0.5,
        "query_pre_attn_scalar": d.get("query_pre_attn_scalar", 256),
        "sandwich_norms": True,
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "layer_types": layer_types(d, period),
    }


def config(d: dict[str, Any]) -> ModelConfig:
    return parse_config(
        d,
        **gemma_fields(d, period=2),
        attn_softcap=d.get("attn_logit_softcapping", 50.0),
        final_softcap=d.get("final_logit_softcapping", 30.0),
    )
