"""How a kernel is handed to `mx.fast.metal_kernel`, and the full Metal source MLX
builds from it, written out by the same rules so it can be compiled elsewhere.

MLX writes the library as: its utility header (metal_stdlib, half/bfloat types),
our `header`, then `template <...>` for the template arguments, then
`[[kernel]] void custom_kernel_<name>_<template>_<dtypes>(...)` whose parameters are
each input (`const device T*`, or `const constant T*` below 8 elements, or
`const constant T&` for a 0-d array, each followed by `<name>_shape` /
`_strides` / `_ndim` buffers when the body mentions them), each output
(`device T*`), then every thread attribute the body mentions, in MLX's fixed
order; the body follows, and an explicit instantiation under a host name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import mlx.core as mx

TYPE_NAMES = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float32: "float",
}
CONSTANT_BELOW = 8  # inputs with fewer elements go to the constant address space
ATTRIBUTES = (  # MLX's order; a body that mentions the name gets the parameter
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"), ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"), ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"), ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"), ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
Template = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class Launch:
    """Everything one kernel call needs besides the kernel itself."""

    inputs: list[mx.array]
    template: Template
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]


@dataclass(frozen=True)
class Param:
    """One parameter of the generated signature: what it is and how it is typed."""

    kind: str  # "input", "scalar", "shape", "strides", "ndim", "output" or "attribute"
    ctype: str
    name: str


@dataclass(frozen=True)
class Assembled:
    name: str
    source: str
    params: list[Param]
    template_args: str  # e.g. "<float, 64, 1>", "" without template arguments


@dataclass(frozen=True)
class MetalKernel:
    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""

    @cached_property
    def _kernel(self):
        return mx.fast.metal_kernel(name=self.name, input_names=list(self.input_names),
                                    output_names=list(self.output_names), source=self.source, header=self.header)

    def __call__(self, launch: Launch) -> list[mx.array]:
        return self._kernel(inputs=launch.inputs, template=list(launch.template), grid=launch.grid,
                            threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
                            output_dtypes=launch.output_dtypes)

    def assemble(self, launch: Launch) -> Assembled:
        """The source MLX compiles for this launch (without MLX's utility header)."""
        template = _template_args(launch.template)
        name = f"custom_kernel_{self.name}"
        if template:
            name += "_" + re.sub(r"<|>|, ", "_", template)[:-1]
        for x in launch.inputs:
            name += "_" + TYPE_NAMES[x.dtype] + ("s" if x.ndim == 0 else "c" if x.size < CONSTANT_BELOW else "")
        name += "".join("_" + TYPE_NAMES[d] for d in launch.output_dtypes)
        params = self._params(launch)
        lines = []
        for p in params:
            if p.kind == "attribute":
                lines.append(f"  {p.ctype} {p.name} [[{p.name}]]")
            else:
                prefix = {"output": "device ", "shape": "const constant ", "strides": "const constant ",
                          "ndim": "const constant "}.get(p.kind, "const ")
                lines.append(f"  {prefix}{p.ctype} {p.name} [[buffer({len(lines)})]]")
        decl = ""
        if launch.template:
            kinds = ", ".join(f"{_template_kind(v)} {n}" for n, v in launch.template)
            decl = f"template <{kinds}>\n"
        source = f"{self.header}{decl}[[kernel]] void {name}(\n" + ",\n".join(lines) + ") {\n" + self.source + "\n}\n"
        if template:
            full = name + template
            source += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({full}) {full};\n'
        return Assembled(name, source, params, template)

    def _params(self, launch: Launch) -> list[Param]:
        params = []
        for name, x in zip(self.input_names, launch.inputs):
            space = "constant" if x.size < CONSTANT_BELOW else "device"
            if x.ndim == 0:
                params.append(Param("scalar", f"constant {TYPE_NAMES[x.dtype]}&", name))
                continue
            params.append(Param("input", f"{space} {TYPE_NAMES[x.dtype]}*", name))
            for suffix, ctype in (("shape", "int*"), ("strides", "int64_t*"), ("ndim", "int&")):
                if f"{name}_{suffix}" in self.source:
                    params.append(Param(suffix, ctype, f"{name}_{suffix}"))
        params += [Param("output", f"{TYPE_NAMES[d]}*", n) for n, d in zip(self.output_names, launch.output_dtypes)]
        params += [Param("attribute", t, a) for a, t in ATTRIBUTES if a in self.source]
        return params


def _template_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    return "int" if isinstance(value, int) else "typename"


def _template_args(template: Template) -> str:
    if not template:
        return ""
    values = [str(int(v)) if isinstance(v, (bool, int)) else TYPE_NAMES[v] for _, v in template]
    return "<" + ", ".join(values) + ">"
