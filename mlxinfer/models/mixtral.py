"""Mixtral: Mistral layers whose feed-forward (`block_sparse_moe`) is a sparse MoE
whose top-k routing weights are renormalised to sum to 1."""

from dataclasses import replace
from typing import Any, ClassVar

import mlx.core as mx

from .config import ModelConfig, MoEConfig, _require
from .mistral import config as mistral_config
from .moe import MoEBlock, MoECausalLM

__all__ = ["Model", "config"]


class Block(MoEBlock):
    ffn_name = "block_sparse_moe"


class Model(MoECausalLM):
    block = Block
    expert_names: ClassVar[dict[str, str]] = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers 5 keeps Mixtral's router and fused experts under `mlp`."""
        return super().sanitize({k.replace(".mlp.", ".block_sparse_moe."): v for k, v in weights.items()})


def config(d: dict[str, Any]) -> ModelConfig:
    experts, k = _require(d, "num_local_experts"), _require(d, "num_experts_per_tok")
    moe = MoEConfig(experts, k, _require(d, "intermediate_size"), norm_topk_prob=True)
    return replace(mistral_config(d), moe=moe)
