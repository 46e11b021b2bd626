"""Qwen3-Next: Gated DeltaNet layers with full attention every `full_attention_interval`-th
layer (gated: a sigmoid gate per head on its output, q/k RMSNorm, partial RoPE), (1 + weight)
RMSNorms, and Qwen's sparse MoE with a shared expert."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .config import LinearAttentionConfig, ModelConfig, _require, parse_config
from .hybrid import HybridLM, interval_layer_types
from .qwen2_moe import moe_config

__all__ = ["Model", "config", "hybrid_config", "mlx_lm_layout"]

# The RMSNorms stored as offsets from 1 in Hugging Face checkpoints (mlx-lm stores 1 + offset).
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def linear_config(d: dict[str, Any]) -> LinearAttentionConfig:
    return LinearAttentionConfig(
        key_heads=_require(d, "linear_num_key_heads"),
        value_heads=_require(d, "linear_num_value_heads"),
        key_dim=_require(d, "linear_key_head_dim"),
        value_dim=_require(d, "linear_value_head_dim"),
        conv_kernel=d.get("linear_conv_kernel_dim", 4),
    )


def hybrid_config(d: dict[str, Any], **family: Any) -> ModelConfig:
    """What Qwen3-Next and Qwen3.5 share: the layer mix, the gated attention, the offset norms."""
    d = {"partial_rotary_factor": 0.25, **d}  # their RoPE turns a quarter of each head
    return parse_config(d, qk_norm=True, attn_output_gate=True, norm_offset=1.0, linear=linear_config(d),
                        layer_types=interval_layer_types(d), **family)


def config(d: dict[str, Any]) -> ModelConfig:
    return hybrid_config(d, moe=moe_config(d) if d.get("num_experts") or d.get("num_local_experts") else None)


def mlx_lm_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face's layout of a checkpoint mlx-lm converted: its convolutions stored
    [C, K, 1] (MLX's Conv1d) instead of [C, 1, K], its norms as 1 + offset."""
    if not any(k.endswith("conv1d.weight") and v.shape[-1] == 1 and v.shape[1] > 1 for k, v in weights.items()):
        return weights
    out = {}
    for k, v in weights.items():
        if k.endswith("conv1d.weight"):
            v = v.swapaxes(1, 2)
        elif k.endswith(OFFSET_NORMS) and v.ndim == 1:
            v = (v.astype(mx.float32) - 1.0).astype(v.dtype)
        out[k] = v
    return out


def _groups(w: mx.array, sizes: list[int]) -> list[mx.array]:
    """Rows of `w` laid out as blocks of `sizes` rows each (one per key head), gathered part by part."""
    blocks = w.reshape(w.shape[0] // sum(sizes), sum(sizes), *w.shape[1:])
    cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    return [p.reshape(-1, *w.shape[1:]) for p in mx.split(blocks, cuts, axis=1)]


class Model(HybridLM):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Split the fused projections, whose rows run key head by key head ([q, k, v, z] and
        [b, a] of the value heads it serves), into Qwen3.5's separate ones."""
        lin = self.config.linear
        per = lin.value_heads // lin.key_heads
        out = {}
        for name, w in mlx_lm_layout(weights).items():
            prefix, fused, leaf = name.rpartition(".in_proj_qkvz.")
            if fused:
                q, k, v, z = _groups(w, [lin.key_dim, lin.key_dim, per * lin.value_dim,
                                                        per * lin.value_dim])
                out[f"{prefix}.in_proj_qkv.{leaf}"] = mx.concatenate([q, k, v])
                out[f"{prefix}.in_proj_z.{leaf}"] = z
                continue
            prefix, fused, leaf = name.rpartition(".in_proj_ba.")
            if fused:
                b, a = _groups(w, [per, per])
                out[f"{prefix}.in_proj_b.{leaf}"], out[f"{prefix}.in_proj_a.{leaf}"] = b, a
                continue
            out[name] = w
        return super().sanitize(out)
