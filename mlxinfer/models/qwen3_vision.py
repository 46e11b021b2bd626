"""Qwen3-VL's vision tower: as Qwen2.5-VL's (`qwen_vision`), but with biased patch
embedding, a learned square table of position embeddings resampled bilinearly (corners
aligned) to each image's patch grid, LayerNorms, a plain GELU MLP, full attention within each
frame everywhere (no windows), and "deepstack" mergers: after the blocks in
`deepstack_visual_indexes`, a merger of its own turns the hidden states into features that the
language model adds to its first layers' outputs at the image tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base.errors import ConfigError
from . import qwen_vision
from .qwen_vision import GATE_ACTIVATIONS, Grid, Segments, VisionConfig, VisionTransformer, patch_rows_cols

ACTIVATIONS = {**GATE_ACTIVATIONS, "gelu": nn.gelu}


@dataclass(frozen=True)
class Qwen3VisionConfig(VisionConfig):
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Qwen3VisionConfig:
        base = VisionConfig.parse({**d, "hidden_act": "silu"})  # its own activation is checked below
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ConfigError(f"vision_config hidden_act '{act}' is not supported; supported: {', '.join(ACTIVATIONS)}")
        side = int(round(d.get("num_position_embeddings", 2304) ** 0.5))
        if side * side != d.get("num_position_embeddings", 2304):
            raise ConfigError("config.json's vision_config num_position_embeddings must be a square (a grid of "
                              "learned positions); fix the file")
        return cls(**{**base.__dict__, "hidden_act": act,
                      "num_position_embeddings": d.get("num_position_embeddings", 2304),
                      "deepstack_visual_indexes": tuple(d.get("deepstack_visual_indexes") or ())})

    @property
    def position_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))


def bilinear_taps(grid: Grid, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """For each patch (block-by-block order) the 4 cells of the `side` x `side` table and their
    weights that resample it bilinearly to the patch grid, corners aligned."""
    t, h, w = grid
    where = patch_rows_cols((1, h, w), merge).astype(np.float32)

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2), 0, side - 1)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None)
        return taps, weights.astype(np.float32)

    (rt, rw), (ct, cw) = axis(where[:, 0], h), axis(where[:, 1], w)
    cells = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
    weights = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    return np.tile(cells, (t, 1)), np.tile(weights, (t, 1))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.patch_values, cfg.hidden_size)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(qwen_vision.VisionBlock):
    norm = nn.LayerNorm
    mlp_class = VisionMLP


class PatchMerger(nn.Module):
    """A merge block's patches through LayerNorm (per patch, or over the joined block: `joined`)
    and a GELU MLP to the language model's width."""

    def __init__(self, cfg: VisionConfig, joined: bool = False):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.joined = joined
        self.norm = nn.LayerNorm(self.width if joined else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x.reshape(-1, self.width)) if self.joined else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(VisionTransformer):
    """Qwen2.5-VL's tower (its 2-D RoPE, its patch kernel) with these blocks and merger, a biased
    patch embedding, learned positions, no windows, and the deepstack mergers."""

    block_class = VisionBlock
    merger_class = PatchMerger

    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__(cfg)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.deepstack_merger_list = [PatchMerger(cfg, joined=True) for _ in cfg.deepstack_visual_indexes]

    @classmethod
    def of(cls, d: dict[str, Any]) -> Qwen3VisionTransformer:
        return cls(Qwen3VisionConfig.parse(d))

    def positions(self, grids: Sequence[Grid]) -> mx.array:
        """The learned position table resampled to each image's patches [patches, hidden]."""
        taps = [bilinear_taps(g, self.cfg.position_side, self.cfg.spatial_merge_size) for g in grids]
        cells = mx.array(np.concatenate([c for c, _ in taps]).astype(np.int32))
        weights = mx.array(np.concatenate([w for _, w in taps]))
        return (self.pos_embed(cells) * weights[:, :, None]).sum(axis=1)

    def features(self, patches: mx.array, grids: Sequence[Grid]) -> tuple[mx.array, list[mx.array]]:
        cfg = self.cfg
        x = self.patch_embed(patches)
        x = x + self.positions(grids).astype(x.dtype)
        cos, sin = self.rope(grids)
        rope = (cos.astype(x.dtype), sin.astype(x.dtype))
        frames = Segments.of([h * w for t, h, w in grids for _ in range(t)])
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if i in cfg.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deep

    def __call__(self, patches: mx.array, grids: Sequence[Grid]) -> mx.array:
        return self.features(patches, grids)[0]
