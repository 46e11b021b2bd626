"""OLMo 2 and OLMo 3 (norms after each sublayer, q/k norms over the whole projection; OLMo 3's
sliding layers, RoPE scaling on its full layers only) against transformers on random-weight
checkpoints: logits, chunked prefill, greedy decoding against teacher forcing, batching, the
prompt-cache pool and speculative decoding (family_checks); mlx-lm's quantized checkpoints;
llama.cpp's GGUF of each converted back."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from family_checks import (  # noqa: F401  (the test_ functions run here, on this module's `variant`)
    assert_llama_cpp_gguf_matches_transformers,
    real_vocab_checkpoint,
    test_batched_equals_alone,
    test_chunked_prefill_matches_transformers,
    test_greedy_matches_teacher_forcing,
    test_pool_reuse_equals_fresh,
    test_speculative_equals_plain,
)
from test_shard import can_launch, check, sharded  # noqa: F401  (can_launch: a fixture)
from test_parity import TOL, assert_matches_mlx_lm, assert_matches_transformers, hf_logits, tokens

import mlxinfer
from mlxinfer.models.cache import KVCache, RotatingKVCache, make_cache

SLIDING, FULL = "sliding_attention", "full_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
VARIANTS = {
    "olmo2": ("olmo2", {}),
    "olmo2-bias": ("olmo2", {"attention_bias": True, "num_key_value_heads": 4}),
    # transformers' default layout (every 4th layer full), a window shorter than the prompt,
    # YaRN on the full layers and another base on the sliding ones
    "olmo3": (
        "olmo3",
        {"num_hidden_layers": 4, "sliding_window": 8,
         "rope_parameters": {FULL: YARN, SLIDING: {"rope_type": "default", "rope_theta": 1000.0}}},
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint):
    folder = hf_checkpoint(VARIANTS[request.param][0], **VARIANTS[request.param][1])
    return request.param, folder, *mlxinfer.load(folder, dtype="float32")


def test_logits_match_transformers(variant):
    name, folder, model, _ = variant
    assert_matches_transformers(folder, model)
    windows = [layer.window for layer in model.layers]
    assert windows == ([8, 8, 8, None] if name == "olmo3" else [None, None])
    for layer, cache in zip(model.layers, make_cache(model)):
        assert type(cache) is (RotatingKVCache if layer.window else KVCache)


HUB_ROPE = {FULL: {**YARN, "rope_theta": 500000.0}, SLIDING: {"rope_type": "default", "rope_theta": 500000.0}}


@pytest.fixture(scope="module")
def olmo3_hub(hf_checkpoint, tmp_path_factory):
    """(an OLMo 3 checkpoint as transformers saves it, the same with its config as hub checkpoints
    have it: `rope_theta` and `rope_scaling` at the top, where mlx-lm reads them too). Equal
    bases: the hub's are 500000, transformers' default for a sliding layer."""
    folder = hf_checkpoint("olmo3", **{**VARIANTS["olmo3"][1], "rope_parameters": HUB_ROPE})
    hub = tmp_path_factory.mktemp("olmo3-hub") / "model"
    shutil.copytree(folder, hub)
    config = json.loads((hub / "config.json").read_text())
    del config["rope_parameters"]
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    (hub / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": scaling}))
    return folder, hub


@pytest.mark.parametrize("name, kv_heads", [("olmo3", 2), ("olmo2", 1)])
def test_two_ranks_equal_one_process(can_launch, hf_checkpoint, tmp_path, name, kv_heads):  # noqa: F811
    """The q/k norms span every head: split with them, their squares summed across the ranks; with
    one KV head (copied to both ranks) the k norm stays whole."""
    folder = hf_checkpoint(VARIANTS[name][0], **{**VARIANTS[name][1], "num_key_value_heads": kv_heads})
    check(sharded(folder, tmp_path, 2), folder)


def test_olmo3_hub_config_scales_the_full_layers_only(olmo3_hub):
    folder, hub = olmo3_hub
    ours = mlxinfer.load(hub, dtype="float32")[0]
    ids = tokens()
    np.testing.assert_allclose(np.array(ours(mx.array(ids))), hf_logits(folder, ids), atol=TOL, rtol=0)
    assert [layer.self_attn.rope.kind for layer in ours.layers] == ["default"] * 3 + ["yarn"]


def test_mlx_lm_quantized_checkpoints_match_mlx_lm(hf_checkpoint, mlx_lm_quantized, olmo3_hub):
    for folder in (hf_checkpoint(*VARIANTS["olmo2"][:1], **VARIANTS["olmo2"][1]), olmo3_hub[1]):
        assert_matches_mlx_lm(mlx_lm_quantized(folder, bits=4, group_size=32), 4)


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_llama_cpp_gguf_matches_transformers(llama_cpp, tmp_path, name):
    """llama.cpp writes both as `olmo2`, OLMo 3 with its window, sliding pattern, sliding base and
    the full layers' YaRN."""
    model_type, overrides = VARIANTS[name]
    src = real_vocab_checkpoint(tmp_path / "hf", model_type, overrides)
    config = assert_llama_cpp_gguf_matches_transformers(llama_cpp, src, tmp_path, "olmo2")
    assert config["model_type"] == name
