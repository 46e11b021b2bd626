"""Mixture-of-experts building blocks shared by the MoE families.

Expert weights are stacked per projection as one [num_experts, out, in] tensor and
applied with `mx.gather_mm` / `mx.gather_qmm`, so a token reads only the weights of
the experts it was routed to. Stacked tensors are named `<block>.switch_mlp.<proj>.*`,
as mlx-lm names them, so quantized checkpoints move freely between the two.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base.errors import ConfigError, CorruptCheckpointError
from ..kernels.quantized_matmul import gather_quantized_matmul, quantized_matmul
from .config import ModelConfig
from .layers import Block, CausalLM, Linear, SwiGLU

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SORT_FROM = 64  # routed rows from which sorting by expert pays for itself
_PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<leaf>weight|bias)$")


class SwitchLinear(nn.Module):
    """A linear layer per expert, weights stacked as [num_experts, out, in]."""

    row_bound = False  # the product depends only on each routed row, not on its batch row (see lora)

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return _add_bias(self, y, indices)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def dense(self, x: mx.array, expert: int) -> mx.array:
        """Expert `expert` applied to x [rows, in] as a plain matmul."""
        y = x @ self.weight[expert].T
        return y + self.bias[expert] if "bias" in self else y

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        return QuantizedSwitchLinear(self.weight, group_size or 64, bits or 4, mode, self.get("bias"))


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with each expert's matrix quantized along its input dimension
    (the layout `mx.quantize` gives a 3-D tensor and mlx-lm stores)."""

    row_bound = False

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str, bias: mx.array | None = None):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        if bias is not None:
            self.bias = bias
        self.freeze()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def dense(self, x: mx.array, expert: int) -> mx.array:
        """Expert `expert` applied to x [rows, in], by kernels.quantized_matmul."""
        b = self.biases[expert] if "biases" in self else None
        y = quantized_matmul(x, self.weight[expert], self.scales[expert], b, self.group_size, self.bits, self.mode)
        return y + self.bias[expert] if "bias" in self else y

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = gather_quantized_matmul(x, self.weight, self.scales, self.get("biases"), indices, self.group_size,
                                    self.bits, self.mode, sorted_indices)
        return _add_bias(self, y, indices)


def _add_bias(layer: nn.Module, y: mx.array, indices: mx.array) -> mx.array:
    return y + mx.expand_dims(layer.bias[indices], -2) if "bias" in layer else y


def silu_glu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class SwitchGLU(nn.Module):
    """The gated feed-forward of every routed expert: down(glu(gate(x), up(x))), SwiGLU's
    silu(gate) * up unless a family gives its own `glu`, evaluated only for the k experts
    each token picked."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, bias: bool = False,
                 glu: Callable[[mx.array, mx.array], mx.array] = silu_glu):
        super().__init__()
        self.glu = glu
        self.gate_proj = SwitchLinear(hidden, intermediate, num_experts, bias)
        self.up_proj = SwitchLinear(hidden, intermediate, num_experts, bias)
        self.down_proj = SwitchLinear(intermediate, hidden, num_experts, bias)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., hidden], indices [..., k] -> [..., k, hidden], one output per chosen expert."""
        k = indices.shape[-1]
        if indices.size < SORT_FROM or self.row_bound:
            y = self._experts(mx.expand_dims(x, (-2, -3)), indices, False)
            return y.squeeze(-2)
        # Many rows: group them by expert so each expert's weights are read once.
        flat = indices.flatten()
        order = mx.argsort(flat)
        rows = x.reshape(-1, x.shape[-1])[order // k]
        if mx.default_device().type == mx.DeviceType.cpu:
            y = self._per_expert(rows, flat[order])
        else:
            y = self._experts(mx.expand_dims(rows, -2), flat[order], True).squeeze(-2)
        return y[mx.argsort(order)].reshape(*indices.shape, -1)

    @property
    def row_bound(self) -> bool:
        """A projection's product depends on each routed row's batch row (adapters that differ
        by row): sorting rows by expert would lose it, so they stay in batch order."""
        return self.gate_proj.row_bound or self.up_proj.row_bound or self.down_proj.row_bound

    def _per_expert(self, rows: mx.array, experts: mx.array) -> mx.array:
        """MLX's CPU gather matmuls go row by row (512 routed rows through 8 experts of
        512x1408: 1.7 s); one dense matmul per expert over its rows, sorted together, is
        a BLAS call instead. Costs a host sync for the per-expert row counts."""
        counts = np.bincount(np.array(experts), minlength=self.gate_proj.num_experts)
        starts = np.concatenate([[0], np.cumsum(counts)])
        out = []
        for e in np.flatnonzero(counts):
            r = rows[int(starts[e]) : int(starts[e + 1])]
            h = self.glu(self.gate_proj.dense(r, e), self.up_proj.dense(r, e))
            out.append(self.down_proj.dense(h, e))
        return mx.concatenate(out)

    def _experts(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        gate = self.gate_proj(x, indices, sorted_indices)
        up = self.up_proj(x, indices, sorted_indices)
        return self.down_proj(self.glu(gate, up), indices, sorted_indices)


def top_k(scores: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Indices and values of the k largest scores along the last axis (in no particular order)."""
    if not 0 < k <= scores.shape[-1]:
        raise ConfigError(f"num_experts_per_tok is {k} but there are {scores.shape[-1]} experts")
    indices = mx.stop_gradient(mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k])
    return indices, mx.take_along_axis(scores, indices, axis=-1)


def softmax_top_k(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Route by softmax over all experts, then keep the k most probable; with `normalize`
    the kept probabilities are rescaled to sum to 1 (Mixtral, `norm_topk_prob`)."""
    indices, weights = top_k(mx.softmax(logits.astype(mx.float32), axis=-1, precise=True), k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


def combine(expert_out: mx.array, weights: mx.array) -> mx.array:
    """Sum of the chosen experts' outputs [..., k, hidden] weighted by [..., k]."""
    return (expert_out * mx.expand_dims(weights, -1).astype(expert_out.dtype)).sum(axis=-2)


class SparseMoE(nn.Module):
    """Router plus routed experts, softmax-then-top-k (Mixtral, Qwen2-MoE, Qwen3-MoE),
    and a shared expert scaled by a sigmoid gate where configured (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.k, self.normalize = moe.experts_per_token, moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(cfg.hidden_size, moe.intermediate_size, moe.num_experts)
        if moe.shared_intermediate_size:
            self.shared_expert = SwiGLU(cfg, moe.shared_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = softmax_top_k(self.gate(x), self.k, self.normalize)
        y = combine(self.switch_mlp(x, indices), weights)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class MoEBlock(Block):
    """A decoder layer whose feed-forward is a SparseMoE, except in the config's dense layers."""

    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg) if cfg.moe.sparse(layer) else SwiGLU(cfg)


class MoECausalLM(CausalLM):
    """A causal LM of MoEBlocks that loads per-expert or fused Hugging Face expert
    tensors as well as stacked ones; `expert_names` renames a family's projections."""

    block = MoEBlock
    expert_names: ClassVar[dict[str, str]] = {}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return stack_experts(super().sanitize(weights), self.config.moe.num_experts, self.expert_names)


def stack_experts(
    weights: dict[str, mx.array], num_experts: int, rename: dict[str, str] | None = None
) -> dict[str, mx.array]:
    """Stacked `<block>.switch_mlp.<proj>.*` tensors in place of the per-expert layout of
    Hugging Face checkpoints (`<block>.experts.<e>.<proj>.weight`, projections renamed by
    `rename`, e.g. Mixtral's w1/w3/w2) and of transformers 5's fused one
    (`<block>.experts.gate_up_proj` [E, 2*I, H], gate rows first, and `.down_proj` [E, H, I])."""
    rename = rename or {}
    out: dict[str, mx.array] = {}
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = defaultdict(dict)
    for name, value in weights.items():
        m = _PER_EXPERT.match(name)
        if m and rename.get(m["proj"], m["proj"]) in PROJECTIONS:
            groups[m["block"], rename.get(m["proj"], m["proj"]), m["leaf"]][int(m["e"])] = value
        elif name.endswith(".experts.gate_up_proj"):
            block = name.removesuffix(".experts.gate_up_proj")
            gate, up = mx.split(value, 2, axis=1)
            out[f"{block}.switch_mlp.gate_proj.weight"] = gate
            out[f"{block}.switch_mlp.up_proj.weight"] = up
        elif name.endswith(".experts.down_proj"):
            out[f"{name.removesuffix('.experts.down_proj')}.switch_mlp.down_proj.weight"] = value
        else:
            out[name] = value
    for (block, proj, leaf), experts in groups.items():
        if sorted(experts) != list(range(num_experts)):
            raise CorruptCheckpointError(
                f"'{block}.experts' has {proj}.{leaf} tensors for {len(experts)} experts numbered up to {max(experts)} "
                f"but config.json says {num_experts} experts; the weights do not match the config"
            )
        out[f"{block}.switch_mlp.{proj}.{leaf}"] = mx.stack([experts[e] for e in range(num_experts)])
    return out
