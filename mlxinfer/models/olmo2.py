"""OLMo 2: no norm before either sublayer, an RMSNorm on each sublayer's output before
the residual add, and q/k RMSNorm over the whole projection (all heads at once) rather
than per head."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .config import ModelConfig, parse_config
from .layers import Attention as _Attention
from .layers import Block as _Block
from .layers import CausalLM, ProjectionNorm, rms_norm

__all__ = ["Model", "config"]


class Attention(_Attention):
    """q_norm and k_norm span heads x head_dim, so they run before the heads are split."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.q_norm = ProjectionNorm(self.n_heads * self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ProjectionNorm(self.n_kv_heads * self.head_dim, cfg.rms_norm_eps)

    def _qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super()._qkv(x)
        return self.q_norm(q), self.k_norm(k), v

    def _heads(self, x: mx.array, n: int, norm=None) -> mx.array:
        return super()._heads(x, n)  # normed already, across the heads


class Block(_Block):
    """x + post_attention_norm(attn(x)), then x + post_feedforward_norm(mlp(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        del self.input_layernorm
        self.post_feedforward_layernorm = rms_norm(cfg)

    def attention(self, cfg: ModelConfig, layer: int) -> Attention:
        return Attention(cfg, layer)

    def __call__(self, x: mx.array, mask, cache=None) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Model(CausalLM):
    block = Block


def config(d: dict[str, Any]) -> ModelConfig:
    bias = d.get("attention_bias", False)
    return parse_config(d, qkv_bias=bias, o_bias=bias)
