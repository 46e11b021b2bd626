"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434; also DeepSeek-V3).

Keys and values come from one compressed latent per token (`kv_lora_rank` dims,
after `kv_a_layernorm`) plus a single rotary key (`qk_rope_head_dim` dims) that all
heads share. The KV cache stores exactly those two, as its "keys" and "values"
parts, so a token costs (kv_lora_rank + qk_rope_head_dim) numbers per layer
whatever the head count, and every cache kind (growing, rotating, quantized,
trimmed, saved) works unchanged.

The per-head up-projection from the latent has a key part K (latent -> nope dims)
and a value part V (latent -> v dims). Prefill expands the latent into full keys
and values; a one-token decode step instead absorbs K into the query and V into
the output, attending over the latent itself (no per-token expansion of the
cache). Families store K and V differently (DeepSeek-V2: rows of `kv_b_proj`;
mlx-lm's DeepSeek-V3: `embed_q` / `unembed_out`), so they only say where K and V
are; quantized ones are used packed, never requantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from ..base.errors import ConfigError
from .config import ModelConfig
from .attention import Mask, offsets, per_row, stored_kv
from .layers import Linear, RoPE, yarn_mscale

Parts = tuple[mx.array, ...]  # (weight,) or MLX's (packed, scales, biases)


@dataclass(frozen=True)
class MLAConfig:
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool
    scale: float


def parse_mla(cfg: ModelConfig) -> MLAConfig:
    """MLA dimensions from config.json. The softmax scale is 1/sqrt(qk head dim), times
    mscale(factor, mscale_all_dim)^2 under scaled RoPE (DeepSeek's YaRN correction;
    the rotary part's own attention factor is applied by RoPE)."""
    d = cfg.raw
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if k not in d]
    if missing:
        raise ConfigError(f"config.json has no '{missing[0]}', which latent attention needs; the config is incomplete")
    scale = (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5
    m_all, factor = cfg.rope.params.get("mscale_all_dim"), cfg.rope.params.get("factor")
    if cfg.rope.kind != "default" and m_all and factor:
        scale *= yarn_mscale(factor, m_all) ** 2
    return MLAConfig(
        heads=cfg.num_attention_heads,
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"],
        nope_dim=d["qk_nope_head_dim"],
        rope_dim=d["qk_rope_head_dim"],
        v_dim=d["v_head_dim"],
        bias=d.get("attention_bias", False),
        scale=scale,
    )


def head_matmul(x: mx.array, parts: Parts, transpose: bool, quant: dict[str, Any] | None) -> mx.array:
    """x @ W (or W^T) per head for W stored [heads, rows, cols], float or quantized along cols."""
    if quant is None:
        w = parts[0]
        return x @ (w.swapaxes(-1, -2) if transpose else w)
    return mx.quantized_matmul(x, *parts, transpose=transpose, **quant)


def quant_params(layer: nn.Module) -> dict[str, Any] | None:
    return {"group_size": layer.group_size, "bits": layer.bits} if "scales" in layer else None


def layer_parts(layer: nn.Module) -> Parts:
    return (layer.weight, layer.scales, layer.biases) if "scales" in layer else (layer.weight,)


@dataclass(frozen=True)
class UpProjection:
    """Where a layer's K and V live: `k` is [heads, nope, latent] or, when
    `k_latent_rows`, [heads, latent, nope]; `v` is [heads, v, latent]."""

    k: Parts
    v: Parts
    k_latent_rows: bool
    quant: dict[str, Any] | None

    def keys(self, latent: mx.array) -> mx.array:
        return head_matmul(latent, self.k, not self.k_latent_rows, self.quant)

    def absorb_query(self, q_nope: mx.array) -> mx.array:
        return head_matmul(q_nope, self.k, self.k_latent_rows, self.quant)

    def values(self, latent: mx.array) -> mx.array:
        return head_matmul(latent, self.v, True, self.quant)


class MLAttention(nn.Module):
    """Latent attention with the DeepSeek-V2 weight layout (`kv_b_proj`); HF names."""

    def __init__(self, cfg: ModelConfig, traditional_rope: bool = True):
        super().__init__()
        m = self.mla = parse_mla(cfg)
        h, qk = cfg.hidden_size, m.nope_dim + m.rope_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, m.heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, m.q_lora_rank, bias=m.bias)
            self.q_a_layernorm = nn.RMSNorm(m.q_lora_rank, eps=1e-6)  # DeepSeek's fixed eps, not rms_norm_eps
            self.q_b_proj = Linear(m.q_lora_rank, m.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, m.kv_lora_rank + m.rope_dim, bias=m.bias)
        self.kv_a_layernorm = nn.RMSNorm(m.kv_lora_rank, eps=1e-6)
        self.init_up_projection()
        self.o_proj = Linear(m.heads * m.v_dim, h, bias=m.bias)
        self.rope = RoPE(cfg, traditional=traditional_rope)

    def init_up_projection(self) -> None:
        m = self.mla
        self.kv_b_proj = Linear(m.kv_lora_rank, m.heads * (m.nope_dim + m.v_dim), bias=False)

    def up_projection(self) -> UpProjection:
        """K and V as views of kv_b_proj's rows (head-major: nope rows, then v rows)."""
        m = self.mla
        parts = tuple(p.reshape(m.heads, m.nope_dim + m.v_dim, -1) for p in layer_parts(self.kv_b_proj))
        k = tuple(p[:, : m.nope_dim] for p in parts)
        v = tuple(p[:, m.nope_dim :] for p in parts)
        return UpProjection(k, v, False, quant_params(self.kv_b_proj))

    def _queries(self, x: mx.array) -> mx.array:
        if "q_proj" in self:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(self, x: mx.array, mask: Mask, cache=None) -> mx.array:
        m = self.mla
        B, T, _ = x.shape
        q = self._queries(x).reshape(B, T, m.heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [m.nope_dim], axis=-1)
        kv = self.kv_a_proj_with_mqa(x)
        latent = mx.expand_dims(self.kv_a_layernorm(kv[..., : m.kv_lora_rank]), 1)  # [B, 1, T, rank]
        k_pe = mx.expand_dims(kv[..., m.kv_lora_rank :], 1)  # [B, 1, T, rope_dim]
        offset = offsets(cache)
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        o = per_row(self._attend, cache, mask, q_nope, q_pe, latent, k_pe)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, T, -1))

    def _attend(self, q_nope, q_pe, latent, k_pe, cache, mask: Mask) -> mx.array:
        m = self.mla
        if cache is not None:
            latent, k_pe = stored_kv(cache, latent, k_pe)
        up = self.up_projection()
        if q_nope.shape[2] == 1:
            return self._absorbed(q_nope, q_pe, latent, k_pe, up, mask)
        k_nope = up.keys(latent)
        k = mx.concatenate([k_nope, mx.broadcast_to(k_pe, (*k_nope.shape[:3], m.rope_dim))], axis=-1)
        q = mx.concatenate([q_nope, q_pe], axis=-1)
        return mx.fast.scaled_dot_product_attention(q, k, up.values(latent), scale=m.scale, mask=mask)

    def _absorbed(self, q_nope, q_pe, latent, k_pe, up: UpProjection, mask) -> mx.array:
        """One query per head attending over the cached latent: scores are
        (q_nope K) . latent + q_pe . k_pe, and V is applied after the weighted sum."""
        scores = up.absorb_query(q_nope) @ latent.swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2)
        scores = scores * self.mla.scale
        if isinstance(mask, mx.array):
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        probs = mx.softmax(scores, axis=-1, precise=True)
        return up.values(probs @ latent)
