"""Qwen3-VL (model_type "qwen3_vl"): the Qwen3 language model with interleaved M-RoPE, the
vision tower of `qwen3_vision`, and its deepstack features added to the first layers' outputs
at the image tokens; otherwise as `qwen2_5_vl` (placeholders, positions, the delta)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from . import qwen2_5_vl, qwen3
from .attention import attention_mask
from .config import ModelConfig
from .layers import Block as TextBlock
from .mrope import MRoPE
from .qwen3_vision import Qwen3VisionTransformer
from .vision import Embedded, Pixels

__all__ = ["Model", "canonical", "config"]

canonical = qwen2_5_vl.canonical


def config(d: dict[str, Any]) -> ModelConfig:
    return qwen3.config(canonical(d))


class Block(TextBlock):
    def attention(self, cfg: ModelConfig, layer: int):
        attn = super().attention(cfg, layer)
        attn.rope = MRoPE(cfg, interleaved=True)
        return attn


@dataclass(frozen=True)
class DeepstackEmbedded(Embedded):
    """An `Embedded` with the vision tower's deepstack features: `deepstack[i]` [T, hidden] is added
    to layer i's output (zero outside the images)."""

    deepstack: tuple[mx.array, ...] = ()

    def slice(self, start: int, end: int) -> DeepstackEmbedded:
        part = super().slice(start, end)
        return DeepstackEmbedded(part.embeds, part.positions, part.position_delta, part.bidirectional,
                                 tuple(f[start:end] for f in self.deepstack))


class Model(qwen2_5_vl.Model):
    block = Block
    vision_class = Qwen3VisionTransformer

    def __call__(self, tokens: mx.array, cache=None, embedded: Embedded | None = None) -> mx.array:
        deep = getattr(embedded, "deepstack", ())
        if not deep:
            return super().__call__(tokens, cache, embedded)
        self.require_head()
        caches = cache if cache is not None else [None] * len(self.layers)
        x = embedded.embeds[None]
        masks: dict[int | None, Any] = {}
        for i, (layer, c) in enumerate(zip(self.layers, caches)):
            if c is not None:
                c.position_delta = embedded.position_delta
            if layer.window not in masks:
                masks[layer.window] = (c.make_mask(x.shape[1], layer.window) if c is not None
                                       else attention_mask(x.shape[1], 0, layer.window))
            x = layer(x, masks[layer.window], c, embedded.positions)
            if i < len(deep):
                x = x + deep[i][None]
        return self.logits(self.model.norm(x))

    def embedded(self, tokens: Sequence[int], images: Sequence[Pixels], start: int = 0) -> Embedded:
        x, where, delta, deep = self.prompt_inputs(tokens, images, start)
        return DeepstackEmbedded(x, where, delta, (), tuple(deep))
