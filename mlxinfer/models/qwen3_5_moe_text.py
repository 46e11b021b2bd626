"""Qwen3.5-MoE (text): Qwen3.5's layers with a sparse MoE in every one (normalised top-k
routing and a shared expert behind a sigmoid gate)."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .qwen2_moe import moe_config
from .qwen3_5_text import Model
from .qwen3_next import hybrid_config

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    # every layer is sparse and top-k weights are renormalised, whatever older keys say
    d = {**d, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    d.setdefault("intermediate_size", d.get("shared_expert_intermediate_size") or d.get("moe_intermediate_size"))
    return hybrid_config(d, moe=moe_config(d))
