"""Qwen1.5-MoE / Qwen2-MoE: Qwen2 attention; sparse MoE feed-forward with a shared
expert behind a sigmoid gate, dense MLPs in `mlp_only_layers` and off the
`decoder_sparse_step` rhythm."""

from dataclasses import replace
from typing import Any

from .config import ModelConfig, MoEConfig, _require
from .moe import MoECausalLM as Model
from .qwen2 import config as qwen2_config

__all__ = ["Model", "config", "moe_config"]


def moe_config(d: dict[str, Any]) -> MoEConfig:
    """The Qwen MoE settings (Qwen3-MoE names `num_experts` `num_local_experts` when
    transformers 5 saves it)."""
    layers, step = d.get("num_hidden_layers", 0), d.get("decoder_sparse_step") or 1
    only = set(d.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=d.get("num_local_experts") or _require(d, "num_experts"),
        experts_per_token=_require(d, "num_experts_per_tok"),
        intermediate_size=_require(d, "moe_intermediate_size"),
        norm_topk_prob=d.get("norm_topk_prob", False),
        shared_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
        dense_layers=frozenset(i for i in range(layers) if i in only or (i + 1) % step),
    )


def config(d: dict[str, Any]) -> ModelConfig:
    return replace(qwen2_config(d), moe=moe_config(d))
