"""Short causal convolutions: LFM2's token mixer, and the convolution in front of a Gated
DeltaNet (`gated_delta`).

A depthwise convolution of width K over time mixes each channel with its own K-1
predecessors, so all a sequence needs to continue is its last K-1 inputs: that is the
layer's whole state (a `cache.StateCache` holds it). One function computes it for any
number of new tokens, a prompt chunk or one decoded token alike: the K shifted products
summed in the same order, so a token's output does not depend on how the sequence was cut.

Caches are duck-typed here as everywhere in `models/`: `state` (None before the first token),
`update(state, inputs, replay)`, and a batch of sequences as a cache with `rows`.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .layers import Linear


def causal_conv(x: mx.array, weight: mx.array, bias: mx.array | None, state: mx.array | None
                ) -> tuple[mx.array, mx.array]:
    """Depthwise causal convolution of x [B, T, C] with weight [C, K] after `state` [B, K-1, C]
    (the previous inputs; None: zeros, a sequence's start); returns the output [B, T, C] and
    the new state, the last K-1 inputs."""
    B, T, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = mx.zeros((B, K - 1, C), x.dtype)
    full = mx.concatenate([state.astype(x.dtype), x], axis=1)
    y = full[:, :T] * weight[:, 0]
    for j in range(1, K):
        y = y + full[:, j : j + T] * weight[:, j]
    if bias is not None:
        y = y + bias
    return y, full[:, full.shape[1] - (K - 1) :]


def conv_state(state: mx.array | None, inputs: mx.array, kernel: int) -> mx.array | None:
    """The convolution state after `inputs` [B, t, C] followed `state`: the last K-1 inputs."""
    if inputs.shape[1] == 0:
        return state
    if state is None:
        state = mx.zeros((inputs.shape[0], kernel - 1, inputs.shape[2]), inputs.dtype)
    full = mx.concatenate([state.astype(inputs.dtype), inputs], axis=1)
    return full[:, full.shape[1] - (kernel - 1) :]


class DepthwiseConv(nn.Module):
    """The weights of a depthwise convolution as PyTorch's Conv1d stores them ([C, 1, K],
    checkpoint name `<name>.weight`, optional `.bias`)."""

    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))
        if bias:
            self.bias = mx.zeros((channels,))

    @property
    def kernel(self) -> int:
        return self.weight.shape[2]

    def __call__(self, x: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array]:
        return causal_conv(x, self.weight[:, 0, :], self.get("bias"), state)


def row_caches(cache) -> list:
    """The per-sequence caches behind `cache`: its rows for a batch, else itself (or none)."""
    if cache is None:
        return []
    rows = getattr(cache, "rows", None)
    return list(rows) if rows is not None else [cache]


def stacked(caches: Sequence, part: int) -> mx.array | None:
    """Part `part` of each row's state stacked into a batch; None when no row has one yet;
    rows without one (a sequence's start) get zeros."""
    states = [c.state for c in caches]
    have = [s[part] for s in states if s is not None]
    if not have:
        return None
    like = have[0]
    return mx.concatenate([s[part] if s is not None else mx.zeros(like.shape, like.dtype) for s in states])


def split_rows(caches: Sequence, state: tuple[mx.array, ...], inputs: tuple[mx.array, ...], replay) -> None:
    """Hand each row's cache its slice of the new state and of the inputs that led there."""
    if len(caches) == 1:
        caches[0].update(state, inputs, replay)
        return
    for i, c in enumerate(caches):
        c.update(tuple(s[i : i + 1] for s in state), tuple(x[i : i + 1] for x in inputs), replay)


class ShortConv(nn.Module):
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = C * conv(B * x); out_proj(y).
    Its state is the last K-1 values of B * x."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.conv_bias
        channels = cfg.conv_channels or h
        self.in_proj = Linear(h, 3 * channels, bias=bias)
        self.conv = DepthwiseConv(channels, cfg.conv_kernel, bias=bias)
        self.out_proj = Linear(channels, h, bias=bias)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        b, c, v = mx.split(self.in_proj(x), 3, axis=-1)
        bx = b * v
        caches = row_caches(cache)
        state = stacked(caches, 0) if caches else None
        y, new_state = self.conv(bx, state)
        if caches:
            split_rows(caches, (new_state,), (bx,), self.replay)
        return self.out_proj(c * y)

    def replay(self, state: tuple[mx.array, ...] | None, inputs: tuple[mx.array, ...]) -> tuple[mx.array, ...] | None:
        """The state after the logged inputs (`bx` values) followed `state`."""
        new = conv_state(state[0] if state is not None else None, inputs[0], self.conv.kernel)
        return None if new is None else (new,)
