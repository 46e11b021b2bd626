"""Tensor parallelism across processes (or Macs) with MLX's distributed layer.

Each rank holds 1/N of every attention and feed-forward block: the query, key and value
projections and the gate/up projections are split by output rows (whole heads, whole
expert columns), the output and down projections by input columns, so a block half
computes a partial sum on every rank and one `all_sum` completes it. The KV cache is
split with the heads. A model with fewer KV heads than ranks (multi-query Gemma 3 1B,
Qwen2.5-0.5B's 2) copies each KV head to the ranks whose query heads read it, as vLLM
does: the ranks must be a multiple of the KV heads, and each rank's K/V projections and
cache hold that one head. The embedding and LM head are split by vocabulary rows (a lookup
is one `all_sum`, the logits one `all_gather`); norms and MoE routers stay whole, except
OLMo's q/k norms, which span every head of a projection: they split with the heads, and sum
their squares across the ranks (one small `all_sum` each). Attention sinks (gpt-oss's logit
per head) go with their heads.
Latent attention (DeepSeek MLA) splits its heads the same way (rows of q_b_proj and
kv_b_proj, or the per-head embed_q / unembed_out); its cache, one compressed latent and
one rotary key per token that every head reads, is whole on every rank (it is already
small: kv_lora_rank + rope dims per token and layer).

Recurrent layers split the same way. A Gated DeltaNet's key and value heads divide among the
ranks (each rank the key heads and the value heads they serve: its rows of in_proj_qkv, and of
the convolution's channels in front of it, in_proj_z/b/a, dt_bias and A_log), out_proj by input
columns; each rank's state holds its heads only. A short convolution (LFM2) splits its channels:
its thirds of in_proj's rows, its conv channels, out_proj's columns.

Loading reads each tensor lazily from the safetensors files and keeps only this rank's
slice (one full tensor in memory at a time, never the whole model). Quantized tensors
split along whole quantization groups.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import ConfigError
from . import canonical_config

COLUMN = re.compile(r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|in_proj_z|in_proj_b|in_proj_a)\."
                    r"(weight|scales|biases|bias)$")
PER_HEAD = re.compile(r"\.linear_attn\.(dt_bias|A_log)$")  # one value per linear-attention value head
QKV = re.compile(r"\.linear_attn\.(in_proj_qkv|conv1d)\.(weight|scales|biases)$")  # rows [q | k | v]
THIRDS = re.compile(r"\.conv\.in_proj\.(weight|scales|biases|bias)$")  # LFM2's rows [B | C | x]
CHANNELS = re.compile(r"\.conv\.conv\.(weight|bias)$")
KV = re.compile(r"\.(k_proj|v_proj)\.(weight|scales|biases|bias)$")  # rows by KV head, copied when fewer than ranks
HEADS = re.compile(r"\.(embed_q|unembed_out)\.(weight|scales|biases)$|\.sinks$")  # [heads, ...], gpt-oss's [heads]
QK_NORM = re.compile(r"\.(q_norm|k_norm)\.weight$")  # per head (whole) or over the projection (split with it)
VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.(weight|scales|biases)$")
ROW = re.compile(r"\.(o_proj|down_proj|out_proj)\.(weight|scales|biases|bias)$")
# in a rank's config: on how many ranks each KV head is (1: split; size / KV heads: replicated)
REPLICAS = "kv_head_replicas"
SPLIT_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
               "linear_num_key_heads", "linear_num_value_heads")
CONV_CHANNELS = "short_conv_channels"  # in a rank's config: its channels of each short convolution


@dataclass(frozen=True)
class Shard:
    """Where this process sits: rank `rank` of `size`, in `group`."""

    rank: int
    size: int
    group: Any

    @classmethod
    def of(cls, group) -> Shard:
        return cls(group.rank(), group.size(), group)


def launched() -> bool:
    """Started by `mlx.launch` (or mpirun) as one rank of several."""
    return any(os.environ.get(k) for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def rank_zero() -> bool:
    """Whether this process is rank 0, which owns the terminal and the address: alone, or the
    first of the ranks `mlx.launch` started (the others print nothing and listen nowhere)."""
    return not launched() or world() is None or world().rank() == 0


def lost_peer(error: BaseException) -> bool:
    """An error of MLX's distributed backends that means another rank is gone."""
    return isinstance(error, RuntimeError) and str(error).startswith(("[ring]", "[mpi]", "[jaccl]", "[nccl]"))


def world() -> Any | None:
    """The distributed group this process was started in (`mlx.launch`), or None when alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def _divisors(n: int, most: int = 16) -> str:
    return ", ".join(str(d) for d in range(1, most + 1) if n % d == 0)


def _kv_heads(config: dict[str, Any]) -> int:
    heads = config["num_attention_heads"]
    latent = bool(config.get("kv_lora_rank"))  # DeepSeek MLA: every head has its own keys
    return heads if latent else config.get("num_key_value_heads") or heads


def _short_conv(config: dict[str, Any]) -> bool:
    """Whether the model has short-convolution layers (LFM2), whose channels split."""
    return "conv" in (config.get("layer_types") or ()) or bool(config.get("conv_L_cache"))


def _fits(config: dict[str, Any], size: int) -> bool:
    """Whether `size` ranks can split the model: query heads divide, KV heads divide or
    are replicated whole (ranks a multiple of them), feed-forward widths, linear-attention
    heads and short-convolution channels divide."""
    heads, kv = config["num_attention_heads"], _kv_heads(config)
    return (heads % size == 0 and (kv % size == 0 or size % kv == 0)
            and all(config[key] % size == 0 for key in SPLIT_SIZES if config.get(key))
            and not (_short_conv(config) and config["hidden_size"] % size))


def _working(config: dict[str, Any], most: int = 16) -> str:
    return ", ".join(str(n) for n in range(1, most + 1) if _fits(config, n))


def shard_config(config: dict[str, Any], size: int) -> dict[str, Any]:
    """The config one rank's model is built from: 1/size of the heads and feed-forward
    widths, head_dim made explicit. With fewer KV heads than ranks each rank keeps one
    (`REPLICAS` records on how many ranks each is). Sizes that do not divide are
    refused, naming the rank counts that work."""
    config = canonical_config(config)
    heads, kv = config["num_attention_heads"], _kv_heads(config)
    out = dict(config, head_dim=config.get("head_dim") or config["hidden_size"] // heads)
    if heads % size:
        raise ConfigError(f"tensor sharding needs the model's {heads} attention heads to divide among {size} ranks; "
                          f"use {_working(config)} ranks")
    if kv % size and size % kv:
        raise ConfigError(f"tensor sharding needs the model's {kv} KV heads to divide among {size} ranks, or "
                          f"{size} ranks to be a multiple of them (each KV head copied to several); "
                          f"use {_working(config)} ranks")
    out["num_attention_heads"], out["num_key_value_heads"] = heads // size, max(kv // size, 1)
    out[REPLICAS] = max(size // kv, 1)
    for key in SPLIT_SIZES:
        if config.get(key):
            if config[key] % size:
                raise ConfigError(f"tensor sharding needs {key} {config[key]} to divide among {size} ranks; "
                                  f"use {_working(config)} ranks")
            out[key] = config[key] // size
    if _short_conv(config):
        if config["hidden_size"] % size:
            raise ConfigError(f"tensor sharding needs the {config['hidden_size']} short-convolution channels to "
                              f"divide among {size} ranks; use {_working(config)} ranks")
        out[CONV_CHANNELS] = config["hidden_size"] // size
    return out


def _rows(x: mx.array, axis: int, start: int, stop: int) -> mx.array:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _part(x: mx.array, axis: int, shard: Shard) -> mx.array:
    n = x.shape[axis] // shard.size
    return _rows(x, axis, shard.rank * n, (shard.rank + 1) * n)


def _kv_part(x: mx.array, axis: int, shard: Shard, config: dict[str, Any]) -> mx.array:
    """This rank's KV heads of a K/V projection: its 1/size of them, or the one head its
    query heads read, copied whole (a quantized head's rows keep all their groups)."""
    here, rows = config["num_key_value_heads"], config["head_dim"]
    first = shard.rank // config[REPLICAS] * here
    return _rows(x, axis, first * rows, (first + here) * rows)


def _qkv_part(x: mx.array, shard: Shard, config: dict[str, Any]) -> mx.array:
    """This rank's rows of a Gated DeltaNet's [q | k | v] rows (its projection, its convolution
    channels): the q and k rows of its key heads, the v rows of the value heads they serve."""
    keys = config["linear_num_key_heads"] * config["linear_key_head_dim"] * shard.size
    q, k, v = mx.split(x, [keys, 2 * keys], axis=0)
    return mx.concatenate([_part(q, 0, shard), _part(k, 0, shard), _part(v, 0, shard)])


def shard_weights(weights: dict[str, mx.array], shard: Shard, config: dict[str, Any]) -> dict[str, mx.array]:
    """This rank's slice of every tensor (lazily: nothing is read until evaluated), for
    the rank's config from `shard_config`."""
    group_size = (config.get("quantization") or {}).get("group_size", 64)
    out = {}
    for name, w in weights.items():
        if QKV.search(name):
            out[name] = _qkv_part(w, shard, config)
        elif THIRDS.search(name):
            axis = w.ndim - 1 if name.endswith(".bias") else 0
            out[name] = mx.concatenate([_part(third, axis, shard) for third in mx.split(w, 3, axis=axis)], axis=axis)
        elif CHANNELS.search(name) or PER_HEAD.search(name):
            out[name] = _part(w, 0, shard)
        elif VOCAB.search(name):
            out[name] = _part(w, 0, shard) if w.shape[0] % shard.size == 0 else w
        elif HEADS.search(name):
            out[name] = _part(w, 0, shard)
        elif KV.search(name):
            out[name] = _kv_part(w, w.ndim - 1 if name.endswith(".bias") else w.ndim - 2, shard, config)
        elif (norm := QK_NORM.search(name)) and w.shape[-1] > config["head_dim"]:  # OLMo's, over every head
            out[name] = _part(w, 0, shard) if norm[1] == "q_norm" else _kv_part(w, 0, shard, config)
        elif COLUMN.search(name):
            # rows are outputs: the last axis but one of a matrix (or a stack of expert matrices); a bias's last
            out[name] = _part(w, w.ndim - 1 if name.endswith(".bias") else w.ndim - 2, shard)
        elif ROW.search(name):
            if name.endswith(".bias"):  # added once, after the sum: rank 0 keeps it
                out[name] = w if shard.rank == 0 else mx.zeros_like(w)
                continue
            if name.endswith((".scales", ".biases")) and (w.shape[-1] % shard.size):
                raise ConfigError(f"tensor sharding splits {name} along whole quantization groups of {group_size}: "
                                  f"its {w.shape[-1]} groups do not divide among {shard.size} ranks; use "
                                  f"{_divisors(w.shape[-1])} ranks")
            out[name] = _part(w, w.ndim - 1, shard)
        else:
            out[name] = w
    return out


def materialize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Evaluate the slices one tensor at a time, each copied out of its file's tensor,
    so at most one whole tensor is in memory besides this rank's part of the model."""
    out = {}
    for name, w in weights.items():
        part = w + mx.zeros((), w.dtype) if w.dtype != mx.bool_ else w  # a copy: the whole tensor is let go
        mx.eval(part)
        out[name] = part
    return out


class AllSum(nn.Module):
    """A block half whose rank-local partial output is completed by one all_sum."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, *args, **kwargs) -> mx.array:
        return mx.distributed.all_sum(self.inner(*args, **kwargs), group=self._group)


class SplitNorm(nn.Module):
    """A ProjectionNorm whose heads are spread over the ranks: each rank's sum of squares, summed
    over all ranks, gives the mean square over the whole projection (a KV head copied to r ranks
    counts r times, as does its share of the width, so the mean is the same)."""

    def __init__(self, inner: nn.RMSNorm, shard: Shard):
        super().__init__()
        self.inner = inner
        self._group, self._width = shard.group, inner.weight.shape[0] * shard.size

    def __call__(self, x: mx.array) -> mx.array:
        squares = mx.distributed.all_sum(mx.square(x.astype(mx.float32)).sum(-1, keepdims=True), group=self._group)
        normed = x.astype(mx.float32) * mx.rsqrt(squares / self._width + self.inner.eps)
        return self.inner.weight * normed.astype(x.dtype)


def gather_vocab(x: mx.array, group) -> mx.array:
    """Logits [..., V/N] of every rank joined into [..., V] (all_gather joins the first axis)."""
    return mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(x, -1, 0), group=group), 0, -1)


class VocabEmbedding(nn.Module):
    """This rank's rows of the embedding: ids outside them look up zeros, and the sum
    over ranks is the full lookup. Used as the tied LM head, it gathers the logits."""

    def __init__(self, inner: nn.Module, shard: Shard):
        super().__init__()
        self.inner = inner
        self._group, self._rows = shard.group, inner.weight.shape[0]
        self._start = shard.rank * self._rows

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self._start
        inside = (local >= 0) & (local < self._rows)
        x = self.inner(mx.where(inside, local, 0))
        return mx.distributed.all_sum(x * inside[..., None].astype(x.dtype), group=self._group)

    def as_linear(self, h: mx.array) -> mx.array:
        return gather_vocab(self.inner.as_linear(h), self._group)


class VocabHead(nn.Module):
    """This rank's rows of an untied LM head; the logits of all ranks are gathered."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, h: mx.array) -> mx.array:
        return gather_vocab(self.inner(h), self._group)


def vocab_split(model, shard: Shard) -> bool:
    """Whether the vocabulary divides among the ranks (else embedding and head stay whole)."""
    return model.config.vocab_size % shard.size == 0


def shrink_vocab(model, shard: Shard) -> None:
    """Before loading: an embedding (and untied head) of this rank's vocabulary rows."""
    from .layers import Embedding, Linear

    if not vocab_split(model, shard):
        return
    rows, h = model.config.vocab_size // shard.size, model.config.hidden_size
    model.model.embed_tokens = Embedding(rows, h)
    if "lm_head" in model:
        model.lm_head = Linear(h, rows, bias=False)


def wrap_reductions(model, shard: Shard) -> None:
    """After loading: every block's attention and feed-forward complete their partial
    sums across ranks, norms over a whole projection sum their squares across them, and the
    embedding and head join their vocabulary slices."""
    from .layers import ProjectionNorm

    for block in model.layers:
        mixer = block[block.mixer_name]
        for name, norm in mixer.children().items():
            if isinstance(norm, ProjectionNorm):
                mixer[name] = SplitNorm(norm, shard)
        setattr(block, block.mixer_name, AllSum(mixer, shard.group))
        setattr(block, block.ffn_name, AllSum(block[block.ffn_name], shard.group))
    if vocab_split(model, shard):
        model.model.embed_tokens = VocabEmbedding(model.model.embed_tokens, shard)
        if "lm_head" in model:
            model.lm_head = VocabHead(model.lm_head, shard.group)


def fingerprint(path: Path, files: list[Path]) -> int:
    """A 63-bit digest of the checkpoint's config and tensor headers (names, shapes, dtypes)
    and file sizes: equal on every rank exactly when they load the same model."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in files:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(n, 100 << 20)))
        digest.update(str(file.stat().st_size).encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def check_same_model(path: Path, files: list[Path], shard: Shard) -> None:
    """Refuse to run when the ranks hold different model files."""
    mine = fingerprint(path, files)
    every = mx.distributed.all_gather(mx.array([mine >> 32, mine & 0xFFFFFFFF], mx.uint32)[None],
                                      group=shard.group)
    mx.eval(every)
    values = {tuple(row) for row in every.tolist()}
    if len(values) != 1:
        raise ConfigError(f"the ranks load different model files ({len(values)} different fingerprints of "
                          f"{path.name}); give every machine the same checkpoint")


def resident_bytes(model) -> int:
    """Bytes of this rank's parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def bytes_per_token(config, shard: Shard, dtype_bytes: int) -> int:
    """Bytes one rank sends per decoded token: an all_sum of the hidden state after every
    block half and after the embedding lookup (a ring all-reduce sends 2(N-1)/N of the
    vector), and its share of the logits all_gather ((N-1)/N of the vocabulary)."""
    n = shard.size
    sums = 2 * config.num_hidden_layers + 1
    reduce = sums * config.hidden_size * dtype_bytes * 2 * (n - 1) / n
    gather = config.vocab_size * 4 * (n - 1) / n
    return int(reduce + gather)


def sent_per_token(model) -> int:
    """Bytes this rank sends per decoded token (see `bytes_per_token`; in a pipeline, the
    hidden state handed on and the last rank's output gathered to all)."""
    place = model.shard
    dtype_bytes = model.model.norm.weight.dtype.size
    if isinstance(model.model, Stage):
        return model.config.hidden_size * dtype_bytes * place.size
    return bytes_per_token(model.config, place, dtype_bytes)


def summary(model) -> str | None:
    """One line on how the model is split, for stats output (None when it is whole)."""
    place = getattr(model, "shard", None)
    if place is None:
        return None
    here, sent = resident_bytes(model) / 2**20, sent_per_token(model) / 1024
    if isinstance(model.model, Stage):
        return (f"pipeline: rank {place.rank} of {place.size}, {len(model.layers)} of "
                f"{model.config.num_hidden_layers} layers, {here:.1f} MiB of weights here, {sent:.1f} KiB sent per token")
    return f"tensor-sharded: rank {place.rank} of {place.size}, {here:.1f} MiB of weights here, {sent:.1f} KiB sent per token"


def layout(model) -> dict[str, Any] | None:
    """How the model is split across the ranks, every rank's weight bytes and layers gathered
    (a collective: every rank calls it), for `inspect`. None when the model is whole."""
    place = getattr(model, "shard", None)
    if place is None:
        return None
    mine = mx.array([[resident_bytes(model), len(model.layers)]], mx.int64)
    every = mx.distributed.all_gather(mine, group=place.group).tolist()
    pipeline = isinstance(model.model, Stage)
    return {"mode": "pipeline" if pipeline else "tensor", "ranks": place.size, "rank": place.rank,
            "weight_bytes": [b for b, _ in every], "layers": [n for _, n in every],
            "heads_here": None if pipeline else model.config.num_attention_heads,
            "kv_heads": None if pipeline else _kv_layout(model.config.raw, place.size),
            "sent_per_token": sent_per_token(model)}


def _kv_layout(config: dict[str, Any], size: int) -> dict[str, int] | None:
    """The model's KV heads, how many each rank holds (with its cache) and on how many
    ranks each is, from a rank's config (`shard_config`); None for latent attention,
    whose one latent cache is whole on every rank."""
    if config.get("kv_lora_rank"):
        return None
    here, replicas = config["num_key_value_heads"], config[REPLICAS]
    return {"total": here * size // replicas, "here": here, "replicas": replicas}


# --- pipeline parallelism ---

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_ranges(layer_bytes: list[int], size: int) -> list[range]:
    """Contiguous runs of layers, one per rank, with about equal bytes each (every rank gets one at least)."""
    if len(layer_bytes) < size:
        raise ConfigError(f"pipeline sharding needs at least one layer per rank: the model has {len(layer_bytes)} "
                          f"layers for {size} ranks; use at most {len(layer_bytes)} ranks")
    total, ranges, start, seen = sum(layer_bytes), [], 0, 0
    for rank in range(size - 1):
        end = start + 1
        seen += layer_bytes[start]
        while end < len(layer_bytes) - (size - 1 - rank) and seen + layer_bytes[end] / 2 <= total * (rank + 1) / size:
            seen += layer_bytes[end]
            end += 1
        ranges.append(range(start, end))
        start = end
    ranges.append(range(start, len(layer_bytes)))
    return ranges


def layer_sizes(weights: dict[str, mx.array], layers: int) -> list[int]:
    sizes = [0] * layers
    for name, w in weights.items():
        if (m := LAYER.match(name)) and int(m.group(1)) < layers:
            sizes[int(m.group(1))] += w.nbytes
    return sizes


def stage_weights(weights: dict[str, mx.array], mine: range) -> dict[str, mx.array]:
    """This rank's layers (renumbered from 0) and the embedding, final norm and head every rank keeps."""
    out = {}
    for name, w in weights.items():
        m = LAYER.match(name)
        if m is None:
            out[name] = w
        elif int(m.group(1)) in mine:
            out[f"model.layers.{int(m.group(1)) - mine.start}.{name[m.end():]}"] = w
    return out


class Stage(nn.Module):
    """One rank's run of layers. The first rank embeds the tokens; each rank runs its
    layers and sends the hidden state on; the last rank's output reaches every rank (an
    all_gather), which applies the final norm, so every rank computes the same logits.

    Each call evaluates its hand-overs before it returns: a layer that reads a value on
    the host (a mixture of experts counting its rows) evaluates this rank's receive in
    the middle of a call, so a send left lazy for later would leave the next rank
    waiting for data that its sender will only send after waiting on that rank."""

    def __init__(self, backbone: nn.Module, shard: Shard, first_layer: int = 0):
        super().__init__()
        self.backbone = backbone
        self._shard = shard
        self.first_layer = first_layer  # the checkpoint's number of this rank's first layer

    @property
    def layers(self) -> list:
        return self.backbone.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.backbone.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.backbone.norm

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        rank, size, group = self._shard.rank, self._shard.size, self._shard.group
        x = self.backbone.embed(tokens)
        if rank > 0:
            x = mx.distributed.recv_like(x, rank - 1, group=group)
        x = self.backbone.blocks(x, cache)
        if rank < size - 1:
            x = mx.distributed.send(x, rank + 1, group=group)
        x = mx.distributed.all_gather(x, group=group)[-tokens.shape[0]:]
        mx.eval(x)  # every rank's caches are inputs of x, so they are filled too
        return self.backbone.norm(x)
