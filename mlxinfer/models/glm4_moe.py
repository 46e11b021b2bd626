"""GLM-4.5 / GLM-4.5-Air / GLM-4.6: grouped-query attention with q/k/v bias (none on the
output), RoPE on half of each head (`partial_rotary_factor` 0.5), optional per-head q/k
RMSNorm (`use_qk_norm`); from layer `first_k_dense_replace` on, DeepSeek-V3's mixture of
experts (sigmoid routing steered by `e_score_correction_bias`, optional expert groups,
always-on shared experts); multi-token-prediction layers ignored."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn

from .config import ModelConfig, parse_config
from .deepseek_v2 import Block as DeepSeekBlock
from .deepseek_v2 import Model as DeepSeekModel
from .deepseek_v3 import V3MoE, without_mtp_layers
from .layers import Attention

__all__ = ["Model", "config"]


class Block(DeepSeekBlock):
    moe_class = V3MoE

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Attention(cfg, layer)


class Model(DeepSeekModel):
    block = Block

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(without_mtp_layers(weights, self.config.num_hidden_layers))


def config(d: dict[str, Any]) -> ModelConfig:
    d = {"partial_rotary_factor": 0.5, **d}  # transformers' default: hub configs say it, tests may not
    return parse_config(d, qkv_bias=d.get("attention_bias", False), qk_norm=bool(d.get("use_qk_norm")))
