"""LFM2 (LiquidAI): gated short convolutions in most layers, grouped-query attention with q/k
RMSNorm in `full_attn_idxs`, a SwiGLU whose width LFM2 derives from `block_ff_dim`, and a
final norm its checkpoints call `embedding_norm`. Checkpoint names are mapped onto ours."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .config import CONV, FULL, ModelConfig, parse_config
from .hybrid import HybridLM

__all__ = ["Model", "canonical", "config"]

RENAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    "model.embedding_norm.": "model.norm.",
}


def feed_forward_size(d: dict[str, Any]) -> int:
    """LFM2's MLP width: `block_ff_dim` (or intermediate_size), by default cut to 2/3, scaled by
    `block_ffn_dim_multiplier` and rounded up to a multiple of `block_multiple_of`."""
    size = d.get("block_ff_dim") or d.get("intermediate_size")
    if not d.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = d.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        size = int(multiplier * size)
        step = d.get("block_multiple_of", 256)
        size = step * ((size + step - 1) // step)
    return size


def layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    layers = d.get("num_hidden_layers", 0)
    full = d.get("full_attn_idxs")
    full = set(range(layers) if full is None else full)
    return tuple(FULL if i in full else CONV for i in range(layers))


def canonical(d: dict[str, Any]) -> dict[str, Any]:
    """The config with the MLP width as it is (`intermediate_size`, no adjusting left to do)."""
    out = {k: v for k, v in d.items() if k != "block_ff_dim"}
    return {**out, "intermediate_size": feed_forward_size(d), "block_auto_adjust_ff_dim": False}


def config(d: dict[str, Any]) -> ModelConfig:
    d = {**canonical(d), "rms_norm_eps": d.get("norm_eps", d.get("rms_norm_eps", 1e-5))}
    d.setdefault("rope_theta", 1_000_000.0)
    d.setdefault("tie_word_embeddings", d.get("tie_embedding", True))
    return parse_config(d, qk_norm=True, conv_kernel=d.get("conv_L_cache", 3), conv_bias=d.get("conv_bias", False),
                        conv_channels=d.get("short_conv_channels") or 0, layer_types=layer_types(d))


def rename(name: str) -> str:
    for old, new in RENAMES.items():
        name = name.replace(old, new)
    return name


class Model(HybridLM):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Our names, and each convolution as PyTorch stores it ([C, 1, K]; mlx-lm's is [C, K, 1])."""
        out = {}
        for name, w in weights.items():
            if name.endswith(".conv.conv.weight") and w.shape[-1] == 1 and w.shape[1] > 1:
                w = w.swapaxes(1, 2)
            out[rename(name)] = w
        return super().sanitize(out)
