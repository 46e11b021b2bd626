"""Gemma 3 with images: a random-weight Gemma3ForConditionalGeneration built by transformers, pixels
from transformers' own Gemma3ImageProcessor; our logits with the images in equal transformers'
(float32, token_type_ids marking the image tokens), the greedy continuation through our caches
equals transformers' generate, and the image tokens attend to their whole image (a causal-only
mask over them gives other logits)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image
from test_parity import TOL

from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.loading.checkpoint import load_model
from mlxinfer.models.vision import Embedded, Pixels

VOCAB, BOI, EOI, IMAGE = 300, 290, 291, 292
IMAGE_TOKENS = 16  # a 4x4 grid pooled from SigLIP's 8x8 patches (kernel 2)
WINDOW = 8  # below the image's 16 tokens: the window also bounds what an image token sees of its own image
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "max_position_embeddings": 256,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    "initializer_range": 0.08,
}
VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 56,
    "patch_size": 7,
    "vision_use_head": False,
}


def perturb(model) -> None:
    """Non-trivial norms and biases (Gemma's (1 + w) RMSNorms get w ~ 0.1 noise, LayerNorms 1 + noise), and
    a projector matrix: transformers starts it at zero, which would hide the images from the text model."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            if name.endswith("mm_input_projection_weight"):
                p.copy_(noise * 3)
            elif "vision_tower" in name and "norm" in name:
                p.copy_(noise + (1.0 if name.endswith("weight") else 0.0))
            elif "norm" in name or name.endswith("bias"):
                p.copy_(noise)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=IMAGE_TOKENS,
                          boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    perturb(model)
    folder = tmp_path_factory.mktemp("gemma3-vision")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32,
                                                          attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(checkpoint, dtype="float32")


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    """A synthetic photo: smooth gradients plus noise, of an aspect the processor must resize."""
    rng = np.random.default_rng(seed)
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (h + w)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8))


def pixels(*images: Image.Image) -> np.ndarray:
    """pixel_values [N, 3, 56, 56] from transformers' Gemma 3 image processor."""
    from transformers import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    return processor(images=list(images), return_tensors="np")["pixel_values"].astype(np.float32)


def prompt(*texts: list[int]) -> list[int]:
    """Text runs with an image between each two, expanded as Gemma3Processor does: BOI, the image
    tokens, EOI (the processor's surrounding blank lines are text tokens like any other)."""
    ids = list(texts[0])
    for text in texts[1:]:
        ids += [BOI, *[IMAGE] * IMAGE_TOKENS, EOI, *text]
    return ids


def as_pixels(values: np.ndarray) -> list[Pixels]:
    return [Pixels(v, None, IMAGE_TOKENS, f"image-{i}") for i, v in enumerate(values)]


def hf_logits(hf, ids: list[int], values: np.ndarray, bidirectional: bool = True) -> np.ndarray:
    types = torch.tensor([[int(t == IMAGE) for t in ids]])
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(values),
                 token_type_ids=types if bidirectional else None)
    return out.logits[0].numpy()


def chunks(ids: list[int], embedded: Embedded, step: int) -> list[tuple[int, int]]:
    """Prefill chunks of about `step` tokens that never cut an image (as the engine cuts them)."""
    bounds, start = [], 0
    while start < len(ids):
        end = min(start + step, len(ids))
        for s, e in embedded.bidirectional:
            if s < end < e:
                end = e
        bounds.append((start, end))
        start = end
    return bounds


def prefill(model, ids: list[int], embedded: Embedded, step: int) -> tuple[PromptCache, np.ndarray]:
    """Our logits of the prompt, run chunk by chunk through per-layer caches."""
    cache = PromptCache.for_model(model)
    logits = []
    for start, end in chunks(ids, embedded, step):
        logits.append(np.array(model(mx.array(ids[start:end])[None], cache.caches, embedded.slice(start, end))[0]))
    return cache, np.concatenate(logits)


TWO = prompt([2, 10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20, 21, 22], [23, 24, 25, 26, 27])


def test_logits_with_two_images_match_transformers(ours, hf):
    values = pixels(picture(0, (40, 70)), picture(1, (90, 60)))
    embedded = ours.embedded(TWO, as_pixels(values))
    assert embedded.bidirectional == ((8, 24), (33, 49)) and embedded.positions is None
    whole = np.array(ours(mx.array(TWO)[None], embedded=embedded)[0])
    np.testing.assert_allclose(whole, hf_logits(hf, TWO, values), atol=TOL, rtol=0)
    _, chunked = prefill(ours, TWO, embedded, step=12)  # later chunks start past the sliding window
    np.testing.assert_allclose(chunked, whole, atol=TOL, rtol=0)


def test_image_tokens_attend_to_their_whole_image(ours, hf):
    """Transformers' causal-only logits over the same inputs differ far beyond the tolerance, so
    matching the bidirectional ones (above, and here for one image) is what tells the masks apart."""
    ids = prompt([2, 30, 31], [32, 33, 34])
    values = pixels(picture(2, (56, 56)))
    ref, causal = hf_logits(hf, ids, values), hf_logits(hf, ids, values, bidirectional=False)
    assert np.abs(ref - causal).max() > 100 * TOL
    got = np.array(ours(mx.array(ids)[None], embedded=ours.embedded(ids, as_pixels(values)))[0])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_greedy_continuation_matches_transformers_generate(ours, hf):
    """Decoding after the images runs the text model over the cached K/V: the same tokens as
    transformers' generate, and each step's logits those of transformers' pass over the whole sequence."""
    values = pixels(picture(3, (64, 48)), picture(4, (48, 64)))
    embedded = ours.embedded(TWO, as_pixels(values))
    cache, logits = prefill(ours, TWO, embedded, step=20)
    steps = 10
    rows = [logits[-1]]
    tokens = [int(np.argmax(rows[-1]))]
    for _ in range(steps - 1):
        rows.append(np.array(cache.run(ours, [tokens[-1]])[-1]))
        tokens.append(int(np.argmax(rows[-1])))
    full = hf_logits(hf, TWO + tokens[:-1], values)
    np.testing.assert_allclose(np.stack(rows), full[len(TWO) - 1 :], atol=TOL, rtol=0)
    types = torch.tensor([[int(t == IMAGE) for t in TWO]])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([TWO]), pixel_values=torch.tensor(values), token_type_ids=types,
                          max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert tokens == out[0, len(TWO):].tolist()


def test_a_model_loaded_on_one_thread_decodes_on_another(checkpoint, hf):
    """A server loads its model on the main thread and runs it on its engine thread, where an array
    the model held unevaluated could not run (it is a graph on the loading thread's stream): loaded
    afresh here, the model prefills with images and decodes on a worker thread, giving
    transformers' greedy tokens (the Qwen-VL families' test in test_models_qwen_vl)."""
    model = load_model(checkpoint, dtype="float32")
    values = pixels(picture(3, (64, 48)), picture(4, (48, 64)))
    steps = 4

    def greedy() -> list[int]:
        cache, logits = prefill(model, TWO, model.embedded(TWO, as_pixels(values)), step=20)
        tokens = [int(np.argmax(logits[-1]))]
        for _ in range(steps - 1):
            tokens.append(int(np.argmax(np.array(cache.run(model, [tokens[-1]])[-1]))))
        return tokens

    types = torch.tensor([[int(t == IMAGE) for t in TWO]])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([TWO]), pixel_values=torch.tensor(values), token_type_ids=types,
                          max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    with ThreadPoolExecutor(1) as worker:
        assert worker.submit(greedy).result(timeout=300) == out[0, len(TWO):].tolist()


def test_another_image_changes_the_logits(ours):
    ids = prompt([2, 30, 31], [32, 33, 34])
    a, b = (np.array(ours(mx.array(ids)[None], embedded=ours.embedded(ids, as_pixels(pixels(picture(s, (56, 56))))))[0])
            for s in (5, 6))
    assert np.abs(a[-1] - b[-1]).max() > 100 * TOL


def test_text_without_images_is_the_text_model(ours, hf):
    ids = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.array(ours(mx.array(ids)[None])[0]), ref, atol=TOL, rtol=0)
    embedded = ours.embedded(ids, [])
    assert embedded.bidirectional == ()
    np.testing.assert_allclose(np.array(ours(mx.array(ids)[None], embedded=embedded)[0]), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", ["hub", "mlx-conv"])
def test_other_tower_layouts_load(checkpoint, ours, tmp_path, layout):
    """The hub's `vision_tower.vision_model.` names, and an MLX converter's [out, p, p, C] patch kernel."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    if layout == "hub":
        tensors = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    else:
        name = "vision_tower.embeddings.patch_embedding.weight"
        tensors[name] = np.ascontiguousarray(tensors[name].transpose(0, 2, 3, 1))
    save_file(tensors, file, metadata={"format": "pt"})
    ids = prompt([2, 30], [31])
    px = as_pixels(pixels(picture(7, (56, 56))))
    model = load_model(folder, dtype="float32")
    np.testing.assert_array_equal(np.array(model(mx.array(ids)[None], embedded=model.embedded(ids, px))),
                                  np.array(ours(mx.array(ids)[None], embedded=ours.embedded(ids, px))))


def test_bad_image_inputs_are_refused(ours):
    from mlxinfer.base.errors import InvalidOptionError

    px = as_pixels(pixels(picture(8, (56, 56))))
    with pytest.raises(InvalidOptionError, match="image tokens for 1 image"):
        ours.embedded([2, BOI, IMAGE, IMAGE, EOI], px)
    with pytest.raises(InvalidOptionError, match="not consecutive"):
        ours.embedded([2, *[IMAGE] * 8, 3, *[IMAGE] * 8], px)
    with pytest.raises(InvalidOptionError, match="3x56x56 pixel values"):
        ours.encode_images([Pixels(np.zeros((3, 28, 28), np.float32), None, IMAGE_TOKENS, "small")])


def test_config_without_a_square_token_grid_is_refused(checkpoint, tmp_path):
    from mlxinfer.base.errors import ConfigError
    from mlxinfer.models import build_model

    config = json.loads((checkpoint / "config.json").read_text())
    with pytest.raises(ConfigError, match="mm_tokens_per_image"):
        build_model({**config, "mm_tokens_per_image": 12})


def test_canonical_config_is_the_text_model(checkpoint):
    """A tensor-sharded rank builds from `canonical_config`: the text model, the tower's tensors dropped
    (sharding's rules would cut its projections as if they were the text model's)."""
    from safetensors.numpy import load_file

    from mlxinfer.models import build_model, canonical_config

    model = build_model(canonical_config(json.loads((checkpoint / "config.json").read_text())))
    assert "vision_tower" not in model and model.image_token_id is None
    kept = model.sanitize({k: mx.array(v) for k, v in load_file(checkpoint / "model.safetensors").items()})
    assert kept and not any(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in kept)


@pytest.mark.parametrize("quantize_vision", [False, True])
def test_convert_keeps_the_tower_float_unless_asked(checkpoint, ours, tmp_path, quantize_vision):
    from conftest import train_tokenizer
    from safetensors.numpy import load_file

    from mlxinfer.convert import convert

    src = tmp_path / "src"
    shutil.copytree(checkpoint, src)
    train_tokenizer(src)
    out = tmp_path / "q8"
    convert(src, out, quantize=True, bits=8, group_size=32, quantize_vision=quantize_vision)
    names = set().union(*(load_file(f).keys() for f in out.glob("*.safetensors")))
    assert "model.layers.0.self_attn.q_proj.scales" in names
    tower = {n for n in names if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert ("vision_tower.encoder.layers.0.mlp.fc1.scales" in tower) == quantize_vision
    assert quantize_vision or not any(n.endswith(".scales") for n in tower)
    model = load_model(out)
    px = as_pixels(pixels(picture(9, (56, 56))))
    features, exact = np.array(model.encode_images(px)), np.array(ours.encode_images(px))
    if not quantize_vision:
        np.testing.assert_array_equal(features, exact)
    ids = prompt([2, 30, 31], [32, 33, 34])
    quantized, floats = (np.array(m(mx.array(ids)[None], embedded=m.embedded(ids, px))) for m in (model, ours))
    for got, want in ((features, exact), (quantized, floats)):
        drift = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
        assert drift < 0.1, f"8 bits drifted {drift:.0%} from the float model"
