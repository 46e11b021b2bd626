"""`--method gptq`: quantization that compensates each rounding error with the weights not yet
rounded (GPTQ, Frantar et al. 2022), weighted by what the layer's inputs are on real text.

The source model runs one block at a time over calibration tokens: each quantizable linear of the
block accumulates H = 2 XᵀX / n over its inputs X, its weight is quantized column by column in
MLX's affine grid (so MLX dequantizes exactly the values GPTQ assumed), and the block then runs
again with its quantized weights to give the next block its inputs, as the paper does. Only one
block's float weights, its inputs and its Hessians are in memory at a time (besides the packed
results, the size of the output). A quantized source is dequantized to float32 first.

The LM head is quantized the same way after the last block, its Hessian from the final hidden
states (as the quantized blocks give them). A tied embedding is the LM head too: GPTQ spends its
error where the logits feel it least, which costs its other use, the lookup, little — measured
on SmolLM2-135M at 3 bits, rounding only the lookup's copy raised perplexity 4%, only the
head's 80%. An untied embedding keeps plain rounding (its lookups have no Hessian).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.models.layers import Backbone
from mlxinfer.text.tokenizer import Tokenizer

from . import texts
from .blockwise import Blockwise, run_block, set_module
from .gguf_file import Packed
from .grid import fitted, mlx_grid
from .plan import Job
from .quantize import QuantSpec
from .sources import Source

SEQUENCE = 512  # tokens a calibration sequence holds
DEFAULT_TOKENS = 4096
DAMP = 0.01  # of the mean diagonal, added to H (the paper's dampening)
COLUMNS = 128  # columns quantized between two lazy batch updates (the paper's B)
SEED = 0
HEAD_ROWS = 8192  # LM head rows GPTQ rounds at once (float64 copies of a 150k-token vocabulary's head are GBs)


@dataclass(frozen=True)
class CalibrationText:
    """What to calibrate on: plain text, or chat conversations rendered by the model's template."""

    name: str  # the file's name, or "python-reference" for the built-in text
    text: str | None = None
    chats: tuple[list[dict], ...] = ()

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        if self.text is not None:
            return tokenizer.encode(self.text)
        return [i for chat in self.chats for i in tokenizer.apply_chat_template(chat, False, tokenize=True)]


def read_calibration(file: str | os.PathLike | None) -> CalibrationText:
    """The --calibration file read up front (a .jsonl file: one {"messages": [...]} per line),
    or the built-in text when there is none, so a bad file fails before any work."""
    if file is None:
        return CalibrationText("python-reference", text=texts.calibration_text())
    text = texts.read_text(file, "--calibration")
    if Path(file).suffix.lower() != ".jsonl":
        return CalibrationText(Path(file).name, text=text)
    chats = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            chat = json.loads(line)["messages"]
        except (ValueError, KeyError, TypeError):
            chat = None
        if not isinstance(chat, list):
            raise InvalidOptionError(f"--calibration '{file}' line {number} is not {{\"messages\": [...]}}; write one "
                                     "chat a line, or pass plain text in a file not named .jsonl")
        chats.append(chat)
    return CalibrationText(Path(file).name, chats=tuple(chats))


def windows(ids: list[int], tokens: int, length: int = SEQUENCE, seed: int = SEED) -> np.ndarray:
    """[N, L] token ids: N = tokens / L windows drawn without overlap from `ids`, in a seeded order
    so a conversion is repeatable; all of them when the text has fewer."""
    length = min(length, tokens, len(ids))
    if length < 2:
        raise InvalidOptionError("the calibration text has fewer than 2 tokens; pass a longer --calibration file")
    cuts = np.asarray(ids[: len(ids) // length * length]).reshape(-1, length)
    chosen = np.random.default_rng(seed).permutation(len(cuts))[: max(1, tokens // length)]
    return cuts[np.sort(chosen)]


def check_calibratable(model: nn.Module, jobs: list[Job]) -> None:
    """Refuse, before any work, a model GPTQ cannot run block by block or a quantized layer
    inside a block that is not a plain linear (experts, convolutions)."""
    if not isinstance(getattr(model, "model", None), Backbone):
        raise InvalidOptionError(f"--method gptq runs a model block by block, which {type(model).__name__} does not "
                                 "allow; use --method rtn")
    modules = dict(model.named_modules())
    blocks = {name for name, m in modules.items() if any(m is b for b in model.layers)}
    for job in jobs:
        if job.target is None or not any(job.path.startswith(f"{b}.") for b in blocks):
            continue
        if not isinstance(modules[job.path], nn.Linear):
            raise InvalidOptionError(f"--method gptq handles plain linear layers; '{job.path}' is a "
                                     f"{type(modules[job.path]).__name__}; use --method rtn")


def calibrate(source: Source, jobs: list[Job], ids: np.ndarray, dtype: mx.Dtype,
              progress: Callable[[int, int], None] = lambda done, total: None) -> dict[str, Packed]:
    """GPTQ-quantized weights of every quantizable linear inside the model's blocks, by layer path,
    their scales and biases in `dtype` (the output's): the rest of `jobs` is left to plain rounding."""
    model = Blockwise(source, "--method gptq")
    targets = {job.path: job.target for job in jobs if job.target is not None}
    model.load_outer(head=False)
    x = [model.backbone.embed(mx.array(row[None])) for row in ids]
    mx.eval(x)
    model.drop_embedding()
    out: dict[str, Packed] = {}
    for i, block, prefix in model.blocks():
        linears = {path: m for path, m in block.named_modules()
                   if f"{prefix}.{path}" in targets and isinstance(m, nn.Linear)}
        inputs = _hessians(block, linears, x)
        for key, hessian in inputs.hessians().items():
            factor = inverse_factor(hessian)
            for path in (p for p, k in inputs.reader.items() if k == key):
                packed = rounded(np.asarray(linears[path].weight, dtype=np.float64), factor,
                                 targets[f"{prefix}.{path}"], dtype)
                out[f"{prefix}.{path}"] = packed
                linears[path].weight = packed.dequantize(mx.float32)
        x = [run_block(block, h) for h in x]
        mx.eval(x)
        progress(i + 1, len(model.prefixes))
    head = _head(model, x, targets, dtype)
    if head is not None:
        out[head[0]] = head[1]
    return out


def _head(model: Blockwise, x: list[mx.array], targets: dict[str, QuantSpec], dtype: mx.Dtype
          ) -> tuple[str, Packed] | None:
    """The LM head's weight (the tied embedding's when there is none) by GPTQ over the final
    hidden states of `x`, the last block's outputs; None when the head is not being quantized."""
    tied = model.model.config.tie_word_embeddings
    path = model.path(model.backbone.embed_tokens) if tied else "lm_head"
    if path not in targets:
        return None
    model.load_outer(embedding=False, head=True)
    layer = model.modules[path]
    inputs = _Inputs()
    for h in x:
        inputs.add(path, model.backbone.norm(h))
        inputs.forward_done()
    factor = inverse_factor(inputs.hessians()[path])
    weight = layer.weight
    parts = [rounded(np.asarray(weight[r : r + HEAD_ROWS], dtype=np.float64), factor, targets[path], dtype)
             for r in range(0, weight.shape[0], HEAD_ROWS)]  # rows are independent in GPTQ: a slice at a time
    return path, Packed(*(mx.concatenate(arrays) for arrays in zip(*((p.weight, p.scales, p.biases) for p in parts))),
                        targets[path])


class _Inputs:
    """XᵀX of the inputs of a block's linears, one sum per distinct input: q, k and v (gate and
    up) read the same array, so they share a Hessian and its factorization."""

    def __init__(self) -> None:
        self.sums: dict[str, mx.array] = {}  # by the first linear that read the input
        self.rows: dict[str, int] = {}
        self.reader: dict[str, str] = {}  # linear -> the key of its input's sum
        self._seen: dict[int, tuple[mx.array, str]] = {}  # this forward's inputs, kept alive so ids stay theirs

    def wrap(self, path: str, linear: nn.Linear) -> Callable[[mx.array], mx.array]:
        def recorded(x: mx.array) -> mx.array:
            self.add(path, x)
            return linear(x)
        return recorded

    def add(self, path: str, x: mx.array) -> None:
        seen = self._seen.get(id(x))
        if seen is not None and seen[0] is x:
            self.reader[path] = seen[1]
            return
        self._seen[id(x)] = (x, path)
        self.reader[path] = path
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        self.sums[path] = self.sums.get(path, 0) + flat.T @ flat
        self.rows[path] = self.rows.get(path, 0) + flat.shape[0]

    def forward_done(self) -> None:
        self._seen.clear()
        mx.eval(list(self.sums.values()))

    def hessians(self) -> dict[str, np.ndarray]:
        """H = 2 XᵀX / n by input key."""
        return {key: np.asarray(s, dtype=np.float64) * (2 / self.rows[key]) for key, s in self.sums.items()}


def _hessians(block: nn.Module, linears: dict[str, nn.Linear], x: list[mx.array]) -> _Inputs:
    """The Hessians of the linears' inputs as the float block runs over `x`."""
    inputs = _Inputs()
    for path, m in linears.items():
        set_module(block, path, inputs.wrap(path, m))
    try:
        for h in x:
            run_block(block, h)
            inputs.forward_done()
    finally:
        for path, m in linears.items():
            set_module(block, path, m)
    return inputs


def gptq(weight: np.ndarray, hessian: np.ndarray, spec: QuantSpec, dtype: mx.Dtype = mx.float32,
         fit: bool = True) -> Packed:
    """`weight` [out, in] quantized by GPTQ for inputs whose Hessian is `hessian` (`fit`: each
    group's grid fitted to it, else MLX's min-max grid, as the paper's algorithm takes it)."""
    return rounded(weight, inverse_factor(hessian), spec, dtype, fit)


@dataclass(frozen=True)
class Factor:
    """U, upper triangular with H⁻¹ = UᵀU for the dampened H, and the inputs H says are never used."""

    upper: np.ndarray
    dead: np.ndarray
    importance: np.ndarray  # H's diagonal: what an error in each input costs, for the grid's fit


def inverse_factor(hessian: np.ndarray) -> Factor:
    """The Cholesky factor of the dampened H⁻¹ that GPTQ's updates read (once per distinct input)."""
    h = hessian.astype(np.float64).copy()
    importance = np.diag(h).copy()
    dead = importance == 0  # inputs never seen: nothing to preserve
    h[dead, dead] = 1
    h[np.diag_indices_from(h)] += DAMP * np.mean(np.diag(h))
    return Factor(np.linalg.cholesky(np.linalg.inv(h)).T, dead, importance)


def rounded(weight: np.ndarray, factor: Factor, spec: QuantSpec, dtype: mx.Dtype, fit: bool = True) -> Packed:
    """`weight` [out, in] quantized by GPTQ (the paper's Algorithm 1 with lazy batch updates):
    columns in order, each rounded to its group's grid, its error spread over the columns not yet
    rounded through the Cholesky factor of H⁻¹. A group's scale and bias are set from the group's
    columns as they stand when the group begins, rounded to `dtype` as they will be stored: fitted
    to them with H's diagonal as the weights (`grid.fitted`), or MLX's min-max grid (not `fit`)."""
    w = weight.astype(np.float64).copy()
    w[:, factor.dead] = 0
    u = factor.upper
    rows, cols = w.shape
    top = 2**spec.bits - 1
    codes = np.zeros((rows, cols), dtype=np.uint32)
    groups = cols // spec.group_size
    scales, biases = np.zeros((rows, groups)), np.zeros((rows, groups))
    for start in range(0, cols, COLUMNS):
        end = min(start + COLUMNS, cols)
        errors = np.zeros((rows, end - start))
        for j in range(start, end):
            g = j // spec.group_size
            if j % spec.group_size == 0:
                columns = slice(j, j + spec.group_size)
                scales[:, g], biases[:, g] = (fitted(w[:, columns], factor.importance[columns], spec.bits, dtype)
                                              if fit else mlx_grid(w[:, columns], spec.bits, dtype))
            q = np.clip(np.round((w[:, j] - biases[:, g]) / scales[:, g]), 0, top)
            codes[:, j] = q
            errors[:, j - start] = (w[:, j] - (scales[:, g] * q + biases[:, g])) / u[j, j]
            w[:, j:end] -= np.outer(errors[:, j - start], u[j, j:end])
        w[:, end:] -= errors @ u[start:end, end:]
    return Packed(mx.array(pack(codes, spec.bits)), mx.array(scales, dtype=dtype), mx.array(biases, dtype=dtype),
                  spec)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, cols] as MLX packs them: each row a little-endian stream of `bits`-bit codes,
    the first in the lowest bits, in uint32 words (for 2, 4 and 8 bits: 32 / bits codes a word)."""
    rows, cols = codes.shape
    stream = ((codes[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    packed = np.packbits(stream.reshape(rows, cols * bits), axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").reshape(rows, cols * bits // 32)
