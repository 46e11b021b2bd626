"""The conversion plan: for every model parameter, the exact tensors (name, shape, dtype)
it becomes, decided before anything is read, so shards can be laid out up front and the
written files checked against it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .gguf_file import Packed
from .quantize import Options, QuantSpec, dtype_name
from .sources import Source, SourceTensor


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.size


@dataclass(frozen=True)
class Job:
    """One source tensor and what it becomes: floats of `dtype`, or `target` quantization
    whose scales and biases are of `dtype` (affine; a floating-point mode's scales are uint8)."""

    source: SourceTensor
    target: QuantSpec | None
    dtype: mx.Dtype
    kept_float: str | None = None  # why a layer the options would quantize stays float

    @property
    def path(self) -> str:
        return self.source.name.rpartition(".")[0]

    @property
    def outputs(self) -> tuple[OutTensor, ...]:
        if self.target is None:
            return (OutTensor(self.source.name, self.source.shape, self.dtype),)
        weight, scales = self.target.packed_shape(self.source.shape)
        if not self.target.affine:
            return (OutTensor(f"{self.path}.weight", weight, mx.uint32),
                    OutTensor(f"{self.path}.scales", scales, mx.uint8))
        return (
            OutTensor(f"{self.path}.weight", weight, mx.uint32),
            OutTensor(f"{self.path}.scales", scales, self.dtype),
            OutTensor(f"{self.path}.biases", scales, self.dtype),
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def precision(self) -> str:
        return str(self.target) if self.target else dtype_name(self.dtype)


def plan(model: nn.Module, source: Source, options: Options) -> list[Job]:
    """A job per parameter of `model`, in the model's parameter order (mlx-lm's save order)."""
    modules = dict(model.named_modules())
    layers = len(model.layers)
    dtype = options.float_dtype(source.dtype)
    floats = () if options.quantize_vision else model.unquantized
    jobs = []
    for name, _ in tree_flatten(model.parameters()):
        tensor = source.tensors[name]
        path, _, leaf = name.rpartition(".")
        quantizable = leaf == "weight" and hasattr(modules[path], "to_quantized") and not path.startswith(floats)
        want = _wanted(path, tensor, options, layers) if quantizable else None
        if want is not None and not want.fits(tensor.shape):
            reason = f"input dim {tensor.shape[-1]} is not divisible by group size {want.group_size}"
            jobs.append(Job(tensor, None, dtype, reason))
        else:
            jobs.append(Job(tensor, want, dtype))
    return jobs


def _wanted(path: str, tensor: SourceTensor, options: Options, layers: int) -> QuantSpec | None:
    if options.dequantize:
        return None
    if options.quantizing:
        return options.target(path, layers)
    return tensor.precision


def run(job: Job) -> dict[str, mx.array]:
    """Read the source tensor and produce the job's outputs (still lazy: the caller evaluates)."""
    tensor = job.source.read()
    if job.target is None:
        return {job.source.name: _floats(tensor, job.dtype)}
    spec = job.target
    if not (isinstance(tensor, Packed) and tensor.spec == spec):  # kept as stored when it already is the target
        weight, scales, *biases = mx.quantize(_floats(tensor, job.dtype), spec.group_size, spec.bits, mode=spec.mode)
        tensor = Packed(weight, scales, biases[0] if biases else None, spec)
    return {f"{job.path}.{leaf}": t for leaf, t in tensor.tensors(job.dtype).items()}


def _floats(tensor: mx.array | Packed, dtype: mx.Dtype) -> mx.array:
    """`tensor` as `dtype` floats; packed ones are dequantized in `dtype`, so a float32 target
    gets w = scale * q + bias without fp16 rounding."""
    return tensor.dequantize(dtype) if isinstance(tensor, Packed) else tensor.astype(dtype)


def shards(jobs: list[Job], limit: int) -> list[list[Job]]:
    """Consecutive jobs grouped into files of at most `limit` bytes (a bigger job gets its own),
    as mlx-lm's `make_shards` does per tensor; a layer's weight, scales and biases stay together."""
    groups: list[list[Job]] = []
    size = 0
    for job in jobs:
        if not groups or size + job.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(job)
        size += job.nbytes
    return groups


def quantization_config(jobs: list[Job], options: Options) -> dict[str, Any] | None:
    """config.json's `quantization`, laid out as mlx-lm writes it: the common setting, plus an
    entry for every quantized layer when settings differ between layers (or a recipe chose them)."""
    specs = {job.path: job.target for job in jobs if job.target is not None}
    if not specs:
        return None
    common = Counter(specs.values()).most_common(1)[0][0]
    config: dict[str, Any] = common.as_config()
    if options.recipe or len(set(specs.values())) > 1:
        config.update({path: spec.as_config() for path, spec in specs.items()})
    return config


def parameter_count(jobs: list[Job]) -> int:
    return sum(int(np.prod(job.source.shape)) for job in jobs)
