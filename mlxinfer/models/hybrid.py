"""Hybrid models: decoder layers whose token mixer is attention in some layers and a
recurrent layer in the others (`layer_types`): a Gated DeltaNet (`linear_attention`,
checkpoint name `linear_attn`) or a short convolution (`conv`, name `conv`). The rest of
each block (norms, residuals, dense or MoE feed-forward) is the ordinary one."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import CONV, FULL, LINEAR, SLIDING, ModelConfig
from .gated_delta import GatedDeltaNet
from .layers import Block, CausalLM, SwiGLU
from .moe import SparseMoE, stack_experts
from .short_conv import ShortConv

MIXER_NAMES = {LINEAR: "linear_attn", CONV: "conv"}


def interval_layer_types(d: dict[str, Any], default_interval: int = 4) -> tuple[str, ...]:
    """`layer_types`, or Qwen's rule when a config leaves it out: every
    `full_attention_interval`-th layer attends, the others are linear attention."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    every = d.get("full_attention_interval", default_interval)
    return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(d.get("num_hidden_layers", 0)))


class HybridBlock(Block):
    """A pre-norm block whose mixer follows the layer's type; the feed-forward is a sparse
    MoE where the config has experts for the layer, else the gated MLP."""

    def __init__(self, cfg: ModelConfig, layer: int):
        kind = cfg.layer_types[layer]
        self.mixer_name = MIXER_NAMES.get(kind, "self_attn")
        self.attends = kind in (FULL, SLIDING)
        super().__init__(cfg, layer)

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        kind = cfg.layer_types[layer]
        if kind == LINEAR:
            return GatedDeltaNet(cfg)
        if kind == CONV:
            return ShortConv(cfg)
        return super().attention(cfg, layer)

    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg) if cfg.moe is not None and cfg.moe.sparse(layer) else SwiGLU(cfg)


class HybridLM(CausalLM):
    """A causal LM of HybridBlocks; MoE checkpoints' per-expert tensors are stacked."""

    block = HybridBlock

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize({k: v for k, v in weights.items() if not k.startswith("mtp.")})
        if self.config.moe is not None:
            weights = stack_experts(weights, self.config.moe.num_experts)
        return weights
