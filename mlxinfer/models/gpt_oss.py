"""gpt-oss-20b / 120b: attention with a learned sink logit per head, sliding-window and full layers
alternating, YaRN, and in every layer a mixture of experts with biases, routed by a softmax
over the top-k router logits only, whose experts apply a clamped SwiGLU. Hub checkpoints
store the experts in MXFP4 (`*_blocks` nibbles, `*_scales` exponents), which MLX runs as
stored (its `mxfp4` quantization mode); transformers saves them as floats, fused and
transposed (`gate_up_proj` [E, hidden, 2I], gate and up columns interleaved)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import FULL, SLIDING, ModelConfig, MoEConfig, _require, parse_config
from .layers import Block as _Block
from .layers import CausalLM, Linear
from .moe import SwitchGLU, combine, top_k

__all__ = ["Model", "config"]

# transformers' GptOssConfig defaults, which hub configs may leave out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "sliding_window": 128,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


@dataclass(frozen=True)
class ClampedSwiGLU:
    """The experts' activation, OpenAI's formula as transformers' GptOssExperts applies it:
    (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). It is
    the whole feed-forward of every layer, so the config's alpha and limit change every
    output (`swiglu_alpha`, `swiglu_limit`; defaults as transformers')."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, self.limit)
        up = mx.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * mx.sigmoid(self.alpha * gate)


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    """ModelConfig plus the experts' activation settings (no other family has them)."""

    swiglu: ClampedSwiGLU = ClampedSwiGLU()


def layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Explicit `layer_types`, else sliding and full alternating, sliding first (transformers' default)."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(d.get("num_hidden_layers", 0)))


def config(d: dict[str, Any]) -> GptOssConfig:
    d = {**DEFAULTS, **d}
    bias = d["attention_bias"]
    moe = MoEConfig(
        _require(d, "num_local_experts"), _require(d, "num_experts_per_tok"), _require(d, "intermediate_size")
    )
    base = parse_config(d, qkv_bias=bias, o_bias=bias, attention_sinks=True, layer_types=layer_types(d), moe=moe)
    swiglu = ClampedSwiGLU(d.get("swiglu_alpha", ClampedSwiGLU.alpha), d.get("swiglu_limit", ClampedSwiGLU.limit))
    return GptOssConfig(**vars(base), swiglu=swiglu)


class MoE(nn.Module):
    """A router with a bias picks the k experts with the largest logits; their weights are
    the softmax over those k logits alone."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        moe = cfg.moe
        self.k = moe.experts_per_token
        self.router = Linear(cfg.hidden_size, moe.num_experts, bias=True)
        self.experts = SwitchGLU(cfg.hidden_size, moe.intermediate_size, moe.num_experts, bias=True, glu=cfg.swiglu)

    def __call__(self, x: mx.array) -> mx.array:
        indices, logits = top_k(self.router(x), self.k)
        weights = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        return combine(self.experts(x, indices), weights)


class Block(_Block):
    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MoE(cfg)


class Model(CausalLM):
    block = Block

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Experts as stacked gate/up/down projections `mlp.experts.<proj>` [E, out, in] (mlx-lm's
        names), from transformers' fused float layout or the hub's MXFP4 blocks and scales."""
        out: dict[str, mx.array] = {}
        for name, value in super().sanitize(weights).items():
            block, _, tensor = name.rpartition(".experts.")
            proj, _, kind = tensor.partition("_proj")
            if proj not in ("gate_up", "down") or kind not in FUSED:  # not fused (mlx-lm's layout), or unknown
                out[name] = value
                continue
            for part, leaf, array in expert_tensors(proj, FUSED[kind], value):
                out[f"{block}.experts.{part}.{leaf}"] = mx.contiguous(array)
        return out


# How transformers and the hub name the fused expert tensors: `<proj>_proj<suffix>`.
FUSED = {"": "float", "_bias": "bias", "_blocks": "blocks", "_scales": "scales"}


def expert_tensors(proj: str, kind: str, value: mx.array) -> list[tuple[str, str, mx.array]]:
    """(projection, leaf, tensor) for one fused expert tensor of a Hugging Face checkpoint.

    Floats are stored for x @ W ([E, in, out]) and become [E, out, in]. MXFP4 blocks
    [E, out, in / 32, 16] hold two E2M1 codes per byte, element 2j in the low nibble of
    byte j: MLX's mxfp4 packing, read as little-endian uint32 words. The scales
    [E, out, in / 32] are E8M0 exponents, as MLX keeps them. Gate and up outputs alternate
    in `gate_up_proj`, gate first."""
    if kind == "float":
        value = value.swapaxes(-1, -2)
    elif kind == "blocks":
        value = value.view(mx.uint32).flatten(-2)
    leaf = {"float": "weight", "blocks": "weight", "scales": "scales", "bias": "bias"}[kind]
    if proj == "down":
        return [("down_proj", leaf, value)]
    if leaf == "bias":
        return [("gate_proj", leaf, value[..., ::2]), ("up_proj", leaf, value[..., 1::2])]
    return [("gate_proj", leaf, value[..., ::2, :]), ("up_proj", leaf, value[..., 1::2, :])]
