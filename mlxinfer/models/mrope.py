"""M-RoPE (Qwen2-VL onwards): rotary positions on three axes, time, height and width.

Text tokens have the same position on every axis, so for them M-RoPE is plain RoPE; an
image's tokens take its merged patch grid's (t, h, w) coordinates from where the image
starts, and the text after it resumes one past the largest position so far. Each frequency
pair of a head reads one axis: consecutive sections of `mrope_section` pairs (Qwen2/2.5-VL),
or every third pair in turn (Qwen3-VL's interleaved layout).

A prompt's positions are computed once (`positions`), kept with its embeddings
(`vision.Embedded`) and rotated here; the tokens after the prompt continue at the cache's
offset plus the prompt's `delta`, which is plain RoPE again, so decoding (the CPU fused layer
included) needs nothing of this module.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ..base.errors import ConfigError
from .config import ModelConfig
from .layers import RoPE

# transformers' defaults where a config names none: Qwen2/2.5-VL's, Qwen3-VL's (interleaved)
DEFAULT_SECTIONS = {False: (16, 24, 24), True: (24, 20, 20)}


def frequency_axes(sections: Sequence[int], pairs: int, interleaved: bool) -> np.ndarray:
    """The position axis (0 time, 1 height, 2 width) each of the `pairs` frequency pairs reads."""
    if len(sections) != 3 or sum(sections) != pairs:
        raise ConfigError(f"config.json's mrope_section {list(sections)} must be three counts adding up to the "
                          f"{pairs} frequency pairs of a head; fix rope_scaling / rope_parameters")
    if not interleaved:
        return np.repeat(np.arange(3), sections)
    axes = np.zeros(pairs, dtype=np.int64)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


class MRoPE(RoPE):
    """RoPE that also takes explicit positions [3, T] (a vision-language prompt's); with an
    offset (decoding, text) it is the plain RoPE of the model's frequencies."""

    def __init__(self, cfg: ModelConfig, interleaved: bool = False):
        super().__init__(cfg)
        if self.kind == "dynamic" or self.long_freqs is not None:
            raise ConfigError(f"rope type '{self.kind}' cannot be combined with M-RoPE; fix rope_scaling")
        sections = self.params.get("mrope_section") or DEFAULT_SECTIONS[interleaved]
        self.axes = mx.array(frequency_axes(sections, self.dims // 2, interleaved))
        self.inv = self.table()  # mx.fast.rope's own inverse frequencies, so text positions rotate alike

    def __call__(self, x: mx.array, offset: int | list[int] | mx.array) -> mx.array:
        if not isinstance(offset, mx.array):
            return super().__call__(x, offset)
        angles = offset.astype(mx.float32)[self.axes].T * self.inv  # [T, pairs]: each pair's own axis
        cos = (mx.cos(angles) * self.attention_factor).astype(x.dtype)
        sin = (mx.sin(angles) * self.attention_factor).astype(x.dtype)
        half = self.dims // 2
        x1, x2, rest = x[..., :half], x[..., half : self.dims], x[..., self.dims :]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def positions(length: int, spans: Sequence[tuple[int, tuple[int, int, int]]], merge: int) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions [3, length] and the delta the tokens after it add to their
    index. `spans`: (first token, grid (t, h, w) in patches) of each image, in order; an image of
    grid (t, h, w) takes t * (h/merge) * (w/merge) tokens at (start + i, start + row, start + col)
    and the text after it resumes at start + max(h, w)/merge (transformers' `get_rope_index`)."""
    out = np.zeros((3, length), dtype=np.int64)
    token, position = 0, 0
    for first, (t, h, w) in spans:
        text = first - token
        out[:, token:first] = np.arange(position, position + text)
        position += text
        rows, cols = h // merge, w // merge
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")).reshape(3, -1)
        out[:, first : first + grid.shape[1]] = grid + position
        token = first + grid.shape[1]
        position += max(rows, cols)
    out[:, token:] = np.arange(position, position + length - token)
    delta = int(out.max()) + 1 - length if length else 0
    return out.astype(np.int32), delta
