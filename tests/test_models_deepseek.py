"""DeepSeek-V2/V3 (multi-head latent attention + grouped MoE routing): logits equal
transformers' and mlx-lm's, the cache holds only the compressed latent, and our
converter's output loads in mlx-lm with the same logits."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from test_parity import (
    TOL,
    assert_decode_matches_full,
    assert_matches_mlx_lm,
    assert_matches_transformers,
    hf_logits,
    tokens,
)

import mlxinfer
from mlxinfer.models.cache import make_cache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.engine.prompt_file import load_prompt_cache, save_prompt_cache

MLA = {
    "num_key_value_heads": 4,  # transformers repeats MLA keys by heads // kv_heads, so real configs set them equal
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
GROUPED = {"q_lora_rank": 32, "n_group": 2, "topk_group": 1}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

VARIANTS = {
    "v2-q-lora-null": ("deepseek_v2", {"q_lora_rank": None}),
    "v2-q-lora-grouped": (
        "deepseek_v2",
        dict(
            GROUPED,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.0,
            num_hidden_layers=3,
            rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707),  # as in DeepSeek-V2-Lite
        ),
    ),
    "v2-yarn-mscale": ("deepseek_v2", {"q_lora_rank": None, "rope_scaling": dict(YARN, mscale=1.0, mscale_all_dim=0.5)}),
    "v3-grouped-k2": ("deepseek_v3", dict(GROUPED, routed_scaling_factor=2.5)),
    "v3-grouped-k1-half-split-rope": ("deepseek_v3", dict(GROUPED, num_experts_per_tok=1, rope_interleave=False)),
    "v3-yarn": ("deepseek_v3", dict(GROUPED, rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.8))),
}


def checkpoint(hf_checkpoint, model_type: str, overrides: dict):
    """A random checkpoint with YaRN settings also under `rope_scaling`, as hub configs
    have them (mlx-lm reads only that); for V3 with a non-zero `e_score_correction_bias`
    (transformers initialises it to zeros), non-negative as in trained models."""
    folder = hf_checkpoint(model_type, **{**MLA, **overrides})
    config = json.loads((folder / "config.json").read_text())
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    if rope.get("rope_type", "default") != "default":
        (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": rope}, indent=2))
    if model_type == "deepseek_v3":
        steer_correction_bias(folder)
    return folder


def steer_correction_bias(folder) -> None:
    """Give a random checkpoint's `e_score_correction_bias` (transformers initialises it to zeros)
    non-negative values, as trained models have, so that the bias changes which experts are chosen."""
    file = folder / "model.safetensors"
    weights, meta = mx.load(str(file), return_metadata=True)
    rng = np.random.default_rng(7)
    for name in [k for k in weights if k.endswith("e_score_correction_bias")]:
        weights[name] = mx.array(rng.uniform(0.0, 0.3, weights[name].shape).astype(np.float32))
    mx.eval(weights)  # read everything before overwriting the file it maps
    mx.save_safetensors(str(file), weights, metadata=meta)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint):
    model_type, overrides = VARIANTS[request.param]
    folder = checkpoint(hf_checkpoint, model_type, overrides)
    model, _ = mlxinfer.load(folder, dtype="float32")
    return request.param, folder, model


def test_logits_match_transformers(variant):
    _, folder, model = variant
    assert_matches_transformers(folder, model)


def test_latent_decode_matches_full_sequence(variant):
    """Chunked prefill expands the latent; single-token steps use the absorbed form."""
    assert_decode_matches_full(variant[2])


def test_routing_depends_on_correction_bias(hf_checkpoint):
    """The V3 bias must steer the choice: zeroing it changes the logits."""
    model, _ = mlxinfer.load(checkpoint(hf_checkpoint, *VARIANTS["v3-grouped-k2"]), dtype="float32")
    ids = mx.array(tokens())
    before = np.array(model(ids))
    gate = model.layers[1].mlp.gate
    gate.e_score_correction_bias = mx.zeros_like(gate.e_score_correction_bias)
    assert np.abs(np.array(model(ids)) - before).max() > 1e-3


def latent_bytes(layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int) -> int:
    return layers * (kv_lora_rank + rope_dim) * dtype_bytes


def gqa_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def test_cache_holds_only_the_latent(hf_checkpoint, capsys):
    folder = checkpoint(hf_checkpoint, *VARIANTS["v2-q-lora-null"])
    model, _ = mlxinfer.load(folder, dtype="float32")
    llama, _ = mlxinfer.load(hf_checkpoint("llama"), dtype="float32")  # same width: hidden 64, 4 heads
    per_token = {}
    for name, m in (("deepseek_v2", model), ("llama", llama)):
        cache = PromptCache.for_model(m)
        m(mx.array(tokens()[:1, :20]), cache=cache.caches)
        per_token[name] = cache.nbytes // 20
    assert per_token["deepseek_v2"] == latent_bytes(2, MLA["kv_lora_rank"], MLA["qk_rope_head_dim"], 4)
    assert per_token["llama"] == gqa_bytes(2, 2, 16, 4)
    # DeepSeek-V2-Lite's real dimensions (27 layers, kv_lora_rank 512, rope 64) in bfloat16,
    # against a cache of full keys and values for its 16 heads x 192 dims.
    lite, mha = latent_bytes(27, 512, 64, 2), gqa_bytes(27, 16, 192, 2)
    with capsys.disabled():
        print(f"\nKV bytes/token: tiny MLA {per_token['deepseek_v2']} vs tiny llama GQA {per_token['llama']}; "
              f"DeepSeek-V2-Lite MLA {lite} vs 16x192 MHA {mha} ({mha / lite:.1f}x)")


def test_quantized_latent_cache(hf_checkpoint):
    """kv_bits quantizes the latent and the rotary key (dims 64 and 32 here, so groups of 32 fit):
    the cache shrinks to the packed size and decoding stays close to transformers' logits."""
    folder = checkpoint(hf_checkpoint, "deepseek_v2", {"q_lora_rank": None, "kv_lora_rank": 64, "qk_rope_head_dim": 32})
    model, _ = mlxinfer.load(folder, dtype="float32")
    ids = tokens()[:1]
    full = hf_logits(folder, ids)[0]
    cache = PromptCache.for_model(model, kv_bits=8)
    model(mx.array(ids[:, :24]), cache=cache.caches)
    steps = [np.array(model(mx.array(ids[:, t : t + 1]), cache=cache.caches))[0, 0] for t in range(24, ids.shape[1])]
    assert np.abs(np.stack(steps) - full[24:]).max() < 0.05
    packed = (64 + 32) * 8 // 8 + 2 * 4 * (64 + 32) // 32  # 8-bit values plus a float32 scale and bias per group of 32
    assert sum(c.bytes_per_token for c in cache.caches) == 2 * packed


def test_latent_cache_trims_rotates_and_saves(hf_checkpoint, tmp_path):
    """Speculative rollback (trim), a rotating cache that has not wrapped, and a
    saved-and-loaded cache all continue exactly like the uncut sequence."""
    model, _ = mlxinfer.load(checkpoint(hf_checkpoint, *VARIANTS["v3-grouped-k2"]), dtype="float32")
    ids = tokens(3)[:1]
    full = np.array(model(mx.array(ids)))
    cache = PromptCache(make_cache(model))
    model(mx.array(ids[:, :20]), cache=cache.caches)
    model(mx.array(ids[:, 20:24]), cache=cache.caches)
    cache.trim(4)
    np.testing.assert_allclose(np.array(model(mx.array(ids[:, 20:21]), cache=cache.caches))[:, 0], full[:, 20],
                               atol=TOL, rtol=0)
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "c.safetensors")
    np.testing.assert_allclose(np.array(model(mx.array(ids[:, 21:22]), cache=loaded.caches))[:, 0], full[:, 21],
                               atol=TOL, rtol=0)
    rotating = make_cache(model, max_kv_size=64)
    np.testing.assert_allclose(np.array(model(mx.array(ids), cache=rotating)), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["v2-q-lora-grouped", "v3-grouped-k2"])
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(hf_checkpoint, mlx_lm_quantized, name, bits):
    assert_matches_mlx_lm(mlx_lm_quantized(checkpoint(hf_checkpoint, *VARIANTS[name]), bits=bits, group_size=32), bits)


@pytest.mark.parametrize("name", ["v2-q-lora-grouped", "v3-grouped-k2"])
def test_converter_output_loads_in_mlx_lm(hf_checkpoint, tmp_path, name):
    """Our converter's quantized output of the HF checkpoint runs in mlx-lm with our logits."""
    from mlxinfer.convert import convert

    out = tmp_path / "converted"
    convert(checkpoint(hf_checkpoint, *VARIANTS[name]), out, quantize=True, bits=4, group_size=32, dtype="float32")
    assert_matches_mlx_lm(out, 4)
