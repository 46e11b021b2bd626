"""Phi-3 against transformers: fused projections, LongRoPE on both sides of the
original context, partial rotary; and mlx-lm-quantized / converted checkpoints against mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_parity import TOL, hf_incremental_logits, hf_logits, ours_incremental, tokens

import mlxinfer
from mlxinfer.convert import convert

ORIGINAL = 16  # original_max_position_embeddings of the LongRoPE variants; the test sequences are 32


def longrope(rotary_dims: int) -> dict:
    half = rotary_dims // 2
    return {
        "max_position_embeddings": 64,
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": np.linspace(1.0, 1.5, half).tolist(),
            "long_factor": np.linspace(1.0, 6.0, half).tolist(),
        },
    }


# Phi3Config's token ids default beyond our 512-token vocabulary.
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
VARIANTS = {
    "default": IDS,
    "longrope": {**IDS, **longrope(16)},
    "partial": {**IDS, "partial_rotary_factor": 0.5},
    "longrope-partial": {**IDS, "partial_rotary_factor": 0.5, **longrope(8)},
    "sliding": {**IDS, "sliding_window": 8},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint):
    folder = hf_checkpoint("phi3", **VARIANTS[request.param])
    return request.param, folder, mlxinfer.load(folder, dtype="float32")[0]


@pytest.mark.parametrize("length", [12, 32])
def test_logits_match_transformers(variant, length):
    """12 tokens stay within LongRoPE's original context (short factors), 32 go past it (long ones)."""
    _, folder, model = variant
    ids = tokens()[:, :length]
    ref = hf_logits(folder, ids)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, atol=TOL, rtol=0)


def test_cached_decoding(variant):
    name, folder, model = variant
    ids = tokens(1)
    if name.startswith("longrope"):
        # Past the original context the new tokens switch tables while cached keys keep theirs,
        # so transformers' own cached decode is the oracle across the switch.
        np.testing.assert_allclose(
            ours_incremental(model, ids, chunks=[12]), hf_incremental_logits(folder, ids, 12), atol=TOL, rtol=0
        )
        ids = ids[:, :ORIGINAL]
    full = np.array(model(mx.array(ids)))
    np.testing.assert_allclose(ours_incremental(model, ids, chunks=[5, 7]), full, atol=TOL, rtol=0)


def test_longrope_switches_tables_past_original_context(hf_checkpoint):
    """The long factors must matter: the same 32 tokens with only the short table would differ."""
    folder = hf_checkpoint("phi3", **VARIANTS["longrope"])
    model = mlxinfer.load(folder, dtype="float32")[0]
    ids = mx.array(tokens())
    full = np.array(model(ids))
    rope = model.layers[0].self_attn.rope
    for layer in model.layers:
        layer.self_attn.rope.long_freqs = rope.freqs
    assert np.abs(np.array(model(ids)) - full).max() > 1e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_matches_mlx_lm(hf_checkpoint, mlx_lm_quantized, bits):
    import mlx_lm

    folder = mlx_lm_quantized(hf_checkpoint("phi3", **VARIANTS["partial"]), bits=bits, group_size=32)
    ids = mx.array(tokens(2))
    ref = np.array(mlx_lm.load(str(folder))[0](ids))
    np.testing.assert_allclose(np.array(mlxinfer.load(folder)[0](ids)), ref, atol=TOL, rtol=0)


def test_converted_loads_in_mlx_lm(hf_checkpoint, tmp_path):
    import mlx_lm

    out = tmp_path / "q4"
    convert(hf_checkpoint("phi3", **IDS), out, quantize=True, bits=4, group_size=32)
    ids = mx.array(tokens(3))
    ours = mlxinfer.load(out)[0]
    assert "qkv_proj" in dict(ours.layers[0].self_attn.named_modules())
    ref = np.array(mlx_lm.load(str(out))[0](ids))
    np.testing.assert_allclose(np.array(ours(ids)), ref, atol=TOL, rtol=0)
