"""Sentence pooling: one vector per sequence from a model's final hidden states, the way
sentence-transformers' `Pooling` module makes it (its modes, its formulas), so a checkpoint
saved as a sentence-transformers model embeds here as it does there.

Sequences are right-padded: row b holds `lengths[b]` real tokens, then padding. Under a
causal mask a real token never attends to the padding after it, so the real positions'
hidden states are those of the sequence alone, and pooling reads only those.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MODES = ("cls", "lasttoken", "max", "mean", "mean_sqrt_len_tokens", "weightedmean")


@dataclass(frozen=True)
class EmbeddingConfig:
    """How a checkpoint turns text into its sentence embedding, as its sentence-transformers
    files say: the pooling modes (their vectors concatenated, in order), whether a `Normalize`
    module follows, and whether a text is first rendered by the chat template as one user
    message (sentence-transformers 6 saves a model whose tokenizer has a template with the
    'message' modality, and formats every text that way). Mean pooling of the plain text,
    not normalised, for a checkpoint that says nothing."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    as_message: bool = False
    refusal: str | None = None  # why this checkpoint's pipeline cannot be run here (a module we lack)


def pool(hidden: mx.array, lengths: mx.array, modes: tuple[str, ...]) -> mx.array:
    """[B, D * len(modes)] float32 vectors of the right-padded `hidden` [B, T, D], row b
    holding `lengths[b]` (int32 [B]) real tokens."""
    hidden = hidden.astype(mx.float32)
    real = (mx.arange(hidden.shape[1])[None] < lengths[:, None])[..., None]  # [B, T, 1]
    counts = lengths[:, None].astype(mx.float32)
    return mx.concatenate([_pool_one(hidden, real, counts, lengths, m) for m in modes], axis=-1)


def _pool_one(hidden: mx.array, real: mx.array, counts: mx.array, lengths: mx.array, mode: str) -> mx.array:
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.where(real, hidden, -mx.inf).max(axis=1)
    if mode == "weightedmean":  # the i-th real token weighs i
        weights = (mx.arange(1, hidden.shape[1] + 1, dtype=mx.float32)[None, :, None]) * real
        return (hidden * weights).sum(axis=1) / weights.sum(axis=1)
    total = mx.where(real, hidden, 0.0).sum(axis=1)
    return total / (counts if mode == "mean" else mx.sqrt(counts))
