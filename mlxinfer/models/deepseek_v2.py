"""DeepSeek-V2 / V2-Lite / V2.5: latent attention (mla.py), and from layer
`first_k_dense_replace` on a mixture of experts with always-on shared experts,
routed by softmax with optional group-limited top-k."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx import nn

from ..base.errors import ConfigError
from .config import ModelConfig, parse_config
from .layers import Block as _Block
from .layers import CausalLM, SwiGLU
from .mla import MLAttention
from .moe import SwitchGLU, combine, stack_experts, top_k

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    """Every head has its own keys, so kv heads = heads; `head_dim` is the rotary
    part's width, which is what RoPE (and its YaRN table) spans."""
    heads = d.get("num_attention_heads")
    return parse_config(
        d, num_key_value_heads=heads, head_dim=d.get("qk_rope_head_dim", 64), mlp_bias=d.get("mlp_bias", False)
    )


@dataclass(frozen=True)
class Routing:
    experts: int
    k: int
    method: str
    n_group: int
    topk_group: int
    normalize: bool
    scale: float
    intermediate: int
    shared: int
    first_dense: int
    every: int

    @classmethod
    def parse(cls, d: dict[str, Any], methods: tuple[str, ...]) -> Routing:
        method = d.get("topk_method") or methods[0]
        if method not in methods:
            raise ConfigError(f"topk_method '{method}' is not supported for {d.get('model_type')}; expected {methods}")
        return cls(
            experts=d.get("n_routed_experts") or 0,
            k=d.get("num_experts_per_tok") or 0,
            method=method,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            normalize=bool(d.get("norm_topk_prob")),
            scale=d.get("routed_scaling_factor", 1.0),
            intermediate=d.get("moe_intermediate_size", 0),
            shared=d.get("n_shared_experts") or 0,
            first_dense=d.get("first_k_dense_replace", 0),
            every=d.get("moe_layer_freq", 1),
        )

    def __post_init__(self) -> None:
        if self.experts and (self.k > self.experts or self.experts % self.n_group):
            raise ConfigError(
                f"config.json's routing is impossible: {self.k} experts per token from {self.experts} "
                f"in {self.n_group} groups; fix num_experts_per_tok / n_routed_experts / n_group"
            )

    def is_moe(self, layer: int) -> bool:
        return bool(self.experts) and layer >= self.first_dense and layer % self.every == 0


def keep_top_groups(scores: mx.array, r: Routing, group_score: mx.array, fill: float) -> mx.array:
    """`scores` with every expert outside the `topk_group` best groups set to `fill`."""
    if r.n_group <= 1 or r.topk_group >= r.n_group:
        return scores
    grouped = scores.reshape(*scores.shape[:-1], r.n_group, -1)
    drop = mx.argpartition(group_score, kth=r.n_group - r.topk_group - 1, axis=-1)[..., : r.n_group - r.topk_group]
    grouped = mx.put_along_axis(grouped, mx.expand_dims(drop, -1), mx.array(fill, scores.dtype), axis=-2)
    return grouped.reshape(scores.shape)


class Router(nn.Module):
    """Softmax over all experts; `group_limited_greedy` first keeps the groups with
    the highest single expert probability. Weights are the chosen probabilities
    (renormalised with `norm_topk_prob`) times `routed_scaling_factor`."""

    methods = ("greedy", "group_limited_greedy")

    def __init__(self, cfg: ModelConfig, r: Routing):
        super().__init__()
        self.routing = r
        self.weight = mx.zeros((r.experts, cfg.hidden_size))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        probs = mx.softmax(logits, axis=-1, precise=True)
        r = self.routing
        choice = probs
        if r.method == "group_limited_greedy":
            choice = keep_top_groups(probs, r, probs.reshape(*probs.shape[:-1], r.n_group, -1).max(-1), 0.0)
        return self.weigh(probs, top_k(choice, r.k)[0])

    def weigh(self, scores: mx.array, indices: mx.array) -> tuple[mx.array, mx.array]:
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if self.routing.normalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return indices, weights * self.routing.scale


class MoE(nn.Module):
    """Routed experts (stacked, mlx-lm's `switch_mlp`) plus shared experts every token uses."""

    router = Router

    def __init__(self, cfg: ModelConfig, r: Routing):
        super().__init__()
        self.gate = self.router(cfg, r)
        self.switch_mlp = SwitchGLU(cfg.hidden_size, r.intermediate, r.experts)
        if r.shared:
            self.shared_experts = SwiGLU(replace(cfg, intermediate_size=r.intermediate * r.shared))

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.gate(x)
        y = combine(self.switch_mlp(x, indices), weights)
        return y + self.shared_experts(x) if "shared_experts" in self else y


class Block(_Block):
    attention_class = MLAttention
    moe_class = MoE

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return self.attention_class(cfg)

    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        r = Routing.parse(cfg.raw, self.moe_class.router.methods)
        return self.moe_class(cfg, r) if r.is_moe(layer) else SwiGLU(cfg)


class Model(CausalLM):
    block = Block

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Per-expert HF tensors stacked into `switch_mlp`, as mlx-lm stores them."""
        return stack_experts(super().sanitize(weights), self.config.raw.get("n_routed_experts") or 0)
