"""Shared transformer building blocks; family files compose these.

Module and parameter names follow Hugging Face's (`model.layers.N.self_attn.q_proj`),
so HF and mlx-lm checkpoints load without renaming.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError
from .config import ModelConfig

ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn")


def _inv_freq(base: float, dims: int) -> np.ndarray:
    return 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)


def _llama3_inv_freq(inv: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend between."""
    factor, low, high = p["factor"], p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    return (1 - smooth) * inv / factor + smooth * inv


def _yarn_inv_freq(inv: np.ndarray, base: float, dims: int, p: dict[str, Any], max_pos: int):
    """YaRN (arXiv 2309.00071): interpolate low frequencies, extrapolate high ones,
    and return the attention factor that rescales cos/sin."""
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1 - ramp
    return inv / factor * ramp + inv * extrapolate, float(attn)


class RoPE:
    """Rotary embedding with the scaling variants real checkpoints use.

    Every variant except `dynamic` is a fixed frequency table handed to
    `mx.fast.rope`; `dynamic` (NTK) recomputes its base from the sequence length
    at each call, as transformers does, so cached keys keep the base they were
    written with.
    """

    def __init__(self, cfg: ModelConfig):
        r = cfg.rope
        if r.kind not in ROPE_KINDS:
            raise ConfigError(
                f"unsupported rope type '{r.kind}'; supported: {', '.join(ROPE_KINDS)}"
            )
        self.dims = cfg.rotary_dims
        self.base = r.theta
        self.kind = r.kind
        self.params = r.params
        self.max_pos = cfg.max_position_embeddings
        self.attention_factor = 1.0
        inv = _inv_freq(r.theta, self.dims)
        if r.kind == "linear":
            inv = inv / r.params["factor"]
        elif r.kind == "llama3":
            inv = _llama3_inv_freq(inv, r.params)
        elif r.kind == "yarn":
            inv, self.attention_factor = _yarn_inv_freq(inv, r.theta, self.dims, r.params, self.max_pos)
        self.freqs = None if r.kind in ("default", "dynamic") else mx.array(1.0 / inv, dtype=mx.float32)

    def _base(self, seq_len: int) -> float:
        if self.kind != "dynamic" or seq_len <= self.max_pos:
            return self.base
        factor = self.params["factor"]
        growth = factor * seq_len / self.max_pos - (factor - 1)
        return self.base * growth ** (self.dims / (self.dims - 2))

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        base = None if self.freqs is not None else self._base(offset + x.shape[-2])
        y = mx.fast.rope(
            x, self.dims, traditional=False, base=base, scale=1.0, offset=offset, freqs=self.freqs
        )
        if self.attention_factor == 1.0:
            return y
        if self.dims == y.shape[-1]:
            return y * self.attention_factor
        return mx.concatenate([y[..., : self.dims] * self.attention_factor, y[..., self.dims :]], -1)


def attention_mask(queries: int, offset: int, window: int | None) -> mx.array | str | None:
    """Causal (optionally windowed) mask for `queries` new tokens after `offset` cached ones.

    A window keeps `window` keys including the query's own position, as
    transformers' sliding-window mask does.
    """
    if window is None or offset + queries <= window:
        return "causal" if queries > 1 else None
    q = mx.arange(offset, offset + queries)[:, None]
    k = mx.arange(offset + queries)[None]
    return (k <= q) & (k > q - window)


DEQUANTIZE_ROWS = 8


class QuantizedLinear(nn.QuantizedLinear):
    """On MLX's CPU backend a quantized matmul costs about as much per input row
    as a whole matrix-vector product (a 512-token prefill through a 1536x576
    4-bit layer: 679 ms, against 36 ms to dequantize once and use BLAS), so from
    `DEQUANTIZE_ROWS` rows on the CPU path dequantizes. Metal keeps MLX's kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows < DEQUANTIZE_ROWS or self.mode != "affine" or mx.default_device().type != mx.DeviceType.cpu:
            return super().__call__(x)
        w = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        y = x @ w.T
        return y + self.bias if "bias" in self else y


class Linear(nn.Linear):
    """nn.Linear whose quantized form is the QuantizedLinear above."""

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v/o bias and per-head q/k RMSNorm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.n_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.n_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
            self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rope = RoPE(cfg)
        self.scale = d**-0.5

    def _heads(self, x: mx.array, n: int, norm: nn.Module | None = None) -> mx.array:
        B, T, _ = x.shape
        x = x.reshape(B, T, n, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, mask: mx.array | str | None, cache=None) -> mx.array:
        B, T, _ = x.shape
        q = self._heads(self.q_proj(x), self.n_heads, getattr(self, "q_norm", None))
        k = self._heads(self.k_proj(x), self.n_kv_heads, getattr(self, "k_norm", None))
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is None:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        else:
            o = cache.attend(q, k, v, self.scale, mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the feed-forward of every Llama-style model."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ConfigError(f"hidden_act '{cfg.hidden_act}' is not supported for SwiGLU (expected 'silu')")
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.window = cfg.window(layer)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    def __call__(self, x: mx.array, mask, cache=None) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Block(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        x = self.embed_tokens(tokens)
        caches = cache if cache is not None else [None] * len(self.layers)
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, caches):
            if layer.window not in masks:
                masks[layer.window] = (
                    c.make_mask(x.shape[1], layer.window)
                    if c is not None
                    else attention_mask(x.shape[1], 0, layer.window)
                )
            x = layer(x, masks[layer.window], c)
        return self.norm(x)


class CausalLM(nn.Module):
    """Backbone plus LM head (tied to the embedding when the config says so)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        h = self.model(tokens, cache)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self) -> list[Block]:
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop tensors HF checkpoints carry that are not parameters here."""
        drop = ("rotary_emb.inv_freq",)
        out = {k: v for k, v in weights.items() if not k.endswith(drop)}
        if self.config.tie_word_embeddings:
            out = {k: v for k, v in out.items() if not k.startswith("lm_head.")}
        return out
