"""Qwen2.5-VL (model_type "qwen2_5_vl"): the Qwen2 language model with M-RoPE, and the
vision tower of `qwen_vision`, whose tokens replace the prompt's image placeholders.

A prompt with images goes in as an `Embedded` (`embedded`: its token embeddings with the
image tokens in, its 3-axis positions and the delta later tokens add to their index); a
prompt without images, and every decoding step, is the text model, RoPE at the cache offset
plus the delta the prompt left in the caches."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ..base.errors import InvalidOptionError
from . import qwen2
from .config import ModelConfig
from .layers import Block as TextBlock
from .layers import CausalLM
from .mrope import MRoPE, positions
from .multimodal import text_config, text_weights
from .qwen_vision import VisionConfig, VisionTransformer
from .vision import Embedded, Pixels, image_spans

__all__ = ["Model", "canonical", "config"]

IMAGE_TOKEN_ID = 151655  # <|image_pad|>, where a config does not say
# Where checkpoints keep the vision tower: older hub files, transformers 5's own layout, mlx-vlm.
VISION = ("visual.", "model.visual.", "vision_tower.")


def canonical(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config at the top level (where a rank's config divides it), the vision
    tower's and the image token's beside it."""
    rest = {k: v for k, v in d.items() if k != "text_config"}
    return {**rest, **text_config(d, tied=False), "model_type": d["model_type"]}


def config(d: dict[str, Any]) -> ModelConfig:
    flat = canonical(d)
    key = "rope_parameters" if flat.get("rope_parameters") else "rope_scaling"
    rope = dict(flat.get(key) or {})
    if rope.get("rope_type", rope.get("type")) == "mrope":  # older configs: M-RoPE over the default frequencies
        rope.pop("type", None)
        rope["rope_type"] = "default"
    return qwen2.config({**flat, key: rope})


class Block(TextBlock):
    def attention(self, cfg: ModelConfig, layer: int):
        attn = super().attention(cfg, layer)
        attn.rope = MRoPE(cfg)
        return attn


class Model(CausalLM):
    block = Block
    vision_class = VisionTransformer
    unquantized = ("visual.",)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = self.vision_class.of(cfg.raw.get("vision_config") or {})
        self.image_token_id: int = cfg.raw.get("image_token_id", IMAGE_TOKEN_ID)

    def __call__(self, tokens: mx.array, cache=None, embedded: Embedded | None = None) -> mx.array:
        """Logits [B, T, vocab]; with `embedded` (a prefill chunk of one prompt, B = 1) its
        embeddings and positions stand for `tokens`, and the caches take its position delta."""
        if embedded is None:
            return super().__call__(tokens, cache)
        self.require_head()
        for c in cache or ():
            c.position_delta = embedded.position_delta
        h = self.model.blocks(embedded.embeds[None], cache, positions=embedded.positions)
        return self.logits(self.model.norm(h))

    def encode_images(self, images: Sequence[Pixels]) -> mx.array:
        """The images' tokens [sum of their `tokens`, hidden], in order."""
        return self.image_features(images)[0]

    def image_features(self, images: Sequence[Pixels]) -> tuple[mx.array, list[mx.array]]:
        """The images' tokens and the vision tower's features for the first layers (`features`)."""
        cfg = self.visual.cfg
        for im in images:
            check_pixels(im, cfg)
        proj = self.visual.patch_embed.proj  # its weight is uint32 where `convert --quantize-vision` packed it
        patches = mx.array(np.concatenate([im.values for im in images]))
        return self.visual.features(patches.astype(getattr(proj, "scales", proj.weight).dtype),
                                    [im.grid for im in images])

    def embedded(self, tokens: Sequence[int], images: Sequence[Pixels], start: int = 0) -> Embedded:
        """The prompt `tokens` (each image's placeholder expanded to its `tokens`) with `images` in;
        only the images not wholly before `start` are encoded (`prompt_inputs`)."""
        x, where, delta, _ = self.prompt_inputs(tokens, images, start)
        return Embedded(x, where, delta, ())

    def prompt_inputs(self, tokens: Sequence[int], images: Sequence[Pixels], start: int = 0
                      ) -> tuple[mx.array, mx.array, int, list[mx.array]]:
        """Embeddings [T, hidden] with the image tokens in, M-RoPE positions [3, T], their delta, and
        each of the tower's first-layer features [T, hidden] (zero outside the images). An image whose
        tokens all lie before `start` is not encoded (a reused prompt cache holds its K/V, and the
        positions depend only on its grid): its tokens keep the placeholder's embedding, which no
        run from `start` reads."""
        ids = np.asarray(tokens, dtype=np.int64)
        starts = [begin for begin, _ in image_spans(ids, self.image_token_id, images)]
        where, delta = positions(len(ids), [(s, im.grid) for s, im in zip(starts, images)],
                                 self.visual.cfg.spatial_merge_size)
        x = self.model.embed(mx.array(ids))
        deep: list[mx.array] = []
        fresh = [(s, im) for s, im in zip(starts, images) if s + im.tokens > start]
        if fresh:
            slots = mx.array(np.concatenate([np.arange(s, s + im.tokens) for s, im in fresh]).astype(np.int32))
            found, stack = self.image_features([im for _, im in fresh])
            x[slots] = found.astype(x.dtype)
            for f in stack:
                layer = mx.zeros_like(x)
                layer[slots] = f.astype(x.dtype)
                deep.append(layer)
        return x, mx.array(where), delta, deep

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text = text_weights(weights, VISION)
        vision = {f"visual.{k.split('.', 2 if k.startswith('model.') else 1)[-1]}": v
                  for k, v in weights.items() if k.startswith(VISION)}
        return {**super().sanitize(text), **self.visual.sanitize(vision)}


def check_pixels(im: Pixels, cfg: VisionConfig) -> None:
    """One image's patches as this vision tower takes them, or a one-line error."""
    if im.grid is None or len(im.grid) != 3:
        raise InvalidOptionError("a Qwen-VL image needs its patch grid (t, h, w); preprocess it for this model")
    t, h, w = im.grid
    merge = cfg.spatial_merge_size
    if min(t, h, w) < 1 or h % merge or w % merge:
        raise InvalidOptionError(f"image grid {im.grid} is not whole {merge}x{merge} blocks of patches; "
                                 "preprocess the image for this model")
    if im.values.shape != (t * h * w, cfg.patch_values):
        raise InvalidOptionError(f"image patches of shape {im.values.shape} do not fit grid {im.grid} of "
                                 f"{cfg.patch_values}-value patches; preprocess the image for this model")
    if im.tokens != t * h * w // cfg.merge_unit:
        raise InvalidOptionError(f"an image of grid {im.grid} takes {t * h * w // cfg.merge_unit} tokens, "
                                 f"not {im.tokens}; preprocess the image for this model")
