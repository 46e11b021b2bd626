"""Gemma 2 and Gemma 3: logits equal transformers' on random-weight checkpoints
(float32), cached decoding equals the full pass, mlx-lm-quantized checkpoints give
mlx-lm's logits, and our converter's output loads in mlx-lm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_parity import (
    TOL,
    assert_decode_matches_full,
    assert_matches_mlx_lm,
    assert_matches_transformers,
    tokens,
)

import mlxinfer
from mlxinfer.models.cache import KVCache, RotatingKVCache, make_cache

GEMMA = {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24}
LOCAL_BASE = 100.0
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3 = {
    "head_dim": 32,
    "num_hidden_layers": 3,
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": True,
    "layer_types": GEMMA3_LAYERS,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_BASE},
    },
}
VARIANTS = {
    # Small caps so soft-capping changes the scores and logits a lot.
    "gemma2-softcap": ("gemma2", dict(GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma2-no-softcap": (
        "gemma2",
        dict(GEMMA, attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=True),
    ),
    "gemma3_text": ("gemma3_text", GEMMA3),
    "gemma3_text-linear-rope": (
        "gemma3_text",
        dict(
            GEMMA3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_BASE},
            },
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma(request, hf_checkpoint):
    """(folder, model loaded in float32) for one variant."""
    folder = hf_checkpoint(VARIANTS[request.param][0], **VARIANTS[request.param][1])
    return folder, mlxinfer.load(folder, dtype="float32")[0]


def test_logits_match_transformers(gemma):
    assert_matches_transformers(*gemma)


def test_cached_decoding_matches_full_sequence(gemma):
    assert_decode_matches_full(gemma[1])


def test_cache_follows_layer_kind(gemma):
    """Sliding layers get a rotating cache the size of their window; global layers grow."""
    model = gemma[1]
    for layer, cache in zip(model.layers, make_cache(model)):
        if layer.window:
            assert isinstance(cache, RotatingKVCache) and cache.max_size == layer.window == 8
        else:
            assert type(cache) is KVCache
    assert {layer.window for layer in model.layers} == {None, 8}


def build_multimodal(folder: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration saved by transformers, vision tower included."""
    from conftest import BASE_CONFIG, perturb, train_tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = {**BASE_CONFIG, **GEMMA3, "model_type": "gemma3_text", "initializer_range": 0.08}
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=509,
        eoi_token_index=510,
        image_token_index=511,
    )
    model = Gemma3ForConditionalGeneration(config).float().eval()
    perturb(model, 0)
    model.save_pretrained(folder)
    train_tokenizer(folder)
    return folder


def multimodal_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(torch.tensor(ids)).logits.numpy()


def rename_tensors(folder: Path, old: str, new: str) -> None:
    from safetensors.numpy import load_file, save_file

    file = folder / "model.safetensors"
    tensors = {k.replace(old, new, 1) if k.startswith(old) else k: v for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})


def legacy_text_config(text: dict) -> dict:
    """The text_config as older hub checkpoints write it: top-level RoPE bases and a
    sliding pattern instead of per-layer-type `rope_parameters` and `layer_types`."""
    legacy = {k: v for k, v in text.items() if k not in ("rope_parameters", "layer_types")}
    ropes = text["rope_parameters"]
    return dict(
        legacy,
        rope_theta=ropes["full_attention"]["rope_theta"],
        rope_local_base_freq=ropes["sliding_attention"]["rope_theta"],
        sliding_window_pattern=2,
    )


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> Path:
    return build_multimodal(tmp_path_factory.mktemp("gemma3"))


@pytest.mark.parametrize("style", ["as-saved", "model.language_model-prefix", "legacy-config"])
def test_multimodal_checkpoint_loads_its_text_model(multimodal, tmp_path, style):
    folder = tmp_path / "ckpt"
    shutil.copytree(multimodal, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3" and "text_config" in config
    if style == "model.language_model-prefix":
        rename_tensors(folder, "language_model.model.", "model.language_model.")
    elif style == "legacy-config":
        config["text_config"] = legacy_text_config(config["text_config"])
        (folder / "config.json").write_text(json.dumps(config))
    ids = tokens()
    ref = multimodal_logits(multimodal, ids)
    model, _ = mlxinfer.load(folder, dtype="float32")
    assert [layer.window for layer in model.layers] == [8, None, 8]
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, atol=TOL, rtol=0)


def mlx_lm_ready(folder: Path, dst: Path) -> Path:
    """A copy whose config.json also has the top-level keys mlx-lm reads (as hub configs do)."""
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    if config["model_type"] == "gemma3_text":
        config = legacy_text_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# mlx-lm's Gemma 2 has no sliding window (that comparison uses one the input fits in)
# and always ties its LM head to the embedding.
MLX_LM_CASES = {
    "gemma2": (
        "gemma2",
        dict(GEMMA, sliding_window=64, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
    ),
    "gemma3_text": ("gemma3_text", GEMMA3),
}


@pytest.mark.parametrize("case", sorted(MLX_LM_CASES))
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(hf_checkpoint, mlx_lm_quantized, tmp_path_factory, case, bits):
    model_type, overrides = MLX_LM_CASES[case]
    ready = tmp_path_factory.getbasetemp() / f"mlxlm-ready-{case}"
    if not ready.exists():
        mlx_lm_ready(hf_checkpoint(model_type, **overrides), ready)
    assert_matches_mlx_lm(mlx_lm_quantized(ready, bits=bits, group_size=32), bits)


@pytest.mark.parametrize("case", sorted(MLX_LM_CASES))
def test_converter_output_loads_in_mlx_lm(hf_checkpoint, tmp_path, case):
    import mlx_lm

    from mlxinfer.convert import convert

    model_type, overrides = MLX_LM_CASES[case]
    src = mlx_lm_ready(hf_checkpoint(model_type, **overrides), tmp_path / "src")
    out = tmp_path / "q8"
    convert(src, out, quantize=True, bits=8, group_size=32)
    ids = mx.array(tokens(3))
    ours = np.array(mlxinfer.load(out)[0](ids))
    theirs = np.array(mlx_lm.load(str(out))[0](ids))
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    float_logits = np.array(mlxinfer.load(src, dtype="float32")[0](ids))
    # Random q/k norms make attention peaky, so 8 bits drift a few percent; a
    # misplaced tensor would be off by about 100%.
    drift = np.sqrt(np.mean((ours - float_logits) ** 2) / np.mean(float_logits**2))
    assert drift < 0.1, f"8-bit logits drifted {drift:.0%} from the source's"
