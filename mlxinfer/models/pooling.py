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


class Pooling:
    """The pooled vectors of right-padded rows, row b holding `lengths[b]` real tokens, from their
    final hidden states given a piece at a time (a long text runs in chunks): `add` each piece of
    columns in order, then `vectors` is [B, D * len(modes)] float32. Each mode keeps what its
    formula needs (the first or last real token, a running max, sums), so the vectors are those
    of the whole rows at once, to float rounding."""

    def __init__(self, lengths: list[int], modes: tuple[str, ...]):
        self.lengths, self.modes = mx.array(lengths, dtype=mx.int32), modes
        self.kept: dict[str, list[mx.array]] = {}

    def add(self, hidden: mx.array, start: int) -> None:
        """Hidden states [B, T, D] of columns start .. start + T."""
        hidden = hidden.astype(mx.float32)
        columns = mx.arange(start, start + hidden.shape[1])
        real = (columns[None] < self.lengths[:, None])[..., None]  # [B, T, 1]
        for mode in self.modes:
            self.kept[mode] = _fold(mode, self.kept.get(mode), hidden, real, columns, start, self.lengths)

    def arrays(self) -> list[mx.array]:
        return [a for kept in self.kept.values() for a in kept]

    def vectors(self) -> mx.array:
        counts = self.lengths[:, None].astype(mx.float32)
        return mx.concatenate([_finish(mode, self.kept[mode], counts) for mode in self.modes], axis=-1)


def _fold(mode: str, kept: list[mx.array] | None, hidden: mx.array, real: mx.array, columns: mx.array, start: int,
          lengths: mx.array) -> list[mx.array]:
    """What `mode` keeps after one more piece of columns."""
    if mode == "cls":
        return kept if start else [hidden[:, 0]]
    if mode == "lasttoken":
        at = lengths - 1 - start  # the last real token's column within this piece
        inside = ((at >= 0) & (at < hidden.shape[1]))[:, None]
        last = mx.take_along_axis(hidden, mx.clip(at, 0, hidden.shape[1] - 1)[:, None, None], axis=1)[:, 0]
        return [mx.where(inside, last, kept[0]) if kept else last]
    if mode == "max":
        top = mx.where(real, hidden, -mx.inf).max(axis=1)
        return [mx.maximum(kept[0], top) if kept else top]
    if mode == "weightedmean":  # the i-th real token weighs i
        weights = (columns + 1).astype(mx.float32)[None, :, None] * real
        sums = [(hidden * weights).sum(axis=1), weights.sum(axis=1)]
    else:
        sums = [mx.where(real, hidden, 0.0).sum(axis=1)]
    return [a + b for a, b in zip(kept, sums)] if kept else sums


def _finish(mode: str, kept: list[mx.array], counts: mx.array) -> mx.array:
    if mode in ("cls", "lasttoken", "max"):
        return kept[0]
    if mode == "weightedmean":
        return kept[0] / kept[1]
    return kept[0] / (counts if mode == "mean" else mx.sqrt(counts))
