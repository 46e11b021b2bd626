"""Shared transformer building blocks; family files compose these.

Module and parameter names follow Hugging Face's (`model.layers.N.self_attn.q_proj`),
so HF and mlx-lm checkpoints load without renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base.errors import ConfigError, NoLMHeadError
from ..kernels import decode_layer
from ..kernels.quantized_matmul import BITS, GROUP_SIZES, quantized_matmul
from .attention import Mask, attention, attention_mask, offsets, position, with_spans
from .config import ModelConfig, RopeConfig
from .lora import LoRALinear
from .pooling import EmbeddingConfig

ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def inv_freq(base: float, dims: int) -> np.ndarray:
    return 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)


def llama3_inv_freq(inv: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend between."""
    factor, low, high = p["factor"], p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    return (1 - smooth) * inv / factor + smooth * inv


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn_inv_freq(inv: np.ndarray, base: float, dims: int, p: dict[str, Any], max_pos: int):
    """YaRN (arXiv 2309.00071): interpolate low frequencies, extrapolate high ones,
    and return the attention factor that rescales cos/sin."""
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

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


def _longrope(inv: np.ndarray, p: dict[str, Any], max_pos: int) -> tuple[np.ndarray, np.ndarray, int, float]:
    """LongRoPE (Phi-3): per-frequency divisors, `short_factor` up to the original context
    and `long_factor` beyond it, and an attention factor sqrt(1 + ln s / ln original)
    for the extension ratio s, applied at every length as transformers does."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original
    attn = p.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (inv / np.asarray(p[k], dtype=np.float64) for k in ("short_factor", "long_factor"))
    return short, long, original, float(attn)


class RoPE:
    """Rotary embedding with the scaling variants real checkpoints use.

    Every variant except `dynamic` and a `longrope` with two different tables is a fixed
    frequency table handed to `mx.fast.rope`; those two depend on the sequence length at
    each call, as in transformers (`dynamic` recomputes its base, `longrope` switches
    tables past the original context), so cached keys keep the rotation they were written with.
    """

    def __init__(self, cfg: ModelConfig, rope: RopeConfig | None = None, traditional: bool = False):
        r = rope or cfg.rope
        self.traditional = traditional  # rotate adjacent pairs (DeepSeek) instead of the two halves
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
        self.long_freqs: mx.array | None = None
        self.original = self.max_pos
        inv = inv_freq(r.theta, self.dims)
        if r.kind == "linear":
            inv = inv / r.params["factor"]
        elif r.kind == "llama3":
            inv = llama3_inv_freq(inv, r.params)
        elif r.kind == "yarn":
            inv, self.attention_factor = _yarn_inv_freq(inv, r.theta, self.dims, r.params, self.max_pos)
        elif r.kind == "longrope":
            inv, long, self.original, self.attention_factor = _longrope(inv, r.params, self.max_pos)
            if not np.array_equal(long, inv):  # equal tables (a GGUF's own frequencies) never switch
                self.long_freqs = mx.array(1.0 / long, dtype=mx.float32)
        self.freqs = None if r.kind in ("default", "dynamic") else mx.array(1.0 / inv, dtype=mx.float32)

    def table(self) -> mx.array | None:
        """The inverse frequencies of every position (for the CPU decode primitives), or None
        where they depend on the length (`dynamic`, a two-table `longrope`) or pairs are adjacent."""
        if self.kind == "dynamic" or self.long_freqs is not None or self.traditional:
            return None
        if not hasattr(self, "_table"):
            self._table = decode_layer.rope_table(None if self.freqs is not None else self.base, self.freqs, self.dims)
        return self._table

    def _base(self, seq_len: int) -> float:
        if self.kind != "dynamic" or seq_len <= self.max_pos:
            return self.base
        factor = self.params["factor"]
        growth = factor * seq_len / self.max_pos - (factor - 1)
        return self.base * growth ** (self.dims / (self.dims - 2))

    def __call__(self, x: mx.array, offset: int | list[int]) -> mx.array:
        """Rotate `x` [B, heads, T, dims] for positions from `offset`, or from `offset[i]`
        for row i (a batch of sequences: one call, identical to rotating each row alone)."""
        if isinstance(offset, list):
            if self.kind == "dynamic" or self.long_freqs is not None:  # the table depends on each row's length
                return mx.concatenate([self(r, o) for r, o in zip(mx.split(x, len(offset)), offset)])
            return self._rotate(x, mx.array(offset), self.freqs, None if self.freqs is not None else self.base)
        seq_len = offset + x.shape[-2]
        freqs = self.long_freqs if self.long_freqs is not None and seq_len > self.original else self.freqs
        return self._rotate(x, offset, freqs, None if freqs is not None else self._base(seq_len))

    def _rotate(self, x: mx.array, offset: int | mx.array, freqs: mx.array | None, base: float | None) -> mx.array:
        y = mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=1.0, offset=offset, freqs=freqs
        )
        if self.attention_factor == 1.0:
            return y
        if self.dims == y.shape[-1]:
            return y * self.attention_factor
        return mx.concatenate([y[..., : self.dims] * self.attention_factor, y[..., self.dims :]], -1)


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product is chosen per device and row count by
    kernels.quantized_matmul (a compiled CPU primitive or dequantize + BLAS off Metal)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self.weight, self.scales, self.get("biases"), self.group_size, self.bits, self.mode)
        return y + self.bias if "bias" in self else y


class Linear(nn.Linear):
    """nn.Linear whose quantized form is the QuantizedLinear above."""

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose use as the (tied) LM head goes through kernels.quantized_matmul,
    and whose lookups give `dtype` where the loader kept the scales in half precision for the head's
    sake (`kernels.quantized_matmul.half_scales_read_exactly`)."""

    dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.dtype is None:
            return super().__call__(x)
        scales, biases = self["scales"][x].astype(self.dtype), self["biases"][x].astype(self.dtype)
        return mx.dequantize(self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(x, self.weight, self.scales, self.get("biases"), self.group_size, self.bits, self.mode)


class Embedding(nn.Embedding):
    """nn.Embedding whose quantized form is the QuantizedEmbedding above."""

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)


class OffsetRMSNorm(nn.RMSNorm):
    """RMSNorm scaling by `offset + weight`: Gemma stores its norm weights as offsets from 1."""

    def __init__(self, dims: int, eps: float, offset: float):
        super().__init__(dims, eps=eps)
        self.offset = offset

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.offset + self.weight, self.eps)


class ProjectionNorm(nn.RMSNorm):
    """An RMSNorm over a whole attention projection, every head at once (OLMo's q/k norms), not
    per head: tensor sharding, which splits the heads among ranks, must sum its squares across them."""


def rms_norm(cfg: ModelConfig, dims: int | None = None) -> nn.Module:
    """The config's RMSNorm over `dims` (default: the hidden size)."""
    dims = dims or cfg.hidden_size
    if cfg.norm_offset:
        return OffsetRMSNorm(dims, cfg.rms_norm_eps, cfg.norm_offset)
    return nn.RMSNorm(dims, eps=cfg.rms_norm_eps)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v/o bias, per-head q/k RMSNorm,
    a per-layer RoPE (or none: the config's `nope_layers`), score soft-capping and attention
    sinks (a learned logit per head that takes its share of every softmax, gpt-oss's `sinks`)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.output_gate = cfg.attn_output_gate
        q_width = self.n_heads * d * (2 if self.output_gate else 1)  # a gate beside each head's query
        if cfg.fused_qkv:
            self.qkv_proj = Linear(h, q_width + 2 * self.n_kv_heads * d, bias=cfg.qkv_bias)
        else:
            self.q_proj = Linear(h, q_width, bias=cfg.qkv_bias)
            self.k_proj = Linear(h, self.n_kv_heads * d, bias=cfg.qkv_bias)
            self.v_proj = Linear(h, self.n_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = rms_norm(cfg, d)
            self.k_norm = rms_norm(cfg, d)
        if cfg.attention_sinks:
            self.sinks = mx.zeros((self.n_heads,))
        self.rope = None if layer in cfg.nope_layers else RoPE(cfg, cfg.rope_of(layer))
        self.scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        self.softcap = cfg.attn_softcap

    def _heads(self, x: mx.array, n: int, norm: nn.Module | None = None) -> mx.array:
        B, T, _ = x.shape
        x = x.reshape(B, T, n, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(0, 2, 1, 3)

    def _qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "qkv_proj" not in self:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_end = self.n_heads * self.head_dim * (2 if self.output_gate else 1)
        q, k, v = mx.split(self.qkv_proj(x), [q_end, q_end + self.n_kv_heads * self.head_dim], axis=-1)
        return q, k, v

    def __call__(self, x: mx.array, mask: Mask, cache=None, positions: mx.array | None = None) -> mx.array:
        """`positions`: each token's own RoPE positions where they are not the cache's (a
        vision-language prompt's M-RoPE axes, taken by its `rope`)."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        gate = None
        if self.output_gate:  # each head's rows: its query, then its gate
            q, gate = mx.split(q.reshape(B, T, self.n_heads, 2 * self.head_dim), 2, axis=-1)
            q, gate = q.reshape(B, T, -1), gate.reshape(B, T, -1)
        q = self._heads(q, self.n_heads, getattr(self, "q_norm", None))
        k = self._heads(k, self.n_kv_heads, getattr(self, "k_norm", None))
        v = self._heads(v, self.n_kv_heads)
        if self.rope is not None:
            offset = offsets(cache) if positions is None else positions
            q, k = self.rope(q, offset), self.rope(k, offset)
        o = attention(q, k, v, cache, mask, self.scale, self.softcap, self.get("sinks"))
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
        return self.o_proj(o if gate is None else o * mx.sigmoid(gate))

    def last_weights(self, x: mx.array, cache, window: int | None) -> np.ndarray:
        """The attention weights [heads, T] of the one position `x` [1, 1, hidden] holds over the
        T up to it: its key and value are stored in `cache` (this layer's, not quantized) and it
        attends over what that keeps, as `__call__` does inside the fused kernel, spelled out so
        they can be shown; positions the cache no longer keeps (outside a sliding window) weigh
        0. A head's row sums to 1, less what its sink takes."""
        q, k, v = self._qkv(x)
        if self.output_gate:  # each head's rows: its query, then its gate
            q = mx.split(q.reshape(1, 1, self.n_heads, 2 * self.head_dim), 2, axis=-1)[0].reshape(1, 1, -1)
        q = self._heads(q, self.n_heads, getattr(self, "q_norm", None))
        k = self._heads(k, self.n_kv_heads, getattr(self, "k_norm", None))
        if self.rope is not None:
            q, k = self.rope(q, offsets(cache)), self.rope(k, offsets(cache))
        at = cache.offset  # the query's position
        k = cache.update_and_fetch(k, self._heads(v, self.n_kv_heads))[0][0]
        kept = cache.positions()  # each stored key's position, in storage order
        group = self.n_heads // self.n_kv_heads
        q = q.astype(mx.float32).reshape(self.n_kv_heads, group, self.head_dim) * self.scale
        scores = (q @ k[0].astype(mx.float32).swapaxes(-1, -2)).reshape(self.n_heads, -1)
        if self.softcap is not None:
            scores = mx.tanh(scores / self.softcap) * self.softcap
        seen = (kept <= at) & ((kept > at - window) if window is not None else True)
        scores = mx.where(mx.array(seen), scores, -mx.inf)
        sinks = self.get("sinks")
        if sinks is None:
            probs = mx.softmax(scores, axis=-1, precise=True)
        else:
            probs = mx.softmax(mx.concatenate([scores, sinks.astype(mx.float32)[:, None]], axis=-1), axis=-1,
                               precise=True)[:, :-1]
        weights = np.zeros((self.n_heads, at + 1), dtype=np.float32)
        weights[:, kept[seen]] = np.array(probs)[:, seen]
        return weights


GATE_ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx}


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)): the feed-forward of every Llama-style model (silu),
    and Gemma's GeGLU (tanh-approximated GELU)."""

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None):
        super().__init__()
        if cfg.hidden_act not in GATE_ACTIVATIONS:
            raise ConfigError(
                f"hidden_act '{cfg.hidden_act}' is not supported for the gated MLP; "
                f"supported: {', '.join(GATE_ACTIVATIONS)}"
            )
        self.act = GATE_ACTIVATIONS[cfg.hidden_act]
        h, i, bias = cfg.hidden_size, intermediate or cfg.intermediate_size, cfg.mlp_bias
        if cfg.fused_gate_up:
            self.gate_up_proj = Linear(h, 2 * i, bias=bias)
        else:
            self.gate_proj = Linear(h, i, bias=bias)
            self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    With `sandwich_norms` (Gemma) the attention and MLP outputs are normed too
    before the residual add; HF then names the attention-output norm
    `post_attention_layernorm` and the pre-MLP one `pre_feedforward_layernorm`.

    MoE families override `feed_forward` (and `ffn_name`, the module's checkpoint
    name, where theirs is not `mlp`).
    """

    ffn_name = "mlp"
    mixer_name = "self_attn"  # the token mixer's checkpoint name
    attends = True  # the mixer is attention (it takes a mask); a recurrent one keeps a state instead

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.window = cfg.window(layer)
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = rms_norm(cfg)
        setattr(self, self.mixer_name, self.attention(cfg, layer))
        self.post_attention_layernorm = rms_norm(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = rms_norm(cfg)
            self.post_feedforward_layernorm = rms_norm(cfg)
        setattr(self, self.ffn_name, self.feed_forward(cfg, layer))

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """The attention module of `layer` (DeepSeek overrides it with latent attention)."""
        return Attention(cfg, layer)

    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """The feed-forward module of `layer`."""
        return SwiGLU(cfg)

    def __call__(self, x: mx.array, mask, cache=None, positions: mx.array | None = None) -> mx.array:
        """`positions`: the tokens' own RoPE positions (`Attention`); such a chunk takes the per-op path."""
        if (positions is None and cache is not None and decode_layer.available(x)
                and (y := self._decode_step(x, mask, cache)) is not None):
            return y
        mixer, h_in = self[self.mixer_name], self.input_layernorm(x)
        h = mixer(h_in, mask, cache) if positions is None else mixer(h_in, mask, cache, positions)
        ffn = self[self.ffn_name]
        if not self.sandwich:
            x = x + h
            return x + ffn(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(x)))

    def _decode_step(self, x: mx.array, mask, cache) -> mx.array | None:
        """A step (decode, or a prompt chunk) by the CPU primitives (`kernels.decode_layer`): two ops
        where the per-op path has ~60. None where they do not apply, and the per-op path runs: a
        recurrent mixer, a row with a mask other than the plain causal one (windows past their
        length) or a quantized cache, a block `_fused_plan` cannot take, float32 projections over
        more rows than `decode_layer.most_rows`, or rows running a DoRA adapter."""
        if not self.attends:  # a recurrent mixer's cache keeps a state, not keys
            return None
        rows = getattr(cache, "rows", None)
        caches, masks = (rows, mask) if rows is not None else ([cache], [mask])
        plain = (lambda m: m is None) if x.shape[1] == 1 else (lambda m: isinstance(m, str) and m == "causal")
        if len(caches) != x.shape[0] or not all(map(plain, masks)) or any(c.bits is not None for c in caches):
            return None
        plan = self._fused_plan()
        if plan is None or (plan.most_rows is not None and x.shape[0] * x.shape[1] > plan.most_rows):
            return None
        adapters = _step_adapters(plan.tables, x.shape[0])
        if adapters is None:
            return None
        q, new = decode_layer.layer_in(x, plan.norms[0], plan.eps, plan.qkv, plan.heads, [position(c) for c in caches],
                                       plan.qk, plan.rope, adapters)
        for c, (k, v) in zip(caches, new):
            c.store(k, v)
        return decode_layer.layer_out(x, q, plan.o, plan.norms[1:], plan.eps, plan.gate_up, plan.down,
                                      [(c.keys[0], c.values[0], c.size) for c in caches], plan.heads, plan.scale,
                                      plan.gelu, adapters)

    def _fused_plan(self) -> FusedPlan | None:
        """This block as the CPU primitives take it, or None where they cannot: MoE or another
        feed-forward, output gates, sinks, soft-capping, a length-dependent RoPE, norms other than
        (offset) RMSNorms, projections other than plain float32 or affine-quantized ones (sharded,
        adapted). Made once and kept while every module and parameter it read is the same object
        under the same name, and no module it read gained or lost one (reloaded weights or a
        wrapped layer make a new one): a step then costs a lookup per name, ~5 µs a block where
        gathering the objects afresh cost ~13 (a thirtieth of a 135M model's step in Python)."""
        kept = self.__dict__.get("_plan")
        if (kept is not None and len(self) == kept.size and all([len(m) == n for m, n in kept.sizes])
                and all([self.get(k) is o for k, o in kept.own]) and all([m.get(k) is o for m, k, o in kept.parts])):
            return kept.plan
        attn, mlp = self[self.mixer_name], self[self.ffn_name]
        own = [(self.mixer_name, attn), (self.ffn_name, mlp), *((n, self[n]) for n in self._norm_names)]
        named = [*((attn, n, attn[n]) for n in ("q_norm", "k_norm", "qkv_proj", "o_proj") if n in attn),
                 *((mlp, n, mlp[n]) for n in ("gate_up_proj", "down_proj") if n in mlp)]
        modules = [attn, mlp, *(m for _, m in own[2:]), *(m for _, _, m in named)]
        named += [(m, "base", m.base) for m in modules if isinstance(m, LoRALinear)]
        modules += [m.base for m in modules if isinstance(m, LoRALinear)]
        parts = named + [(m, k, a) for m in modules[2:] for k, a in m.items()]
        plan = FusedPlan.of(self, attn, mlp)
        self.__dict__["_plan"] = _KeptPlan(len(self), own, [(m, len(m)) for m in modules], parts, plan)
        return plan

    @property
    def _norm_names(self) -> tuple[str, ...]:
        """The block's norms in the order the primitives take them (input first)."""
        if self.sandwich:
            return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")
        return ("input_layernorm", "post_attention_layernorm")


DECODE_ACTIVATIONS = (nn.silu, nn.gelu_approx)


@dataclass
class _KeptPlan:
    """A block's plan and what it was made from, checked by identity before each step: the block's
    own entries (its mixer, feed-forward and norms: it is not held itself, which would make a
    reference cycle and keep a dropped model's arrays until the garbage collector ran), the
    entries of the modules below it, and how many entries each had (one added changes the plan)."""

    size: int
    own: list[tuple[str, Any]]
    sizes: list[tuple[nn.Module, int]]
    parts: list[tuple[nn.Module, str, Any]]
    plan: FusedPlan | None


@dataclass(frozen=True)
class FusedPlan:
    """What the CPU layer primitives need of a block (`Block._fused_plan`)."""

    qkv: decode_layer.Projection
    o: decode_layer.Projection
    gate_up: decode_layer.Projection
    down: decode_layer.Projection
    norms: tuple[mx.array, ...]  # effective weights (Gemma's offset added), in `Block._norm_names` order
    eps: float
    qk: tuple[mx.array, mx.array, float] | None  # per-head q/k norm weights and eps
    rope: tuple[mx.array, float] | None  # inverse frequencies and attention factor
    heads: decode_layer.Heads
    scale: float
    gelu: bool
    tables: tuple  # the LoRA table of each of (qkv, o, gate_up, down) that an adapter wraps, else None
    most_rows: int | None  # the most rows a step may have (`decode_layer.most_rows`), None: any

    @classmethod
    def of(cls, block: Block, attn: nn.Module, mlp: nn.Module) -> FusedPlan | None:
        if (type(attn) is not Attention or type(mlp) is not SwiGLU or attn.output_gate or attn.softcap is not None
                or "sinks" in attn or "qkv_proj" not in attn or "gate_up_proj" not in mlp
                or mlp.act not in DECODE_ACTIVATIONS):
            return None
        norms = [_norm_weight(block[n]) for n in block._norm_names]
        qk = [_norm_weight(attn[n]) for n in ("q_norm", "k_norm") if n in attn]
        layers = [attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]]
        tables = tuple(m.table if isinstance(m, LoRALinear) else None for m in layers)
        projections = [_decode_projection(m.base if isinstance(m, LoRALinear) else m) for m in layers]
        table = attn.rope.table() if attn.rope is not None else None
        eps = {block[n].eps for n in block._norm_names}
        if (any(w is None for w in norms + qk) or None in projections or len(eps) > 1
                or (attn.rope is not None and table is None)):
            return None
        return cls(*projections, norms=tuple(norms), eps=eps.pop(),
                   qk=(qk[0], qk[1], attn["q_norm"].eps) if qk else None,
                   rope=None if table is None else (table, attn.rope.attention_factor),
                   heads=decode_layer.Heads(attn.n_heads, attn.n_kv_heads, attn.head_dim), scale=attn.scale,
                   gelu=mlp.act is nn.gelu_approx, tables=tables, most_rows=decode_layer.most_rows(projections))


def _step_adapters(tables: tuple, rows: int) -> decode_layer.Adapters | None:
    """The LoRA updates this step's rows run (`models.lora`: the slots the forward pass selects),
    as the primitives take them (`_Table.fused_stacks`); None where they cannot (a DoRA gain, a
    non-float32 adapter)."""
    wrapped = [t for t in tables if t is not None]
    if not wrapped or all(t.uniform() is None for t in wrapped):
        return decode_layer.NO_ADAPTERS
    registry = wrapped[0].adapters
    slots = list(registry.rows or (registry.slot(None),) * rows)
    stacks = []
    for t in tables:
        if t is None or not t.updates:
            stacks.append([])
            continue
        fused = t.fused_stacks()
        if fused is None:
            return None
        stacks.append(list(fused))
    return decode_layer.Adapters(slots, tuple(stacks)) if len(slots) == rows else None


def _norm_weight(norm: nn.Module) -> mx.array | None:
    """The weight an RMSNorm multiplies by (Gemma's 1 + w), or None for another kind of norm."""
    if type(norm) not in (nn.RMSNorm, OffsetRMSNorm) or norm["weight"].dtype != mx.float32:
        return None
    return norm["weight"] if type(norm) is nn.RMSNorm else norm.offset + norm["weight"]


def _decode_projection(layer: nn.Module) -> decode_layer.Projection | None:
    """`layer` as the decode primitives take it, or None when they cannot (another kind of layer,
    another dtype or quantization mode)."""
    if type(layer) is Linear and layer["weight"].dtype == mx.float32:
        arrays, bits, group = [layer["weight"]], 0, 0
    elif (type(layer) is QuantizedLinear and layer.mode == "affine" and "biases" in layer and layer.bits in BITS
          and layer.group_size in GROUP_SIZES):
        arrays, bits, group = [layer["weight"], layer["scales"], layer["biases"]], layer.bits, layer.group_size
    else:
        return None
    if "bias" in layer:
        if layer["bias"].dtype != mx.float32:
            return None
        arrays.append(layer["bias"])
    return decode_layer.Projection(arrays, bits, group)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, block: type[Block] = Block):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [block(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = rms_norm(cfg)
        self.embed_scale = cfg.embed_scale

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        return self.norm(self.blocks(self.embed(tokens), cache))

    def embed(self, tokens: mx.array) -> mx.array:
        x = self.embed_tokens(tokens)
        if self.embed_scale != 1.0:
            x = x * mx.array(self.embed_scale, dtype=x.dtype)  # rounded to the embedding dtype, as HF does
        return x

    def blocks(self, x: mx.array, cache=None, positions: mx.array | None = None,
               spans: tuple[tuple[int, int], ...] = ()) -> mx.array:
        """The hidden state through every layer here (with its cache), each window's mask made once;
        `positions`: the tokens' own RoPE positions (a vision-language prompt's), else the caches';
        the tokens of each of `spans` [start, end) attend to each other both ways (`with_spans`:
        an array mask, so the fused CPU layer, which takes only the plain causal one, steps aside)."""
        caches = cache if cache is not None else [None] * len(self.layers)
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, caches):
            if not layer.attends:
                x = layer(x, None, c)
                continue
            if layer.window not in masks:
                mask = c.make_mask(x.shape[1], layer.window) if c is not None else attention_mask(x.shape[1], 0,
                                                                                                  layer.window)
                if spans:  # a prompt's chunk: one sequence, one cache
                    mask = with_spans(mask, x.shape[1], c.offset if c is not None else 0, spans)
                masks[layer.window] = mask
            x = layer(x, masks[layer.window], c) if positions is None else layer(x, masks[layer.window], c, positions)
        return x


NO_HEAD = ("this model has no LM head (its checkpoint is a bare base model, as embedding models are saved): "
           "it can embed text (`mlxinfer embed`, /v1/embeddings) but not generate; use a causal LM checkpoint")


class CausalLM(nn.Module):
    """Backbone plus LM head (tied to the embedding when the config says so).

    A checkpoint saved as a bare base model (an embedding model) loads without its head
    (`drop_head`): it gives hidden states and refuses to give logits. `sentence_embedding` is how
    the checkpoint makes sentence embeddings from those hidden states (set by the loader
    from its sentence-transformers files)."""

    block: type[Block] = Block  # families with their own layers set this
    sentence_embedding: EmbeddingConfig = EmbeddingConfig()
    # Modules (path prefixes) `convert` keeps in float when it quantizes, unless asked: a vision
    # tower is small beside the language model and its features lose more than they save.
    unquantized: tuple[str, ...] = ()
    # A vision-language family's image placeholder token (None: the model takes no images), and
    # the checkpoint's image processor (`images.ImageProcessor`, set by the loader from its files).
    image_token_id: int | None = None
    image_processor: Any = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, self.block)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def hidden_states(self, tokens: mx.array, cache=None) -> mx.array:
        """The final hidden states [B, T, hidden]: after the last layer and the final norm,
        before the LM head (what embeddings pool)."""
        return self.model(tokens, cache)

    def require_head(self) -> None:
        """Refuse (before any work) to generate with a model that has no LM head."""
        if not (self.config.tie_word_embeddings or "lm_head" in self):
            raise NoLMHeadError(NO_HEAD)

    def drop_head(self) -> None:
        del self.lm_head

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        self.require_head()
        return self.logits(self.hidden_states(tokens, cache))

    def logits(self, h: mx.array) -> mx.array:
        """The LM head (soft-capped where the config says) over final hidden states."""
        logits = self.model.embed_tokens.as_linear(h) if self.config.tie_word_embeddings else self.lm_head(h)
        cap = self.config.final_softcap
        return logits if cap is None else mx.tanh(logits / cap) * cap

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


def _fused(parts: list[nn.Module]) -> nn.Module | None:
    """One linear layer whose output rows are those of `parts` in order, or None when
    they cannot be one (different kinds, quantized differently, bias on some only)."""
    with_bias = {"bias" in p for p in parts}
    if len(with_bias) > 1:
        return None
    out = sum(p.weight.shape[0] for p in parts)
    if all(type(p) is Linear for p in parts):
        fused = Linear(parts[0].weight.shape[1], out, bias=False)
    elif all(type(p) is QuantizedLinear for p in parts) and len(
        {(p.group_size, p.bits, p.mode, "biases" in p) for p in parts}
    ) == 1:
        q = parts[0]
        # built lazily at the right size; its random initial weights are replaced unevaluated
        fused = QuantizedLinear(q.scales.shape[1] * q.group_size, out, False, q.group_size, q.bits, q.mode)
        for name in ("scales", "biases"):
            if name in q:
                fused[name] = mx.concatenate([p[name] for p in parts], axis=0)
    else:
        return None
    fused.weight = mx.concatenate([p.weight for p in parts], axis=0)
    if with_bias == {True}:
        fused.bias = mx.concatenate([p.bias for p in parts], axis=0)
    return fused


def _fuse(module: nn.Module, names: tuple[str, ...], fused_name: str) -> None:
    if fused_name in module or not all(n in module for n in names):
        return
    fused = _fused([module[n] for n in names])
    if fused is None:
        return
    for n in names:
        delattr(module, n)
    setattr(module, fused_name, fused)
    mx.eval(fused.parameters())


def fuse_projections(model: nn.Module) -> None:
    """Merge q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (the layout
    Phi-3 ships), after the weights are loaded so checkpoints keep their names.

    Decoding is bound by reading weights and by per-call overhead; the three (two)
    products read the same input, so one matrix each does the same arithmetic per
    output in fewer, larger calls: +10% decode tok/s measured on a 58M float32 Llama
    on CPU, outputs bit-identical (each output is the same dot product either way)."""
    for _, m in model.named_modules():
        if isinstance(m, Attention):
            _fuse(m, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        elif isinstance(m, SwiGLU):
            _fuse(m, ("gate_proj", "up_proj"), "gate_up_proj")
