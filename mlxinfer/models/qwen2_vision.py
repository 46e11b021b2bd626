"""Qwen2-VL's vision tower: Qwen2.5-VL's (`qwen_vision`: the same patches, 2-D rotary positions
and 2x2 merger) before windows, RMSNorm and the gated MLP came in. Every block attends over
each whole frame, its norms are LayerNorms (the merger's too), and its MLP is fc2(QuickGELU(fc1)).

Its config names the tower's width `embed_dim` and the MLP's `mlp_ratio`; its `hidden_size` is
the language model's width, what the merger outputs."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import ConfigError
from . import qwen_vision
from .qwen_vision import GATE_ACTIVATIONS, VisionConfig, VisionTransformer
from .qwen_vision import PatchMerger as RMSPatchMerger


def parse(d: dict[str, Any]) -> VisionConfig:
    """Qwen2-VL's `vision_config` in the shared `VisionConfig`'s terms: every block full attention."""
    if d.get("embed_dim") is None or d.get("depth") is None:
        raise ConfigError("config.json's vision_config has no 'embed_dim' or 'depth'; the checkpoint's config is "
                          "incomplete")
    width = d["embed_dim"]
    return VisionConfig.parse({
        **d, "hidden_size": width, "intermediate_size": int(width * d.get("mlp_ratio", 4)),
        "out_hidden_size": d.get("hidden_size") or width, "hidden_act": d.get("hidden_act", "quick_gelu"),
        "patch_size": d.get("patch_size", d.get("spatial_patch_size", 14)),
        "fullatt_block_indexes": range(d["depth"]),
    })


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = GATE_ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(qwen_vision.VisionBlock):
    norm = nn.LayerNorm
    mlp_class = VisionMLP


class PatchMerger(RMSPatchMerger):
    def __init__(self, cfg: VisionConfig):
        super().__init__(cfg)
        self.ln_q = nn.LayerNorm(cfg.hidden_size, eps=1e-6)


class Qwen2VisionTransformer(VisionTransformer):
    """Qwen2.5-VL's tower with these blocks and merger (every block full attention, so its window
    order is only undone)."""

    block_class = VisionBlock
    merger_class = PatchMerger

    @classmethod
    def of(cls, d: dict[str, Any]) -> Qwen2VisionTransformer:
        return cls(parse(d))
