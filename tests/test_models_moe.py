"""Sparse MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, mlx-lm-quantized
checkpoints against mlx-lm, and our converter's quantized MoE output loaded by mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_parity import TOL, hf_logits, ours_incremental, tokens

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.models.moe import QuantizedSwitchLinear

QWEN = {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
VARIANTS = {
    "mixtral-k1": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1}),
    "mixtral-k2": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", dict(QWEN, shared_expert_intermediate_size=48)),
    "qwen2_moe-norm-topk": ("qwen2_moe", dict(QWEN, shared_expert_intermediate_size=48, norm_topk_prob=True)),
    # layer 0 dense (mlp_only_layers), layer 1 sparse, layer 2 dense (off the decoder_sparse_step rhythm)
    "qwen2_moe-dense-layers": (
        "qwen2_moe",
        dict(QWEN, shared_expert_intermediate_size=48, num_hidden_layers=3, mlp_only_layers=[0], decoder_sparse_step=2),
    ),
    "qwen3_moe": ("qwen3_moe", dict(QWEN, head_dim=32, norm_topk_prob=True)),
}


def checkpoint(hf_checkpoint, name: str):
    model_type, overrides = VARIANTS[name]
    return hf_checkpoint(model_type, **overrides)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint):
    folder = checkpoint(hf_checkpoint, request.param)
    return request.param, folder, mlxinfer.load(folder, dtype="float32")[0]


def test_logits_match_transformers(variant):
    name, folder, model = variant
    ids = tokens()
    ref = hf_logits(folder, ids)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, atol=TOL, rtol=0)
    sparse = [type(layer.mlp if "mlp" in layer else layer.block_sparse_moe).__name__ for layer in model.layers]
    assert sparse == (["SwiGLU", "SparseMoE", "SwiGLU"] if "dense" in name else ["SparseMoE"] * len(sparse))


def test_cached_decoding_matches_full_sequence(variant):
    """Chunks route many rows at once (sorted by expert), single tokens a few (unsorted)."""
    _, _, model = variant
    ids = tokens(1)
    full = np.array(model(mx.array(ids)))
    np.testing.assert_allclose(ours_incremental(model, ids, chunks=[20, 3]), full, atol=TOL, rtol=0)


def fuse_experts(src, dst, num_experts: int, names: dict[str, str]) -> None:
    """Rewrite a per-expert checkpoint in transformers 5's fused in-memory layout
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], router `mlp.gate`)."""
    weights = load_file(src / "model.safetensors")
    out = {}
    layers = {k.split(".experts.")[0] for k in weights if ".experts." in k}
    for block in layers:
        stacked = {
            proj: np.stack([weights.pop(f"{block}.experts.{e}.{name}.weight") for e in range(num_experts)])
            for proj, name in names.items()
        }
        fused = block.replace("block_sparse_moe", "mlp")
        out[f"{fused}.experts.gate_up_proj"] = np.concatenate([stacked["gate"], stacked["up"]], axis=1)
        out[f"{fused}.experts.down_proj"] = stacked["down"]
    out.update({k.replace("block_sparse_moe", "mlp"): v for k, v in weights.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name,names",
    [
        ("mixtral-k2", {"gate": "w1", "up": "w3", "down": "w2"}),
        ("qwen2_moe", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    ],
)
def test_fused_expert_layout_loads(hf_checkpoint, copy_checkpoint, name, names):
    folder = checkpoint(hf_checkpoint, name)
    fused = copy_checkpoint(folder)
    fuse_experts(folder, fused, 4, names)
    ids = tokens()
    ours = mlxinfer.load(fused, dtype="float32")[0]
    np.testing.assert_allclose(np.array(ours(mx.array(ids))), hf_logits(folder, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["mixtral-k2", "qwen2_moe", "qwen3_moe"])
def test_mlx_lm_quantized_matches_mlx_lm(hf_checkpoint, mlx_lm_quantized, name):
    import mlx_lm

    folder = mlx_lm_quantized(checkpoint(hf_checkpoint, name), bits=4, group_size=32)
    ids = mx.array(tokens(2))
    ours = mlxinfer.load(folder)[0]
    assert any(isinstance(m, QuantizedSwitchLinear) for _, m in ours.named_modules())
    ref = np.array(mlx_lm.load(str(folder))[0](ids))
    np.testing.assert_allclose(np.array(ours(ids)), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["mixtral-k2", "qwen2_moe", "qwen3_moe"])  # mlx-lm has no dense MoE layers
def test_converter_quantizes_experts_and_mlx_lm_loads_it(hf_checkpoint, mlx_lm_quantized, tmp_path, name):
    import mlx_lm

    src, out = checkpoint(hf_checkpoint, name), tmp_path / "q4"
    convert(src, out, quantize=True, bits=4, group_size=32)
    ours, ref = tensors(out), tensors(mlx_lm_quantized(src, bits=4, group_size=32))
    assert sorted(ours) == sorted(ref)
    # mlx-lm keeps Qwen3-MoE's router at 8 bits; every other tensor is bit for bit the same.
    for key in (k for k in ref if not (name == "qwen3_moe" and ".mlp.gate." in k)):
        assert mx.array_equal(ours[key], ref[key]).item(), key
    assert all(ours[k].ndim == 3 and ours[k].dtype == mx.uint32 for k in ours if ".switch_mlp." in k and "weight" in k)
    ids = mx.array(tokens(3))
    expected = np.array(mlx_lm.load(str(out))[0](ids))
    np.testing.assert_allclose(np.array(mlxinfer.load(out)[0](ids)), expected, atol=TOL, rtol=0)


def tensors(folder) -> dict[str, mx.array]:
    return {k: v for f in folder.glob("*.safetensors") for k, v in mx.load(str(f)).items()}


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tokens_in", [3, 40])  # 6 routed rows (gather path) and 80 (sorted, grouped by expert)
def test_switch_glu_matches_numpy(quantized, tokens_in):
    import mlx.nn as nn

    from mlxinfer.models.moe import SwitchGLU

    rng = np.random.default_rng(0)
    glu = SwitchGLU(64, 32, 4)
    for proj in (glu.gate_proj, glu.up_proj, glu.down_proj):
        proj.weight = mx.array(rng.normal(0, 0.1, proj.weight.shape).astype(np.float32))
    if quantized:
        nn.quantize(glu, group_size=32, bits=4)

    def weight(proj) -> np.ndarray:
        if not quantized:
            return np.array(proj.weight, dtype=np.float64)
        return np.array(mx.dequantize(proj.weight, proj.scales, proj.biases, group_size=32, bits=4), np.float64)

    g, u, d = (weight(p) for p in (glu.gate_proj, glu.up_proj, glu.down_proj))
    x = rng.normal(size=(1, tokens_in, 64)).astype(np.float32)
    idx = np.stack([rng.permutation(4)[:2] for _ in range(tokens_in)])[None].astype(np.uint32)
    out = np.array(glu(mx.array(x), mx.array(idx)))
    for t in range(tokens_in):
        for j, e in enumerate(idx[0, t]):
            gate, up = g[e] @ x[0, t], u[e] @ x[0, t]
            expected = d[e] @ (gate / (1 + np.exp(-gate)) * up)
            np.testing.assert_allclose(out[0, t, j], expected, atol=1e-4, rtol=0)
