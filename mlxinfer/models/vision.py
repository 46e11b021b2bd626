"""The types between image preprocessing, a vision-language model and the engine: one
preprocessed image (`Pixels`), a prompt's inputs with its images in (`Embedded`), where
each image's tokens lie in a prompt (`image_spans`), and whether a model takes images at all
(`check_takes_images`).

They live apart from any family so the preprocessing (`mlxinfer/text/images.py`), every
vision-language family and the engine agree on one shape without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..base.errors import ImageError


@dataclass(frozen=True)
class Pixels:
    """One preprocessed image.

    `values` is exactly what the family's HF image processor gives as `pixel_values` for this
    image alone (Qwen-VL: [t*h*w patches, C*temporal*patch*patch]; Gemma 3: [3, H, W]), float32.
    `grid` is Qwen-VL's (t, h, w) in patches (None for fixed-size encoders); `tokens` the
    placeholder tokens the image occupies in the expanded prompt; `digest` a sha256 hex over
    the dtype, shape and bytes of `values`: the prompt cache's key for the image, so the same
    text with another picture never reuses K/V."""

    values: np.ndarray
    grid: tuple[int, int, int] | None
    tokens: int
    digest: str


@dataclass(frozen=True)
class Embedded:
    """A prompt's inputs with its images in, made by the model and handed back to it chunk by chunk.

    `embeds` [T, hidden]: the token embeddings (scaled as the family does) with each image's
    features at its placeholder positions. `positions` [3, T] int32 M-RoPE positions (Qwen-VL),
    None where positions are the cache offsets. `position_delta`: what positions after this
    prompt add to the cache offset (Qwen-VL: images take fewer positions than tokens; else 0).
    `bidirectional`: [start, end) spans that attend both ways (Gemma 3's images)."""

    embeds: mx.array
    positions: mx.array | None
    position_delta: int
    bidirectional: tuple[tuple[int, int], ...]

    def slice(self, start: int, end: int) -> Embedded:
        """Tokens [start, end) for one prefill chunk: the spans shifted to the chunk and clipped
        to it (those outside dropped); the delta is the whole prompt's, kept."""
        spans = tuple(
            (max(s, start) - start, min(e, end) - start) for s, e in self.bidirectional if s < end and e > start
        )
        positions = None if self.positions is None else self.positions[:, start:end]
        return Embedded(self.embeds[start:end], positions, self.position_delta, spans)


def check_takes_images(model) -> None:
    """Refuse images for a model without an image token (a text-only model), in one line: every
    front end (the engine's requests, a chat session, the REPL's /image) asks here before it reads
    any image, so they all refuse alike."""
    if model.image_token_id is None:
        raise ImageError("this model takes no images; send text only, or use a vision-language model "
                         "(Qwen2.5-VL, Qwen3-VL, Gemma 3; docs/images.md)")


def image_spans(tokens: Sequence[int] | np.ndarray, image_token_id: int | None,
                images: Sequence[Pixels]) -> tuple[tuple[int, int], ...]:
    """Where each image's tokens lie in an expanded prompt: [start, end) per image, in order.
    The one check that the prompt holds each image's `tokens` placeholder ids in one run and
    no others, so every family, the engine's cache keys and inspection refuse a prompt alike.
    A model without an image token (None) finds none in any prompt."""
    ids = np.asarray(tokens).reshape(-1)
    where = np.flatnonzero(ids == image_token_id) if image_token_id is not None else np.zeros(0, np.int64)
    expected = sum(p.tokens for p in images)
    if len(where) != expected:
        raise ImageError(f"the prompt has {len(where)} image tokens for {len(images)} image(s) that take {expected} "
                         "placeholder tokens; expand each image's placeholder as the processor does, and do not "
                         "write the image token in the text")
    spans, taken = [], 0
    for p in images:
        run = where[taken : taken + p.tokens]
        if run[-1] - run[0] != p.tokens - 1:
            raise ImageError(f"an image's {p.tokens} placeholder tokens are not consecutive in the prompt; expand "
                             "each image's placeholder in one piece, as the processor does")
        spans.append((int(run[0]), int(run[-1]) + 1))
        taken += p.tokens
    return tuple(spans)
