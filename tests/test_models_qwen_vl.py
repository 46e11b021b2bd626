"""Qwen2.5-VL (and Qwen3-VL, at the end) against transformers on a random-weight checkpoint it builds (tiny vision tower
with windows and a full-attention block, tiny Qwen2 text model with M-RoPE): images
preprocessed by transformers' own Qwen2-VL image processor, float32 logits within 1e-4, M-RoPE
positions and delta equal to `get_rope_index`'s, greedy decoding through our caches (the CPU
fused layer and the per-op path) equal to transformers' `generate`, chunked prefill equal to
one chunk, and `convert -q` quantizing the language model while the vision tower stays float."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import perturb, train_tokenizer
from test_parity import TOL

import mlxinfer
from mlxinfer.models.cache import make_cache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.engine.prompt_file import load_prompt_cache, save_prompt_cache
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.kernels import decode_layer
from mlxinfer.models.vision import Pixels
from mlxinfer.engine.pool import prefix_copy

IMAGE, VIDEO, START, END = 500, 501, 502, 503  # above the trained tokenizer's ids
MERGE = 2
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
# 56-pixel windows are 2x2 merge blocks: an image of 3x4 blocks has windows of 4, 4, 2 and 2 blocks.
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=MERGE,
              temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1])


def build(folder: Path, family: str, text: dict, vision: dict):
    """transformers' random-weight model of `family` (its config and model class names' stem),
    saved with a tokenizer into `folder`."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END, initializer_range=0.08)
    config.text_config.initializer_range = config.vision_config.initializer_range = 0.08
    hf = getattr(transformers, f"{family}ForConditionalGeneration")(config).float().eval()
    perturb(hf, 0)
    hf.save_pretrained(folder)
    train_tokenizer(folder)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    build(folder, "Qwen2_5_VL", TEXT, VISION)
    return folder


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def model(checkpoint):
    return mlxinfer.load(checkpoint, dtype="float32")[0]


def pixels(width: int, height: int, seed: int, patch: int = 14) -> Pixels:
    """A synthetic picture through transformers' Qwen2-VL image processor (`patch`-pixel patches:
    Qwen3-VL's processor is the same with 16), as one Pixels."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    picture = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = Qwen2VLImageProcessorPil(patch_size=patch)(images=[picture], return_tensors="np")
    values = out["pixel_values"].astype(np.float32)
    grid = tuple(int(n) for n in out["image_grid_thw"][0])
    return Pixels(values, grid, grid[0] * grid[1] * grid[2] // MERGE**2, hashlib.sha256(values.tobytes()).hexdigest())


@pytest.fixture(scope="module")
def images() -> list[Pixels]:
    return [pixels(112, 84, 1), pixels(84, 56, 2)]


def prompt(images: list[Pixels]) -> list[int]:
    """Text, then each image as <|vision_start|> + its placeholders + <|vision_end|> and more text."""
    ids = [5, 6, 7]
    for i, im in enumerate(images):
        ids += [START] + [IMAGE] * im.tokens + [END] + [10 + i, 20 + i, 30 + i]
    return ids


def hf_inputs(ids: list[int], images: list[Pixels]) -> dict:
    tokens = torch.tensor([ids])
    inputs = {"input_ids": tokens, "mm_token_type_ids": (tokens == IMAGE).int()}
    if images:
        inputs["pixel_values"] = torch.tensor(np.concatenate([im.values for im in images]))
        inputs["image_grid_thw"] = torch.tensor([im.grid for im in images])
    return inputs


@pytest.mark.parametrize("count", [1, 2])
def test_logits_match_transformers(hf, model, images, count):
    ids = prompt(images[:count])
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, images[:count])).logits[0].numpy()
    ours = model(mx.array([ids]), embedded=model.embedded(ids, images[:count]))[0]
    np.testing.assert_allclose(np.array(ours), ref, atol=TOL, rtol=0)


def test_image_features_match_transformers(hf, model, images):
    """The vision tower alone (windows, full-attention block, merger), both images at once."""
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(np.concatenate([im.values for im in images])),
                                          torch.tensor([im.grid for im in images])).pooler_output
    np.testing.assert_allclose(np.array(model.encode_images(images)), torch.cat(ref).numpy(), atol=1e-5, rtol=0)


def test_positions_match_get_rope_index(hf, model, images):
    ids = prompt(images)
    inputs = hf_inputs(ids, images)
    ref, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    embedded = model.embedded(ids, images)
    np.testing.assert_array_equal(np.array(embedded.positions), ref[:, 0].numpy())
    assert embedded.position_delta == int(delta) != 0


def test_text_only_prompt_is_the_text_model(hf, model):
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, [])).logits[0].numpy()
    np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), ref, atol=TOL, rtol=0)
    embedded = model.embedded(ids, [])
    assert embedded.position_delta == 0
    np.testing.assert_allclose(np.array(model(mx.array([ids]), embedded=embedded)[0]), ref, atol=TOL, rtol=0)


def prefill(model, ids: list[int], images: list[Pixels], chunks: list[int]) -> tuple[list, mx.array]:
    """Our caches after prefilling `ids` in chunks of these sizes; the logits of every position."""
    embedded = model.embedded(ids, images)
    caches, out, at = make_cache(model), [], 0
    for n in chunks:
        out.append(model(mx.array([ids[at : at + n]]), cache=caches, embedded=embedded.slice(at, at + n))[0])
        at += n
    assert at == len(ids)
    return caches, mx.concatenate(out)


def test_chunked_prefill_matches_one_chunk(model, images):
    """Chunk boundaries inside both images' placeholder runs give the same logits as one chunk."""
    ids = prompt(images)
    first = 4 + images[0].tokens // 2  # inside the first image
    second = 4 + images[0].tokens + 4 + images[1].tokens // 2 - first  # inside the second
    _, whole = prefill(model, ids, images, [len(ids)])
    caches, chunked = prefill(model, ids, images, [first, second, len(ids) - first - second])
    np.testing.assert_allclose(np.array(chunked), np.array(whole), atol=TOL, rtol=0)
    assert {c.position_delta for c in caches} == {model.embedded(ids, images).position_delta}


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-layer", "per-op"])
def test_greedy_decoding_matches_transformers_generate(hf, model, images, fused, monkeypatch):
    """Prefill with the images, then decode through our caches at offset + delta: the tokens
    transformers' `generate` picks (it decodes at its own rope delta)."""
    ids = prompt(images)
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(ids, images), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    steps = []
    if not fused:
        monkeypatch.setattr(decode_layer, "available", lambda x: False)
    else:
        real = decode_layer.layer_in
        monkeypatch.setattr(decode_layer, "layer_in", lambda *a, **k: steps.append(1) or real(*a, **k))
    caches, logits = prefill(model, ids, images, [len(ids) - 5, 5])
    got = [int(mx.argmax(logits[-1]))]
    for _ in range(7):
        got.append(int(mx.argmax(model(mx.array([got[-1:]]), cache=caches)[0, -1])))
    assert got == ref
    assert bool(steps) == fused  # the fused layer took the decode steps (or was kept out)


def test_position_delta_survives_trim_copy_save_and_load(model, images, tmp_path):
    ids = prompt(images)
    delta = model.embedded(ids, images).position_delta
    caches, _ = prefill(model, ids, images, [len(ids)])
    cache = PromptCache(caches, ids)
    cache.trim(2)
    assert {c.position_delta for c in cache.caches} == {delta}
    assert {c.position_delta for c in prefix_copy(cache, len(ids) - 3).caches} == {delta}
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    assert {c.position_delta for c in load_prompt_cache(tmp_path / "c.safetensors").caches} == {delta}
    cache.reset()  # an empty cache starts a new prompt: text after it has no delta
    assert {c.position_delta for c in cache.caches} == {0}


def test_placeholders_that_do_not_fit_the_images_are_refused(model, images):
    ids = prompt(images[:1])
    with pytest.raises(InvalidOptionError, match="placeholder tokens"):
        model.embedded(ids[:-6], images[:1])
    with pytest.raises(InvalidOptionError, match="placeholder tokens"):
        model.embedded(ids, images)


def test_convert_quantizes_the_language_model_and_keeps_the_vision_tower_float(checkpoint, model, images, tmp_path):
    from mlxinfer.convert import convert

    out = tmp_path / "q4"
    convert(checkpoint, out, quantize=True, bits=8, group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    names = set(mx.load(str(next(out.glob("*.safetensors")))))
    assert "model.layers.0.self_attn.q_proj.scales" in names and "lm_head.scales" in names
    vision = {n for n in names if n.startswith("visual.")}
    assert vision and not any(n.endswith((".scales", ".biases")) for n in vision)
    quantized = mlxinfer.load(out, dtype="float32")[0]
    assert type(quantized.visual.blocks[0].attn.qkv).__name__ == "Linear"
    np.testing.assert_array_equal(np.array(quantized.encode_images(images)), np.array(model.encode_images(images)))
    ids = prompt(images)
    ours = quantized(mx.array([ids]), embedded=quantized.embedded(ids, images))[0, -1]
    ref = model(mx.array([ids]), embedded=model.embedded(ids, images))[0, -1]
    assert float(mx.abs(ours - ref).max()) < 0.05  # 8-bit language model, same picture


def test_convert_quantizes_the_vision_tower_when_asked(checkpoint, tmp_path):
    from mlxinfer.convert import convert

    convert(checkpoint, tmp_path / "all", quantize=True, bits=8, group_size=32, quantize_vision=True)
    names = set(mx.load(str(next((tmp_path / "all").glob("*.safetensors")))))
    assert "visual.blocks.0.attn.qkv.scales" in names
    assert "visual.patch_embed.proj.scales" not in names  # 1176 inputs: not whole groups of 32


# Qwen3-VL: learned positions resampled to the grid, no windows, deepstack features into the
# first two language-model layers, interleaved M-RoPE in a Qwen3 text model.
TEXT3 = dict(TEXT, num_hidden_layers=3, head_dim=16,
             rope_parameters={**TEXT["rope_parameters"], "mrope_interleaved": True})
VISION3 = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=MERGE,
               temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> tuple[Path, object]:
    """A random-weight Qwen3-VL checkpoint and transformers' model of it."""
    folder = tmp_path_factory.mktemp("qwen3_vl")
    return folder, build(folder, "Qwen3VL", TEXT3, VISION3)


@pytest.fixture(scope="module")
def qwen3(qwen3_folder):
    """(transformers' model, ours) of a random-weight Qwen3-VL checkpoint."""
    folder, hf = qwen3_folder
    return hf, mlxinfer.load(folder, dtype="float32")[0]


@pytest.fixture(scope="module")
def images3() -> list[Pixels]:
    return [pixels(128, 96, 3, patch=16), pixels(64, 96, 4, patch=16)]


def test_qwen3_vl_logits_match_transformers(qwen3, images3):
    hf, model = qwen3
    ids = prompt(images3)
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, images3)).logits[0].numpy()
    ours = model(mx.array([ids]), embedded=model.embedded(ids, images3))[0]
    np.testing.assert_allclose(np.array(ours), ref, atol=TOL, rtol=0)


def test_qwen3_vl_greedy_decoding_matches_transformers_generate(qwen3, images3):
    """Prefill in two chunks split inside the second image (deepstack features sliced with it),
    then decode at offset + delta."""
    hf, model = qwen3
    ids = prompt(images3)
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(ids, images3), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
    caches, logits = prefill(model, ids, images3, [len(ids) - 6, 6])
    got = [int(mx.argmax(logits[-1]))]
    for _ in range(5):
        got.append(int(mx.argmax(model(mx.array([got[-1:]]), cache=caches)[0, -1])))
    assert got == ref


# Qwen2-VL: Qwen2.5-VL's text model and M-RoPE sections, an older tower (no windows, LayerNorms,
# QuickGELU MLP of `mlp_ratio`, a LayerNorm in the merger; `embed_dim` its width, `hidden_size` the LM's).
VISION2 = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
               spatial_merge_size=MERGE, temporal_patch_size=2)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory) -> tuple[Path, object]:
    """A random-weight Qwen2-VL checkpoint and transformers' model of it."""
    folder = tmp_path_factory.mktemp("qwen2_vl")
    return folder, build(folder, "Qwen2VL", TEXT, VISION2)


@pytest.fixture(scope="module")
def qwen2(qwen2_folder):
    """(transformers' model, ours) of a random-weight Qwen2-VL checkpoint."""
    folder, hf = qwen2_folder
    return hf, mlxinfer.load(folder, dtype="float32")[0]


@pytest.fixture(scope="module")
def images2() -> list[Pixels]:
    """The first wider than Qwen2.5-VL's 112-pixel windows: Qwen2-VL attends over it whole."""
    return [pixels(252, 112, 5), pixels(84, 56, 2)]


def test_qwen2_vl_image_features_and_logits_match_transformers(qwen2, images2):
    hf, model = qwen2
    with torch.no_grad():
        features = hf.model.get_image_features(torch.tensor(np.concatenate([im.values for im in images2])),
                                               torch.tensor([im.grid for im in images2])).pooler_output
    np.testing.assert_allclose(np.array(model.encode_images(images2)), torch.cat(features).numpy(), atol=1e-5, rtol=0)
    ids = prompt(images2)
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, images2)).logits[0].numpy()
    ours = model(mx.array([ids]), embedded=model.embedded(ids, images2))[0]
    np.testing.assert_allclose(np.array(ours), ref, atol=TOL, rtol=0)


def test_qwen2_vl_greedy_decoding_matches_transformers_generate(qwen2, images2):
    """Prefill in two chunks split inside the second image, then decode at offset + delta."""
    hf, model = qwen2
    ids = prompt(images2)
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(ids, images2), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
    caches, logits = prefill(model, ids, images2, [len(ids) - 6, 6])
    got = [int(mx.argmax(logits[-1]))]
    for _ in range(5):
        got.append(int(mx.argmax(model(mx.array([got[-1:]]), cache=caches)[0, -1])))
    assert got == ref


def test_qwen3_vl_quantized_tower_logits_stay_near_transformers(qwen3_folder, images3, tmp_path):
    """Qwen3-VL's 1536-value patches are whole groups of 32, so `--quantize-vision` packs the patch
    embedding too (uint32 weight): the pixels must still go in as floats."""
    from mlxinfer.convert import convert

    folder, hf = qwen3_folder
    out = tmp_path / "all"
    convert(folder, out, quantize=True, bits=8, group_size=32, quantize_vision=True)
    assert "visual.patch_embed.proj.scales" in set(mx.load(str(next(out.glob("*.safetensors")))))
    model = mlxinfer.load(out, dtype="float32")[0]
    ids = prompt(images3)
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, images3)).logits[0].numpy()
    got = np.array(model(mx.array([ids]), embedded=model.embedded(ids, images3))[0])
    drift = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
    assert drift < 0.1, f"8 bits drifted {drift:.0%} from transformers' float model"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_model_loaded_on_one_thread_decodes_on_another(family, request):
    """A server loads its model on the main thread and runs it on its engine thread. An array the
    loaded model held unevaluated (M-RoPE's frequency table was one) is a graph on the loading
    thread's stream, which no other thread can run ("There is no Stream(cpu, 0) in current
    thread"): loaded afresh here, the model prefills with images and decodes on a worker thread,
    giving transformers' greedy tokens."""
    folder, hf, images = {
        "qwen2_vl": lambda: (*request.getfixturevalue("qwen2_folder"), request.getfixturevalue("images2")),
        "qwen2_5_vl": lambda: (request.getfixturevalue("checkpoint"), request.getfixturevalue("hf"),
                               request.getfixturevalue("images")),
        "qwen3_vl": lambda: (*request.getfixturevalue("qwen3_folder"), request.getfixturevalue("images3")),
    }[family]()
    model = mlxinfer.load(folder, dtype="float32")[0]
    ids = prompt(images)
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(ids, images), max_new_tokens=4, do_sample=False)[0, len(ids) :].tolist()

    def greedy() -> list[int]:
        caches, logits = prefill(model, ids, images, [len(ids) - 5, 5])
        got = [int(mx.argmax(logits[-1]))]
        for _ in range(3):
            got.append(int(mx.argmax(model(mx.array([got[-1:]]), cache=caches)[0, -1])))
        return got

    with ThreadPoolExecutor(1) as worker:
        assert worker.submit(greedy).result(timeout=300) == ref
