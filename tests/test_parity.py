"""Our logits equal transformers' on the same random-weight checkpoints (float32),
and incremental decoding with the KV cache equals the full-sequence pass."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

import mlxinfer
from mlxinfer.models.cache import make_cache

TOL = 1e-4
T = 32

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied-mha-bias": (
        "llama",
        dict(tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    ),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
    "llama-rope-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-rope-dynamic": (
        "llama",
        dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    ),
    "llama-rope-llama3": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama-rope-yarn": (
        "llama",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "mistral-sliding": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", dict(num_key_value_heads=1)),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
}


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 500, size=(2, T))


def hf_logits(folder, ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def hf_incremental_logits(folder, ids: np.ndarray, prefill: int) -> np.ndarray:
    """transformers' own cached decode: the oracle where RoPE depends on length (dynamic NTK)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    x = torch.tensor(ids)
    with torch.no_grad():
        out = model(x[:, :prefill], use_cache=True)
        steps = [out.logits]
        for t in range(prefill, x.shape[1]):
            out = model(x[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    return torch.cat(steps, 1).numpy()


def ours_incremental(model, ids: np.ndarray, chunks: list[int]) -> np.ndarray:
    """Feed `ids` through the cache in the given chunk sizes, then one token at a time."""
    cache, out, pos = make_cache(model), [], 0
    for n in chunks + [1] * (ids.shape[1] - sum(chunks)):
        out.append(model(mx.array(ids[:, pos : pos + n]), cache=cache))
        pos += n
    return np.array(mx.concatenate(out, axis=1))


def assert_matches_transformers(folder, model) -> None:
    """Full-sequence float32 logits within TOL of transformers' on the same checkpoint."""
    ids = tokens()
    ref = hf_logits(folder, ids)
    assert np.abs(ref).max() > 0.1, "logits too small for the comparison to mean anything"
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, atol=TOL, rtol=0)


def assert_decode_matches_full(model) -> None:
    """Chunked prefill then token-by-token decoding through the cache equals one full pass."""
    ids = tokens(1)
    full = np.array(model(mx.array(ids)))
    np.testing.assert_allclose(ours_incremental(model, ids, chunks=[5, 7]), full, atol=TOL, rtol=0)


def assert_matches_mlx_lm(folder, bits: int | None = None) -> None:
    """An MLX folder gives mlx-lm's logits in our hands; with `bits`, every quantized layer has them."""
    import mlx_lm

    ref_model, _ = mlx_lm.load(str(folder))
    ours, _ = mlxinfer.load(folder)
    ids = mx.array(tokens(2))
    np.testing.assert_allclose(np.array(ours(ids)), np.array(ref_model(ids)), atol=TOL, rtol=0)
    q_layers = [m for _, m in ours.named_modules() if "Quantized" in type(m).__name__]
    assert q_layers and (bits is None or all(m.bits == bits for m in q_layers))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint):
    model_type, overrides = VARIANTS[request.param]
    folder = hf_checkpoint(model_type, **overrides)
    model, _ = mlxinfer.load(folder, dtype="float32")
    return request.param, folder, model


def test_logits_match_transformers(variant):
    name, folder, model = variant
    assert_matches_transformers(folder, model)


def test_cached_decoding_matches_full_sequence(variant):
    name, folder, model = variant
    ids = tokens(1)
    steps = ours_incremental(model, ids, chunks=[5, 7])
    if "dynamic" in name:
        ref = hf_incremental_logits(folder, ids, prefill=12)
        ours = ours_incremental(model, ids, chunks=[12])
        np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
        steps = steps[:, :16]  # within the original context the base never changes
        full = np.array(model(mx.array(ids[:, :16])))
    else:
        full = np.array(model(mx.array(ids)))
    np.testing.assert_allclose(steps, full, atol=TOL, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(hf_checkpoint, mlx_lm_quantized, model_type, bits):
    # mlx-lm ignores Mistral's sliding window, so compare where the window covers the input.
    overrides = dict(sliding_window=64) if model_type == "mistral" else {}
    assert_matches_mlx_lm(mlx_lm_quantized(hf_checkpoint(model_type, **overrides), bits=bits, group_size=32), bits)


def test_mlx_lm_mixed_recipe_per_layer_overrides(hf_checkpoint, mlx_lm_quantized):
    import json

    import mlx_lm

    folder = mlx_lm_quantized(hf_checkpoint("llama", num_hidden_layers=4), bits=4, recipe="mixed_4_6")
    per_layer = {k: v for k, v in json.loads((folder / "config.json").read_text())["quantization"].items()
                 if isinstance(v, dict)}
    assert {v["bits"] for v in per_layer.values()} >= {6}, "recipe wrote no per-layer overrides"
    ref_model, _ = mlx_lm.load(str(folder))
    ours, _ = mlxinfer.load(folder)
    ids = mx.array(tokens(3))
    np.testing.assert_allclose(np.array(ours(ids)), np.array(ref_model(ids)), atol=TOL, rtol=0)
    bits = {name: m.bits for name, m in ours.named_modules() if hasattr(m, "bits")}
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
             "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # merged after loading when alike
    for path, q in per_layer.items():
        parent, _, name = path.rpartition(".")
        assert bits.get(path, bits.get(f"{parent}.{fused.get(name)}")) == q["bits"], path
