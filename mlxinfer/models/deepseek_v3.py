"""DeepSeek-V3 / R1: DeepSeek-V2 with sigmoid routing,
a load-balancing bias that steers the choice (not the weights), group scores
from each group's two best experts, optional half-split RoPE, and the latent
up-projection stored as mlx-lm does (`embed_q` / `unembed_out`)."""

from __future__ import annotations

import re

import mlx.core as mx
from mlx import nn

from .config import ModelConfig
from .deepseek_v2 import Block as V2Block
from .deepseek_v2 import Model as V2Model
from .deepseek_v2 import MoE, Routing, config, keep_top_groups
from .deepseek_v2 import Router as V2Router
from .mla import MLAttention, UpProjection, layer_parts, quant_params
from .moe import top_k

__all__ = ["Model", "V3MoE", "config", "without_mtp_layers"]


class MultiLinear(nn.Module):
    """One [out, in] matrix per head, stored [heads, out, in]; quantizes along `in`."""

    def __init__(self, in_dims: int, out_dims: int, heads: int):
        super().__init__()
        self.weight = mx.zeros((heads, out_dims, in_dims))

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_) -> nn.Module:
        q = QuantizedMultiLinear()
        q.group_size, q.bits = group_size, bits
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        q.freeze()
        return q


class QuantizedMultiLinear(nn.Module):
    """MultiLinear's weights packed by `mx.quantize` (affine)."""


class Attention(MLAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, traditional_rope=cfg.raw.get("rope_interleave", True))

    def init_up_projection(self) -> None:
        m = self.mla
        self.embed_q = MultiLinear(m.nope_dim, m.kv_lora_rank, m.heads)
        self.unembed_out = MultiLinear(m.kv_lora_rank, m.v_dim, m.heads)

    def up_projection(self) -> UpProjection:
        return UpProjection(layer_parts(self.embed_q), layer_parts(self.unembed_out), True, quant_params(self.embed_q))


class Router(V2Router):
    """sigmoid(logits) + e_score_correction_bias picks the groups and experts; the
    weights are the plain sigmoid scores, normalised and scaled."""

    methods = ("noaux_tc",)

    def __init__(self, cfg: ModelConfig, r: Routing):
        super().__init__(cfg, r)
        self.e_score_correction_bias = mx.zeros((r.experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        r = self.routing
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        grouped = choice.reshape(*choice.shape[:-1], r.n_group, -1)
        group_score = mx.topk(grouped, min(2, grouped.shape[-1]), axis=-1).sum(-1)
        choice = keep_top_groups(choice, r, group_score, float("-inf"))
        return self.weigh(scores, top_k(choice, r.k)[0])


class V3MoE(MoE):
    router = Router


class Block(V2Block):
    attention_class = Attention
    moe_class = V3MoE


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def without_mtp_layers(weights: dict[str, mx.array], layers: int) -> dict[str, mx.array]:
    """`weights` without the multi-token-prediction layers checkpoints store past the last of
    the model's `layers` (a draft head for speculative decoding that generation here does not use)."""
    return {k: v for k, v in weights.items() if not ((m := _LAYER.match(k)) and int(m[1]) >= layers)}


class Model(V2Model):
    block = Block

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the multi-token-prediction layers past `num_hidden_layers` and split
        HF's `kv_b_proj` into per-head `embed_q` [heads, latent, nope] and
        `unembed_out` [heads, v, latent] (a quantized one is dequantized first)."""
        weights = super().sanitize(without_mtp_layers(weights, self.config.num_hidden_layers))
        for name in [k for k in weights if k.endswith(".kv_b_proj.weight")]:
            weights.update(self._split_kv_b(name.removesuffix(".kv_b_proj.weight"), weights))
        return weights

    def _split_kv_b(self, prefix: str, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        attn = self.layers[0].self_attn.mla
        w = weights.pop(f"{prefix}.kv_b_proj.weight")
        if f"{prefix}.kv_b_proj.scales" in weights:
            scales, biases = weights.pop(f"{prefix}.kv_b_proj.scales"), weights.pop(f"{prefix}.kv_b_proj.biases")
            bits = w.shape[-1] * 32 // attn.kv_lora_rank
            w = mx.dequantize(w, scales, biases, group_size=attn.kv_lora_rank // scales.shape[-1], bits=bits)
        w = w.reshape(-1, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)  # all heads, even when this rank keeps some
        return {
            f"{prefix}.embed_q.weight": mx.contiguous(w[:, : attn.nope_dim].swapaxes(-1, -2)),
            f"{prefix}.unembed_out.weight": mx.contiguous(w[:, attn.nope_dim :]),
        }
