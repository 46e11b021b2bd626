"""The hybrid families' recurrent layers as llama.cpp's `convert_hf_to_gguf.py` stores them,
and the way back to the tensors our families load.

llama.cpp rearranges these layers for its own kernels; each change is undone exactly:
- Qwen3-Next and Qwen3.5 (Gated DeltaNet): `A_log` is stored as A = -exp(A_log) (`ssm_a`), the
  convolution [C, 1, K] as [C, K]. Qwen3-Next's per-key-head [q, k, v, z] rows come already cut
  into one q/k/v projection and one z, as our family splits them too; its per-key-head [b, a]
  rows (`ssm_ba`) do not, and are cut here. Where value heads outnumber key heads, Qwen3.5's
  value heads are moved from grouped by key head (head k * per + p) to tiled (p * K + k) in
  every tensor that has them: the v rows of the q/k/v projection and of the convolution, z,
  a, b, A, dt_bias, and the columns of out_proj; they are moved back.
- LFM2 (short convolutions): the convolution [C, 1, K] as [C, K].
The gated norm of the linear attention is a plain weight, unlike the other Qwen norms, which
llama.cpp stores as 1 + w (gguf_source's `norm_shift`): a layout's tensors are final."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxinfer.base.errors import CorruptCheckpointError

from .gguf_file import Packed

Tensor = mx.array | Packed
Undo = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Part:
    """One tensor the family loads, made by `undo` from one stored tensor."""

    name: str
    shape: tuple[int, ...]
    undo: Undo


# (Hugging Face name, stored shape, the model's config) -> the tensors the stored one gives back,
# or None where llama.cpp stores it as the family loads it.
Layout = Callable[[str, tuple[int, ...], dict[str, Any]], list[Part] | None]

LINEAR = ".linear_attn."


def take_rows(index: mx.array) -> Undo:
    """Rows (or a vector's entries) in `index` order. Rows are independent in every stored
    layout, so packed weights, scales and biases are taken alike, losslessly."""

    def take(t: Tensor) -> Tensor:
        if isinstance(t, Packed):
            parts = {k: v[index] for k, v in t.tensors().items()}
            return Packed(parts["weight"], parts["scales"], parts.get("biases"), t.spec)
        return t[index]

    return take


def take_column_blocks(order: mx.array, block: int) -> Undo:
    """The columns of a [rows, len(order) * block] weight, block by block in `order`. Packed
    weights whose quantization groups lie inside the blocks move group by group, losslessly;
    others are dequantized first (the conversion quantizes them again)."""

    def take(t: Tensor) -> Tensor:
        if not isinstance(t, Packed):
            return _blocks(t, order)
        if block % t.spec.group_size or block * t.spec.bits % 32:
            return _blocks(t.dequantize(mx.float32), order)
        parts = {k: _blocks(v, order) for k, v in t.tensors().items()}
        return Packed(parts["weight"], parts["scales"], parts.get("biases"), t.spec)

    return take


def _blocks(t: mx.array, order: mx.array) -> mx.array:
    rows, cols = t.shape
    return t.reshape(rows, len(order), cols // len(order))[:, order].reshape(rows, cols)


def grouped_heads(key_heads: int, value_heads: int) -> mx.array:
    """For each value head in Hugging Face's order (grouped by key head: k * per + p), where
    llama.cpp's tiled order (p * key_heads + k) put it."""
    per = value_heads // key_heads
    return mx.array([(h % per) * key_heads + h // per for h in range(value_heads)])


def head_rows(heads: mx.array, size: int) -> mx.array:
    """The row indices of whole heads of `size` rows each, in `heads` order."""
    return (heads[:, None] * size + mx.arange(size)[None]).reshape(-1)


def _floats(t: Tensor) -> mx.array:
    return t.dequantize(mx.float32) if isinstance(t, Packed) else t


def a_log(a: Tensor) -> mx.array:
    """A_log back from llama.cpp's A = -exp(A_log)."""
    a = _floats(a)
    if not mx.all(a < 0).item():
        raise CorruptCheckpointError("a GGUF 'ssm_a' tensor (A = -exp(A_log)) holds values that are not negative; "
                                     "the file is damaged")
    return mx.log(-a)


def pytorch_conv(t: Tensor) -> mx.array:
    """A depthwise convolution [C, K] back to PyTorch's [C, 1, K]."""
    t = _floats(t)
    return t.reshape(t.shape[0], 1, t.shape[1])


def _then(*steps: Undo) -> Undo:
    def undo(t: Tensor) -> Tensor:
        for step in steps:
            t = step(t)
        return t

    return undo


def _as_stored(t: Tensor) -> Tensor:
    return t


def gated_delta_layout(reordered: bool) -> Layout:
    """Qwen3-Next's (`reordered` False) or Qwen3.5's (True) linear-attention tensors."""

    def layout(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> list[Part] | None:
        if LINEAR not in name:
            return None
        prefix, _, leaf = name.partition(LINEAR)
        prefix += LINEAR
        if leaf == "in_proj_ba.weight":
            return _split_ba(prefix, shape, config["linear_num_key_heads"], config["linear_num_value_heads"])
        undo = {**_HEADS_KEPT, **(_heads_back(config) if reordered else {})}
        if leaf == "conv1d.weight":
            return [Part(name, (shape[0], 1, shape[-1]), _then(undo[leaf], pytorch_conv))]
        if leaf == "A_log":
            return [Part(name, shape, _then(undo[leaf], a_log))]
        return [Part(name, shape, undo[leaf])] if leaf in undo else None

    return layout


# The linear attention's tensors whose value heads llama.cpp may reorder, and its gated norm
# (a plain weight, never shifted); as stored where nothing was reordered.
_HEADS_KEPT: dict[str, Undo] = dict.fromkeys(
    ("A_log", "dt_bias", "conv1d.weight", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight",
     "in_proj_b.weight", "out_proj.weight", "norm.weight"),
    _as_stored,
)


def _heads_back(config: dict[str, Any]) -> dict[str, Undo]:
    """Each reordered tensor's value heads back in Hugging Face's order."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    keys, value_dim = key_heads * config["linear_key_head_dim"], config["linear_value_head_dim"]
    heads = grouped_heads(key_heads, value_heads)
    values = head_rows(heads, value_dim)
    qkv = take_rows(mx.concatenate([mx.arange(2 * keys), 2 * keys + values]))  # q and k stay
    return {
        **dict.fromkeys(("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight"), take_rows(heads)),
        "conv1d.weight": qkv,
        "in_proj_qkv.weight": qkv,
        "in_proj_z.weight": take_rows(values),
        "out_proj.weight": take_column_blocks(heads, value_dim),
    }


def _split_ba(prefix: str, shape: tuple[int, ...], key_heads: int, value_heads: int) -> list[Part]:
    """Qwen3-Next's fused [b, a] projection: per key head, the b rows then the a rows of the
    value heads it serves."""
    if len(shape) != 2 or shape[0] != 2 * value_heads:
        raise CorruptCheckpointError(
            f"GGUF tensor for '{prefix}in_proj_ba.weight' has shape {shape}, not 2 x {value_heads} rows as the ssm "
            "metadata says; the file is damaged"
        )
    per = value_heads // key_heads
    b = (mx.arange(key_heads)[:, None] * 2 * per + mx.arange(per)[None]).reshape(-1)
    rows = (value_heads, shape[1])
    return [Part(prefix + "in_proj_b.weight", rows, take_rows(b)),
            Part(prefix + "in_proj_a.weight", rows, take_rows(b + per))]


def short_conv_layout(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> list[Part] | None:
    """LFM2's convolutions back to [C, 1, K]."""
    if name.endswith(".conv.conv.weight"):
        return [Part(name, (shape[0], 1, shape[-1]), pytorch_conv)]
    return None
