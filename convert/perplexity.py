"""`--eval-ppl`: the converted model next to its source on the same text: perplexity of each, and how
far the converted model's next-token distribution is from the source's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Comparison:
    """The converted model against its source on the same windows of the same token ids."""

    source_perplexity: float
    perplexity: float
    kl_divergence: float  # mean over positions of KL(source || converted) of the next-token distribution, in nats
    same_top: float  # share of positions whose likeliest next token is the same in both
    tokens: int  # positions scored


Logits = Callable[[mx.array], mx.array]  # token ids (1, n) -> next-token logits (1, n, vocab): a CausalLM


def _logprobs(model: Logits, ids: list[int]) -> mx.array:
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def score(source: Logits, converted: Logits, ids: list[int], window: int = WINDOW) -> Comparison:
    """Both models over consecutive windows of `window` tokens, in float32: each one's perplexity
    (exp of the mean next-token negative log-likelihood) and, as llama.cpp's `perplexity
    --kl-divergence` reports them, the mean KL divergence of the converted model's next-token
    distribution from the source's and the share of positions where both rank the same token first."""
    nll_source = nll = kl = same = 0.0
    count = 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        p, q = _logprobs(source, chunk[:-1]), _logprobs(converted, chunk[:-1])
        targets = mx.array(chunk[1:])[:, None]
        nll_source -= mx.take_along_axis(p, targets, axis=-1).sum().item()
        nll -= mx.take_along_axis(q, targets, axis=-1).sum().item()
        kl += (mx.exp(p) * (p - q)).sum().item()
        same += (mx.argmax(p, axis=-1) == mx.argmax(q, axis=-1)).sum().item()
        count += len(chunk) - 1
    return Comparison(math.exp(nll_source / count), math.exp(nll / count), kl / count, same / count, count)


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


def compare(source: Source, output: Path, text: str) -> Comparison:
    """The converted folder against its source on the first MAX_TOKENS tokens of `text`, both in
    float32 so the gap measures the conversion, not half-precision arithmetic."""
    ids = load_tokenizer_from_dir(output).encode(text)[: MAX_TOKENS + 1]
    if len(ids) < 2:
        raise InvalidOptionError("the --eval-ppl text has fewer than 2 tokens; pass a longer text")
    return score(source_model(source), load_model(output, dtype="float32"), ids)
