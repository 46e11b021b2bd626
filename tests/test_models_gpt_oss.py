"""gpt-oss against transformers 5 on random-weight checkpoints it builds: float32 logits over
a prompt longer than the sliding window and one prefill chunk, prefill in chunks plus decoding
through rotating (sliding layers) and growing (full layers) caches, greedy generation equal to
transformers' teacher-forced argmax, and family_checks' batched == alone, pool reuse == fresh
and speculative == plain; MXFP4 experts (the hub's `*_blocks`/`*_scales`) loaded as MLX's mxfp4
quantization, checked against the OCP MX spec decoded in numpy and against transformers' own
MXFP4 dequantization; the converter keeping them MXFP4 (GGUFs: test_convert_gpt_oss_gguf)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_hf_checkpoint
from family_checks import (  # noqa: F401  (the test_ functions run here, on this module's `variant`)
    test_batched_equals_alone,
    test_pool_reuse_equals_fresh,
    test_speculative_equals_plain,
)
from test_convert import tensors
from safetensors.numpy import load_file, save_file
from test_parity import TOL

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.models.cache import KVCache, RotatingKVCache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.models.moe import QuantizedSwitchLinear

torch = pytest.importorskip("torch")

WINDOW = 128  # gpt-oss's own sliding window
# Scaled-down shapes; the real settings otherwise: YaRN over 131072 positions from 4096,
# layers alternating sliding/full (transformers' default layer_types), 4 experts, top 2.
CONFIG = dict(
    num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
    sliding_window=WINDOW, max_position_embeddings=131072,
)
PROMPT = np.random.default_rng(7).integers(0, 500, size=(1, 600))  # > one 512-token prefill chunk, > the window
SINK_STD = 2.0  # sinks large enough to take a real share of each softmax
LIMIT = 0.3  # a SwiGLU clamp the random experts' activations cross
MXFP4_ERROR = 0.2  # relative error of 4-bit E2M1 codes with a power-of-two scale per 32 (about 0.1 on normals)


def build(folder: Path, overrides: dict, seed: int = 0) -> Path:
    """A transformers-built random checkpoint, its attention sinks redrawn large."""
    build_hf_checkpoint(folder, "gpt_oss", {**CONFIG, **overrides}, seed)
    file = folder / "model.safetensors"
    weights = load_file(file)
    rng = np.random.default_rng(seed)
    for name in [k for k in weights if k.endswith(".sinks")]:
        weights[name] = rng.normal(0, SINK_STD, weights[name].shape).astype(np.float32)
    save_file(weights, file, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        if name not in made:
            made[name] = build(tmp_path_factory.mktemp(name), overrides)
        return made[name]

    return make


@pytest.fixture(scope="module")
def folder(checkpoints) -> Path:
    return checkpoints("gpt_oss")


@pytest.fixture(scope="module")
def model(folder):
    return mlxinfer.load(folder, dtype="float32")[0]


@pytest.fixture(scope="module")
def variant(folder, model):
    """What family_checks' tests run on: (name, folder, model, tokenizer)."""
    return "gpt_oss", folder, model, mlxinfer.load_tokenizer(folder)


def hf_model(folder: Path, **options):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                **options).eval()


def hf_logits(folder: Path, ids: np.ndarray, model=None) -> np.ndarray:
    with torch.no_grad():
        return (model or hf_model(folder))(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def reference(folder) -> np.ndarray:
    return hf_logits(folder, PROMPT)


def test_logits_match_transformers(model, reference):
    assert np.abs(reference).max() > 0.1
    np.testing.assert_allclose(np.array(model(mx.array(PROMPT))), reference, atol=TOL, rtol=0)


def test_the_sinks_and_the_clamp_matter(checkpoints, model, reference):
    """Without its sinks our model misses transformers' logits; a clamp the activations cross
    changes transformers' logits, and ours follow it."""
    ids = PROMPT[:, :64]
    attn = model.layers[0].self_attn
    kept = attn.sinks
    attn.sinks = mx.zeros_like(kept)
    try:
        assert np.abs(np.array(model(mx.array(ids))) - reference[:, :64]).max() > 1e-2
    finally:
        attn.sinks = kept
    clamped = checkpoints("clamped", swiglu_limit=LIMIT, swiglu_alpha=1.2)
    ref = hf_logits(clamped, ids)
    assert np.abs(ref - hf_logits(clamped, ids, hf_model(checkpoints("gpt_oss")))).max() > 1e-2
    ours = mlxinfer.load(clamped, dtype="float32")[0]
    assert ours.layers[0].mlp.experts.glu.limit == LIMIT
    np.testing.assert_allclose(np.array(ours(mx.array(ids))), ref, atol=TOL, rtol=0)


def test_layers_alternate_sliding_and_full_with_their_caches(model):
    cache = PromptCache.for_model(model)
    assert [layer.window for layer in model.layers] == [WINDOW, None, WINDOW, None]
    for layer, c in zip(model.layers, cache.caches):
        if layer.window:
            assert isinstance(c, RotatingKVCache) and c.max_size == WINDOW
        else:
            assert type(c) is KVCache


def test_chunked_prefill_then_decoding_matches_transformers(model, reference):
    """512-token chunks (the engine's), then one token at a time past the window: the rotating
    caches of the sliding layers have overwritten their oldest entries by then."""
    cache, split = PromptCache.for_model(model), 560
    cache.prefill(model, PROMPT[0, : split - 1].tolist())
    steps = [model(mx.array(PROMPT[:, t : t + 1]), cache=cache.caches) for t in range(split - 1, PROMPT.shape[1])]
    got = np.array(mx.concatenate(steps, axis=1))
    np.testing.assert_allclose(got, reference[:, split - 1 :], atol=TOL, rtol=0)


def test_a_quantized_kv_cache_keeps_the_sinks(checkpoints):
    """8-bit K/V (read back as floats for the sink-aware kernel) past the window: transformers'
    logits up to the cache's rounding, far closer than the same decode without the sinks."""
    folder = checkpoints("kv8", head_dim=32, num_hidden_layers=2)  # K/V groups of 32
    model, ids = mlxinfer.load(folder, dtype="float32")[0], PROMPT[:, :200]
    reference, split = hf_logits(folder, ids), 150

    def error(sinks: bool) -> float:
        kept = [layer.self_attn.sinks for layer in model.layers]
        for layer in model.layers if not sinks else ():
            layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
        cache = PromptCache.for_model(model, kv_bits=8, kv_group_size=32)
        cache.prefill(model, ids[0, : split - 1].tolist())
        steps = [model(mx.array(ids[:, t : t + 1]), cache=cache.caches) for t in range(split - 1, ids.shape[1])]
        for layer, s in zip(model.layers, kept):
            layer.self_attn.sinks = s
        return np.abs(np.array(mx.concatenate(steps, axis=1)) - reference[:, split - 1 :]).max()

    assert isinstance(PromptCache.for_model(model, kv_bits=8).caches[0], RotatingKVCache)
    with_sinks = error(sinks=True)
    assert with_sinks < 0.05 and with_sinks < error(sinks=False) / 10


def test_greedy_generation_is_transformers_teacher_forced_argmax(folder, model):
    tok = mlxinfer.load_tokenizer(folder)
    prompt = PROMPT[0].tolist()
    out = [c.token for c in mlxinfer.stream_generate(model, tok, prompt, max_tokens=24, ignore_eos=True)
           if c.token is not None]
    assert len(out) == 24
    logits = hf_logits(folder, np.array([prompt + out[:-1]]))[0, len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == out


# --- MXFP4 experts, as the hub ships them ---------------------------------------------------------

# OCP Microscaling Formats (MX) v1.0, FP4 E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
HF_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def ocp_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., out, in] floats from blocks [..., out, in/32, 16] and E8M0 scales [..., out, in/32]:
    each byte holds two E2M1 codes, the earlier element in the low nibble; a block of 32 shares
    the scale 2^(e - 127)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    values = values * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*values.shape[:-2], -1)


def to_mxfp4(src: Path, dst: Path, seed: int = 1) -> Path:
    """`src` with every expert matrix replaced by random MXFP4 codes and scales, stored as the hub
    stores them (`*_blocks` uint8 [E, out, in/32, 16], `*_scales` uint8 [E, out, in/32]) under a
    `quantization_config` naming mxfp4, the RoPE settings also under `rope_scaling` as in the
    hub's config.json (mlx-lm reads that key only)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = weights.pop(name).shape
        weights[f"{name}_blocks"] = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
        weights[f"{name}_scales"] = rng.integers(120, 125, (experts, outputs, inputs // 32), dtype=np.uint8)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}  # also as the hub writes it
    config.update(quantization_config=HF_MXFP4, rope_scaling=rope)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def mxfp4(folder, tmp_path_factory) -> Path:
    return to_mxfp4(folder, tmp_path_factory.mktemp("mxfp4") / "model")


def hf_mxfp4_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """transformers loading the MXFP4 checkpoint itself (its own dequantization, on the CPU)."""
    from transformers import Mxfp4Config

    return hf_logits(folder, ids, hf_model(folder, quantization_config=Mxfp4Config(dequantize=True)))


def test_mxfp4_experts_stay_mxfp4_and_decode_as_the_spec_says(mxfp4):
    model = mlxinfer.load(mxfp4)[0]
    stored = load_file(mxfp4 / "model.safetensors")
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}.mlp.experts"
        fused = {p: ocp_mxfp4(stored[f"{prefix}.{p}_blocks"], stored[f"{prefix}.{p}_scales"])
                 for p in ("gate_up_proj", "down_proj")}
        expected = {"gate_proj": fused["gate_up_proj"][:, 0::2], "up_proj": fused["gate_up_proj"][:, 1::2],
                    "down_proj": fused["down_proj"]}
        for name, want in expected.items():
            proj = layer.mlp.experts[name]
            assert isinstance(proj, QuantizedSwitchLinear)
            assert (proj.mode, proj.bits, proj.group_size) == ("mxfp4", 4, 32)
            assert proj.weight.dtype == mx.uint32 and proj.scales.dtype == mx.uint8 and "biases" not in proj
            got = mx.dequantize(proj.weight, proj.scales, None, group_size=32, bits=4, mode="mxfp4")
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want.astype(np.float32))


@pytest.fixture(scope="module")
def mxfp4_reference(mxfp4) -> np.ndarray:
    return hf_mxfp4_logits(mxfp4, PROMPT)


def test_mxfp4_logits_match_transformers(mxfp4, mxfp4_reference):
    ours = mlxinfer.load(mxfp4)[0]
    ref = mxfp4_reference
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(np.array(ours(mx.array(PROMPT))), ref, atol=TOL, rtol=0)
    cache = PromptCache.for_model(ours)
    cache.prefill(ours, PROMPT[0, :-8].tolist())
    steps = [ours(mx.array(PROMPT[:, t : t + 1]), cache=cache.caches) for t in range(PROMPT.shape[1] - 8, 600)]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)), ref[:, -8:], atol=TOL, rtol=0)


def mlx_lm_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    import mlx_lm

    return np.array(mlx_lm.load(str(folder))[0](mx.array(ids)))


def test_converter_keeps_mxfp4_as_stored(mxfp4, mxfp4_reference, tmp_path):
    """The experts come out bit for bit as the hub stored them (nibbles re-read as uint32 words,
    gate and up rows apart), the rest as floats; mlx-lm reads the output as it reads the source."""
    out = tmp_path / "out"
    report = convert(mxfp4, out)
    written, stored = tensors(out), load_file(mxfp4 / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert "quant_method" not in config["quantization_config"]
    for i in range(CONFIG["num_hidden_layers"]):
        hub, ours = f"model.layers.{i}.mlp.experts", f"model.layers.{i}.mlp.experts"
        rows = {"gate_proj": ("gate_up_proj", slice(0, None, 2)), "up_proj": ("gate_up_proj", slice(1, None, 2)),
                "down_proj": ("down_proj", slice(None))}
        for proj, (fused, part) in rows.items():
            blocks = stored[f"{hub}.{fused}_blocks"][:, part]
            words = np.ascontiguousarray(blocks).reshape(*blocks.shape[:2], -1).view("<u4")
            np.testing.assert_array_equal(np.array(written[f"{ours}.{proj}.weight"]), words)
            np.testing.assert_array_equal(np.array(written[f"{ours}.{proj}.scales"]),
                                          stored[f"{hub}.{fused}_scales"][:, part])
            assert f"{ours}.{proj}.biases" not in written
    assert "mxfp4" in "\n".join(report.lines())
    ids = PROMPT[:, :160]
    ours = np.array(mlxinfer.load(out)[0](mx.array(ids)))
    np.testing.assert_allclose(ours, mxfp4_reference[:, :160], atol=TOL, rtol=0)
    # mlx-lm's YaRN ignores gpt-oss's `truncate: false`, so it is compared with itself: the
    # output reads in mlx-lm as the hub's folder does.
    np.testing.assert_allclose(mlx_lm_logits(out, ids), mlx_lm_logits(mxfp4, ids), atol=TOL, rtol=0)


def test_converter_dequantizes_mxfp4_and_quantizes_floats_to_it(mxfp4, mxfp4_reference, folder, reference, tmp_path):
    floats = tmp_path / "floats"
    convert(mxfp4, floats, dequantize=True, dtype="float32")
    assert "quantization" not in json.loads((floats / "config.json").read_text())
    assert all(v.dtype == mx.float32 for v in tensors(floats).values())
    ids = PROMPT[:, :160]
    np.testing.assert_allclose(np.array(mlxinfer.load(floats)[0](mx.array(ids))), mxfp4_reference[:, :160],
                               atol=TOL, rtol=0)
    requantized = tmp_path / "mxfp4"
    convert(folder, requantized, q_mode="mxfp4")  # transformers' float experts to MLX's mxfp4
    written, source = tensors(requantized), load_file(folder / "model.safetensors")
    for i in range(CONFIG["num_hidden_layers"]):
        fused = source[f"model.layers.{i}.mlp.experts.gate_up_proj"].swapaxes(1, 2)  # [E, 2I, hidden]
        floats = {"gate_proj": fused[:, 0::2], "up_proj": fused[:, 1::2],
                  "down_proj": source[f"model.layers.{i}.mlp.experts.down_proj"].swapaxes(1, 2)}
        for proj, want in floats.items():
            words = np.array(written[f"model.layers.{i}.mlp.experts.{proj}.weight"])
            scales = np.array(written[f"model.layers.{i}.mlp.experts.{proj}.scales"])
            got = ocp_mxfp4(words.view(np.uint8).reshape(*scales.shape, 16), scales)
            assert np.linalg.norm(got - want) < MXFP4_ERROR * np.linalg.norm(want), (i, proj)
    model = mlxinfer.load(requantized)[0]
    assert model.layers[0].mlp.experts.down_proj.mode == "mxfp4"

