"""Qwen2.5-VL's vision tower: a ViT over 14x14 patches (two frames deep: a still image is
repeated), 2-D rotary positions, attention within windows except in `fullatt_block_indexes`,
RMSNorm and a gated MLP, then a merger that joins each 2x2 block of patches into one token of
the language model's width.

The image processor (`Pixels.values`) already orders patches block by block (each merge
block's patches consecutive), so merging is a reshape. Windows are made of whole merge
blocks; attention runs over the patches in window order, each window (or, in the full-attention
blocks, each frame of each image) padded to the longest and masked, so one call covers them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base.errors import ConfigError
from .layers import inv_freq

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: frozenset[int] = frozenset()
    hidden_act: str = "silu"
    theta: float = 10000.0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> VisionConfig:
        """From config.json's `vision_config` (checked by `config.check_config`)."""
        missing = [k for k in ("depth", "hidden_size", "intermediate_size", "num_heads") if d.get(k) is None]
        if missing:
            raise ConfigError(f"config.json's vision_config has no '{missing[0]}'; the checkpoint's config is "
                              "incomplete")
        if d["hidden_size"] % d["num_heads"] or (d["hidden_size"] // d["num_heads"]) % 4:
            raise ConfigError(f"config.json's vision_config hidden_size {d['hidden_size']} must split into "
                              f"{d['num_heads']} heads of a multiple of 4 dimensions (2-D RoPE); fix the file")
        if d.get("hidden_act", "silu") not in GATE_ACTIVATIONS:
            raise ConfigError(f"vision_config hidden_act '{d['hidden_act']}' is not supported; supported: "
                              f"{', '.join(GATE_ACTIVATIONS)}")
        return cls(
            depth=d["depth"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_heads=d["num_heads"], out_hidden_size=d.get("out_hidden_size") or d["hidden_size"],
            in_channels=d.get("in_channels", d.get("in_chans", 3)), patch_size=d.get("patch_size", 14),
            temporal_patch_size=d.get("temporal_patch_size", 2), spatial_merge_size=d.get("spatial_merge_size", 2),
            window_size=d.get("window_size", 112), fullatt_block_indexes=frozenset(d.get("fullatt_block_indexes") or ()),
            hidden_act=d.get("hidden_act", "silu"),
            theta=float((d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Numbers in one flattened patch: channels x frames x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size**2

    @property
    def window_blocks(self) -> int:
        """A window's side, in merge blocks."""
        return max(self.window_size // self.spatial_merge_size // self.patch_size, 1)


GATE_ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx, "quick_gelu": nn.gelu_fast_approx}


def patch_rows_cols(grid: Grid, merge: int) -> np.ndarray:
    """(row, column) of each patch [t*h*w, 2], in the processor's block-by-block order."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blocked = [a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).ravel() for a in (rows, cols)]
    return np.tile(np.stack(blocked, axis=-1), (t, 1))


def window_layout(grids: Sequence[Grid], merge: int, side: int) -> tuple[np.ndarray, list[int]]:
    """The merge blocks of every image in window order (windows of `side` x `side` blocks, row by
    row within each frame; blocks row by row within each window) and each window's block count."""
    order: list[np.ndarray] = []
    lengths: list[int] = []
    first = 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = np.arange(t * rows * cols).reshape(t, rows, cols) + first
        for frame in index:
            for r in range(0, rows, side):
                for c in range(0, cols, side):
                    window = frame[r : r + side, c : c + side].ravel()
                    order.append(window)
                    lengths.append(len(window))
        first += t * rows * cols
    return np.concatenate(order), lengths


@dataclass(frozen=True)
class Segments:
    """Consecutive runs of tokens that attend among themselves, laid out padded: `gather`
    [runs, longest] token indices (padding repeats a run's first token), `keys` [runs, 1, 1,
    longest] which of them are real (None: all are), `scatter` where each token's output lands."""

    gather: mx.array
    keys: mx.array | None
    scatter: mx.array

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Segments:
        longest = max(lengths)
        starts = np.cumsum([0, *lengths[:-1]])
        slots = np.arange(longest)
        real = slots[None] < np.array(lengths)[:, None]
        gather = np.where(real, starts[:, None] + slots[None], starts[:, None])
        scatter = np.flatnonzero(real.ravel())
        keys = None if real.all() else mx.array(real[:, None, None, :])
        return cls(mx.array(gather.astype(np.int32)), keys, mx.array(scatter.astype(np.int32)))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Attention [tokens, heads, dims] -> [tokens, heads * dims] within each run."""
        q, k, v = (a[self.gather].transpose(0, 2, 1, 3) for a in (q, k, v))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=self.keys)
        o = o.transpose(0, 2, 1, 3)
        return o.reshape(-1, o.shape[2] * o.shape[3])[self.scatter]


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE over the two halves of each head, by per-token angles (`cos`, `sin` [tokens, 1, dims/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d, whose kernel is the whole patch: a linear map of the flattened patch."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.patch_values, cfg.hidden_size, bias=False)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.scale = cfg.head_dim**-0.5

    def __call__(self, x: mx.array, rope: tuple[mx.array, mx.array], segments: Segments) -> mx.array:
        q, k, v = mx.split(self.qkv(x).reshape(x.shape[0], 3, self.heads, -1), 3, axis=1)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        q, k = rotate(q, *rope), rotate(k, *rope)
        return self.proj(segments.attend(q, k, v, self.scale))


class VisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)), every projection biased."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = GATE_ACTIVATIONS[cfg.hidden_act]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """A pre-norm ViT block; the towers differ only in its norm and MLP (Qwen2-VL and Qwen3-VL:
    LayerNorm and a plain MLP)."""

    norm: type[nn.Module] = nn.RMSNorm
    mlp_class: type[nn.Module] = VisionMLP

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = self.norm(cfg.hidden_size, eps=1e-6)
        self.norm2 = self.norm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = self.mlp_class(cfg)

    def __call__(self, x: mx.array, rope: tuple[mx.array, mx.array], segments: Segments) -> mx.array:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block's patches, normed and concatenated, through a GELU MLP to the language model's width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.out_hidden_size)]
        self.width = width

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionTransformer(nn.Module):
    """Patches of one or more images [patches, patch values] -> their tokens [tokens, out_hidden_size]."""

    block_class: type[nn.Module] = VisionBlock
    merger_class: type[nn.Module] = PatchMerger

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = [self.block_class(cfg) for _ in range(cfg.depth)]
        self.merger = self.merger_class(cfg)
        # underscored: a constant, not a parameter the checkpoint holds
        self._inv = mx.array(inv_freq(cfg.theta, cfg.head_dim // 2), dtype=mx.float32)

    def rope(self, grids: Sequence[Grid]) -> tuple[mx.array, mx.array]:
        """cos and sin [patches, 1, head_dim/2]: the first half of a head's pairs turn with the
        patch's row, the second with its column."""
        where = mx.array(np.concatenate([patch_rows_cols(g, self.cfg.spatial_merge_size) for g in grids]))
        angles = (where[:, :, None].astype(mx.float32) * self._inv).reshape(where.shape[0], 1, -1)
        return mx.cos(angles), mx.sin(angles)

    @classmethod
    def of(cls, d: dict[str, Any]) -> VisionTransformer:
        """The tower config.json's `vision_config` describes."""
        return cls(VisionConfig.parse(d))

    def features(self, patches: mx.array, grids: Sequence[Grid]) -> tuple[mx.array, list[mx.array]]:
        """The images' tokens, and the features a language model adds to its first layers' hidden
        states at the image tokens (none here; Qwen3-VL's deepstack)."""
        return self(patches, grids), []

    def __call__(self, patches: mx.array, grids: Sequence[Grid]) -> mx.array:
        cfg = self.cfg
        blocks, windows = window_layout(grids, cfg.spatial_merge_size, cfg.window_blocks)
        order = mx.array((blocks[:, None] * cfg.merge_unit + np.arange(cfg.merge_unit)).ravel().astype(np.int32))
        windowed = Segments.of([n * cfg.merge_unit for n in windows])
        frames = Segments.of([h * w for t, h, w in grids for _ in range(t)])
        cos, sin = self.rope(grids)
        rope = (cos[order].astype(patches.dtype), sin[order].astype(patches.dtype))
        x = self.patch_embed(patches)[order]
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames if i in cfg.fullatt_block_indexes else windowed)
        return self.merger(x)[mx.array(np.argsort(blocks).astype(np.int32))]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return flat_patch_kernel(weights, self.cfg.in_channels)


def flat_patch_kernel(weights: dict[str, mx.array], channels: int) -> dict[str, mx.array]:
    """A tower's tensors (named `visual.*`) with the Conv3d patch kernel as the linear map it is:
    PyTorch's [out, C, T, p, p] flattened as the processor flattens a patch (mlx-vlm's
    channels-last copy turned back first)."""
    key = "visual.patch_embed.proj.weight"
    w = weights.get(key)
    if w is None or w.ndim != 5:
        return weights
    if w.shape[1] != channels and w.shape[-1] == channels:
        w = w.transpose(0, 4, 1, 2, 3)
    return {**weights, key: w.reshape(w.shape[0], -1)}
