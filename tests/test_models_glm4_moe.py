"""GLM-4.5 / 4.5-Air (partial RoPE, q/k/v bias, optional q/k norm, DeepSeek-V3's sigmoid routing
with shared experts after the first dense layers, multi-token-prediction layers in the
checkpoint) against transformers on random-weight checkpoints: logits, chunked prefill, greedy
decoding against teacher forcing, batching, the prompt-cache pool and speculative decoding
(family_checks); mlx-lm's quantized checkpoint; two ranks equal to one process; llama.cpp's
GGUF of it converted back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
from test_models_deepseek import steer_correction_bias
from test_parity import assert_matches_mlx_lm, assert_matches_transformers, tokens
from test_shard import can_launch, check, sharded  # noqa: F401  (can_launch: a fixture)

import mlxinfer

MOE = {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "n_shared_experts": 1, "attention_bias": True, "head_dim": 32}
VARIANTS = {
    # GLM-4.5's shape: q/k norm, expert groups, scaled routing weights; RoPE on 16 of 32 dims
    "glm4.5": dict(MOE, use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    # GLM-4.5-Air's: no q/k norm, one group, weights renormalised; and its multi-token-prediction layer
    "glm4.5-air": dict(MOE, use_qk_norm=False, norm_topk_prob=True, num_nextn_predict_layers=1),
}


def add_mtp_layer(folder: Path) -> None:
    """Append a multi-token-prediction layer as GLM's checkpoints store it, past the last layer
    (`model.layers.{num_hidden_layers}`: a decoder layer plus eh_proj, enorm, hnorm and
    shared_head.norm); transformers ignores it, and so must we."""
    config = json.loads((folder / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    file = folder / "model.safetensors"
    weights, meta = mx.load(str(file), return_metadata=True)
    last = f"model.layers.{n - 1}."
    extra = {k.replace(last, f"model.layers.{n}."): v for k, v in weights.items() if k.startswith(last)}
    rng = np.random.default_rng(11)
    extra[f"model.layers.{n}.eh_proj.weight"] = mx.array(rng.normal(0, 0.1, (hidden, 2 * hidden)).astype(np.float32))
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"model.layers.{n}.{norm}.weight"] = mx.ones((hidden,))
    weights.update(extra)
    mx.eval(weights)  # read everything before overwriting the file it maps
    mx.save_safetensors(str(file), weights, metadata=meta)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint, tmp_path_factory):
    """(name, folder, model, tokenizer): the checkpoint with a non-zero routing bias, the Air
    variant's with its prediction layer, and the top-level keys hub configs have (mlx-lm reads them)."""
    folder = tmp_path_factory.mktemp(request.param) / "model"
    shutil.copytree(hf_checkpoint("glm4_moe", **VARIANTS[request.param]), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5, "rope_scaling": None}))
    steer_correction_bias(folder)
    if VARIANTS[request.param].get("num_nextn_predict_layers"):
        add_mtp_layer(folder)
    return request.param, folder, *mlxinfer.load(folder, dtype="float32")


def test_logits_match_transformers_and_routing_follows_the_bias(variant):
    name, folder, model, _ = variant
    assert_matches_transformers(folder, model)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SwiGLU", "V3MoE", "V3MoE"]
    assert model.layers[0].self_attn.rope.dims == 16 and ("q_norm" in model.layers[0].self_attn) == (name == "glm4.5")
    ids = mx.array(tokens())
    before = np.array(model(ids))
    gate = model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias
    gate.e_score_correction_bias = mx.zeros_like(bias)
    try:
        assert np.abs(np.array(model(ids)) - before).max() > 1e-3
    finally:
        gate.e_score_correction_bias = bias


def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(variant, mlx_lm_quantized):
    assert_matches_mlx_lm(mlx_lm_quantized(variant[1], bits=4, group_size=32), 4)


def test_two_ranks_equal_one_process(can_launch, variant, tmp_path):  # noqa: F811
    """Heads, the dense layer's MLP, every expert's and the shared expert's columns split over two
    ranks; routers whole."""
    check(sharded(variant[1], tmp_path, 2), variant[1])


def test_llama_cpp_gguf_matches_transformers(llama_cpp, tmp_path):
    """llama.cpp counts the prediction layer in `block_count` (and stores it): left out here."""
    src = real_vocab_checkpoint(tmp_path / "hf", "glm4_moe", VARIANTS["glm4.5-air"],
                                {3: "[gMASK]", 4: "<|user|>", 5: "<|observation|>"})  # what its converter asks for
    steer_correction_bias(src)
    add_mtp_layer(src)
    config = assert_llama_cpp_gguf_matches_transformers(llama_cpp, src, tmp_path, "glm4moe")
    assert config["num_hidden_layers"] == 3 and config["num_nextn_predict_layers"] == 1
