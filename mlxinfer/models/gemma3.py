"""Gemma 3 with images (model_type "gemma3"): the Gemma 3 text model in `text_config`, its weights
under `language_model`, and a SigLIP vision tower whose patch features a projector turns into
`mm_tokens_per_image` embeddings per image, written over the prompt's image tokens; the tokens of
one image attend to each other both ways. A config without `vision_config` (a tensor-sharded rank's,
`canonical`) is the text model alone."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base.errors import ConfigError, InvalidOptionError
from . import gemma3_text
from .config import Field, ModelConfig, _check_fields
from .layers import CausalLM, OffsetRMSNorm
from .multimodal import canonical as text_canonical
from .multimodal import text_config, text_name
from .siglip import VisionConfig, VisionModel
from .vision import Embedded, Pixels, image_spans

__all__ = ["Model", "canonical", "config"]

VISION = ("vision_tower.", "multi_modal_projector.")
FIELDS: dict[str, Field] = {
    "vision_config": Field(dict),
    "mm_tokens_per_image": Field(int, 1, 2**20, nullable=False),
    "image_token_index": Field(int, 0, 2**31 - 1, nullable=False),
}


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """The text model's config plus what the images need."""

    vision: VisionConfig = VisionConfig()
    mm_tokens_per_image: int = 256
    image_token_id: int = 262_144


def canonical(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config (a rank of a tensor-sharded model runs text only: the sharding rules
    would split the vision tower's projections as if they were the text model's)."""
    return text_canonical(d)


def config(d: dict[str, Any]) -> ModelConfig:
    text = gemma3_text.config(text_config(d))
    if "vision_config" not in d:
        return text
    _check_fields(d, FIELDS, "config.json")
    vision = VisionConfig.parse(d["vision_config"] or {})
    tokens = d.get("mm_tokens_per_image", 256)
    side = round(tokens**0.5)
    if side * side != tokens or vision.patches_per_side % side:
        raise ConfigError(f"config.json's mm_tokens_per_image ({tokens}) must be a square whose side divides the "
                          f"{vision.patches_per_side} patches per image side; fix the file")
    return Gemma3Config(**{f.name: getattr(text, f.name) for f in fields(text)}, vision=vision,
                        mm_tokens_per_image=tokens, image_token_id=d.get("image_token_index", 262_144))


class Projector(nn.Module):
    """Patch features [N, patches, vision width] -> [N, mm_tokens_per_image, text width]: averaged over
    square blocks of the patch grid, RMS-normed with Gemma's (1 + w), then one matrix (stored
    [vision width, text width], as the checkpoint has it)."""

    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        v = cfg.vision
        self.mm_input_projection_weight = mx.zeros((v.hidden_size, cfg.hidden_size))
        self.mm_soft_emb_norm = OffsetRMSNorm(v.hidden_size, v.layer_norm_eps, 1.0)
        self.grid, self.side = v.patches_per_side, round(cfg.mm_tokens_per_image**0.5)

    def __call__(self, x: mx.array) -> mx.array:
        n, _, h = x.shape
        s, k = self.side, self.grid // self.side
        pooled = x.reshape(n, s, k, s, k, h).mean(axis=(2, 4)).reshape(n, s * s, h)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Model(CausalLM):
    """Gemma 3's text model, with the vision tower and projector where the config has them.

    `image_token_id` (only with a tower) is the placeholder each image's `mm_tokens_per_image` tokens
    repeat; `embedded` makes a prompt's inputs with the images in, and `__call__` takes them chunk by
    chunk (`Embedded.slice`) for the prefill; decoding and text go through the text model as before."""

    unquantized = VISION  # `convert` keeps the tower and projector in float unless asked

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.vision = isinstance(cfg, Gemma3Config)
        if self.vision:
            self.vision_tower = VisionModel(cfg.vision)
            self.multi_modal_projector = Projector(cfg)
            self.image_token_id = cfg.image_token_id

    def encode_images(self, images: Sequence[Pixels]) -> mx.array:
        """Each image's embeddings, in order: [len(images) * mm_tokens_per_image, hidden]."""
        if not self.vision:
            raise InvalidOptionError("this Gemma 3 checkpoint has no vision tower (no vision_config); "
                                     "send text only or use a checkpoint with one")
        for p in images:
            if p.tokens != self.config.mm_tokens_per_image:
                raise InvalidOptionError(f"a Gemma 3 image takes {self.config.mm_tokens_per_image} tokens, "
                                         f"this one was prepared for {p.tokens}")
        if not images:
            return mx.zeros((0, self.config.hidden_size))
        proj = self.vision_tower.embeddings.patch_embedding  # its weight is uint32 where it was quantized
        dtype = getattr(proj, "scales", proj.weight).dtype
        pixels = mx.array(np.stack([np.asarray(p.values, dtype=np.float32) for p in images])).astype(dtype)
        features = self.multi_modal_projector(self.vision_tower(pixels))
        return features.reshape(-1, features.shape[-1])

    def embedded(self, tokens: Sequence[int], images: Sequence[Pixels], start: int = 0) -> Embedded:
        """The prompt's embeddings (scaled by sqrt(hidden), as the text model scales tokens) with the
        images' features, unscaled as transformers writes them, over the image tokens; each image's
        run of tokens is a bidirectional span. An image wholly before `start` is not encoded (a reused
        prompt cache holds its K/V): its tokens keep the placeholder's embedding, which no run from
        `start` reads."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        spans = image_spans(ids, self.image_token_id, images)
        if self.vision and self.image_token_id >= self.config.vocab_size:
            # no row of the embedding (transformers looks up 0); overwritten below
            ids[ids == self.image_token_id] = 0
        x = self.model.embed(mx.array(ids)[None])[0]
        fresh = [i for i, (_, end) in enumerate(spans) if end > start]
        if fresh:
            slots = np.concatenate([np.arange(*spans[i]) for i in fresh])
            x[mx.array(slots)] = self.encode_images([images[i] for i in fresh]).astype(x.dtype)
        return Embedded(x, None, 0, spans)

    def __call__(self, tokens: mx.array, cache=None, embedded: Embedded | None = None) -> mx.array:
        """Logits of `tokens` [B, T]; with `embedded` (a prefill chunk's, B = 1) its embeddings and
        bidirectional spans stand for the tokens'."""
        if embedded is None:
            return super().__call__(tokens, cache)
        if tokens.shape[-1] != embedded.embeds.shape[0]:
            raise InvalidOptionError(f"{tokens.shape[-1]} tokens came with {embedded.embeds.shape[0]} embeddings")
        self.require_head()
        h = self.model.blocks(embedded.embeds[None], cache, spans=embedded.bidirectional)
        return self.logits(self.model.norm(h))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Text tensors under the text model's names; the tower's and projector's under `vision_tower.`
        and `multi_modal_projector.` (whichever of the hub's, transformers 5's or MLX converters'
        layouts they come in), or dropped where the config has no tower."""
        out = {}
        for name, w in weights.items():
            name = name.removeprefix("model.") if name.startswith(tuple(f"model.{v}" for v in VISION)) else name
            if name.startswith(VISION):
                if self.vision:
                    out[name] = w
            else:
                out[text_name(name)] = w
        if self.vision:
            out = VisionModel.sanitize(out, self.config.vision, "vision_tower.")
        return super().sanitize(out)
