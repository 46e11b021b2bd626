"""How a model folder was quantized, in words a user reads: the bits chosen per layer as
config.json records them (mlx-lm's `quantization`: a common setting and per-layer overrides),
and the bits per weight the whole model costs. One reading for the converter's report and for
`mlxinfer inspect`, so both say the same thing about the same folder."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any


def layer_spec(quant: Mapping[str, Any], layer: str) -> Mapping[str, Any]:
    """The quantization of `layer`: its own entry when config.json has one, else the common one."""
    own = quant.get(layer)
    return own if isinstance(own, dict) else quant


def label(spec: Mapping[str, Any]) -> str:
    """'4-bit g64' for affine quantization, the mode's name ('mxfp4') for the floating-point ones."""
    mode = spec.get("mode", "affine")
    return f"{spec.get('bits', '?')}-bit g{spec.get('group_size', '?')}" if mode == "affine" else str(mode)


def quantized_layers(names: Iterable[str]) -> list[str]:
    """The layers stored quantized: those with a `.scales` tensor beside their weight."""
    return [name.removesuffix(".scales") for name in names if name.endswith(".scales")]


def quantization_summary(quant: Mapping[str, Any] | None, names: Iterable[str]) -> str:
    """'180 x 4-bit g64, 30 x 6-bit g64 (210 layers); embedding 6-bit g64, also the LM head' from
    config.json's `quantization` and the names of the tensors stored; '' when nothing is quantized.
    The embedding and LM head are named apart: they are a large share of a small model's bytes."""
    names = list(names)
    layers = quantized_layers(names)
    if not quant or not layers:
        return ""
    chosen = {layer: label(layer_spec(quant, layer)) for layer in layers}
    counts = Counter(chosen.values())
    text = ", ".join(f"{n} x {what}" for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    text += f" ({len(layers)} layers)"
    embedding = next((layer for layer in chosen if layer.endswith("embed_tokens")), None)
    head = next((layer for layer in chosen if layer.endswith("lm_head")), None)
    tied = not any(name.startswith("lm_head.") or ".lm_head." in name for name in names)
    if embedding is not None:
        text += f"; embedding {chosen[embedding]}" + (", also the LM head" if tied else "")
    else:
        text += "; embedding not quantized"
    if not tied:
        text += f"; LM head {chosen[head]}" if head is not None else "; LM head not quantized"
    return text


def bits_per_weight(quant: Mapping[str, Any] | None, tensors: Mapping[str, tuple[tuple[int, ...], int]]) -> float:
    """Bits of every stored tensor (quantized weights, their scales and biases, float tensors, the
    embedding and LM head) per parameter of the float model; `tensors` maps each name to (shape,
    bytes). A packed weight of `bits` holds 32 / bits values per uint32 element."""
    layers = set(quantized_layers(tensors)) if quant else set()
    parameters = 0
    for name, (shape, _) in tensors.items():
        layer, _, leaf = name.rpartition(".")
        if layer in layers and leaf in ("scales", "biases"):
            continue
        count = math.prod(shape)
        if layer in layers and leaf == "weight":
            count = count * 32 // int(layer_spec(quant, layer).get("bits", 4))
        parameters += count
    return sum(nbytes for _, nbytes in tensors.values()) * 8 / max(parameters, 1)


def method_text(method: Mapping[str, Any]) -> str:
    """config.json's "quantization_method" as one line: 'gptq (calibration: python-reference, ...)'."""
    rest = ", ".join(f"{k}: {v}" for k, v in method.items() if k != "method")
    return f"{method.get('method', '?')}" + (f" ({rest})" if rest else "")
