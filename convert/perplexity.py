"""`--eval-ppl`: perplexity of the converted model next to the source's on the same text."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.loading.checkpoint import load_model, quantize_like_checkpoint
from mlxinfer.models import CausalLM, build_model
from mlxinfer.text.tokenizer import load_tokenizer_from_dir

from .gguf_file import Packed
from .sources import Source

MAX_TOKENS = 4096
WINDOW = 512


def perplexity(model: CausalLM, ids: list[int], window: int = WINDOW) -> float:
    """exp(mean next-token negative log-likelihood) over consecutive windows of `window` tokens."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        logits = model(mx.array([chunk[:-1]]))[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(chunk[1:])[:, None]
        total -= mx.take_along_axis(logprobs, targets, axis=-1).sum().item()
        count += len(chunk) - 1
    return math.exp(total / count)


def source_model(source: Source) -> CausalLM:
    """The source at its own precision: legacy-quantized and MLX-quantized layers as they are,
    other GGUF quantizations dequantized exactly; floats (and scales) in float32."""
    model = build_model(source.config)
    weights: dict[str, mx.array] = {}
    for name, tensor in source.tensors.items():
        value = tensor.read()
        if isinstance(value, Packed):
            path = name.rpartition(".")[0]
            weights.update({f"{path}.{leaf}": t for leaf, t in value.tensors(mx.float32).items()})
        else:
            weights[name] = value.astype(mx.float32)
    quantize_like_checkpoint(model, {}, weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def compare(source: Source, output: Path, text: str) -> tuple[float, float]:
    """(source perplexity, converted perplexity) on the first MAX_TOKENS tokens of `text`,
    both computed in float32 so the gap measures the conversion, not half-precision arithmetic."""
    ids = load_tokenizer_from_dir(output).encode(text)[: MAX_TOKENS + 1]
    if len(ids) < 2:
        raise InvalidOptionError("the --eval-ppl text has fewer than 2 tokens; pass a longer text")
    converted = perplexity(load_model(output, dtype="float32"), ids)
    return perplexity(source_model(source), ids), converted
