"""The source model run one block at a time, as calibration needs it: only one block's float
weights (and the embedding, final norm and LM head) are in memory at once, so measuring or
calibrating a model needs about one layer's weights and the calibration activations, not the
whole model in float32 (a 7B model is 28 GB in float32; one of its blocks, 0.8 GB)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map, tree_unflatten

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.models import build_model
from mlxinfer.models.attention import attention_mask
from mlxinfer.models.layers import Backbone, CausalLM

from .gguf_file import Packed
from .sources import Source


class Blockwise:
    """A model built from `source` with no weights loaded but its outer layers' (`load_outer`);
    `blocks()` hands out each block with its weights, freeing them when the caller moves on."""

    def __init__(self, source: Source, option: str):
        self.source = source
        self.model: CausalLM = build_model(source.config)
        if not isinstance(getattr(self.model, "model", None), Backbone):
            raise InvalidOptionError(f"{option} runs a model block by block, which {type(self.model).__name__} "
                                     "does not allow; use --bits or --recipe")
        self.modules = dict(self.model.named_modules())
        self.backbone: Backbone = self.model.model
        self.prefixes = [self.path(block) for block in self.model.layers]

    def path(self, module: nn.Module) -> str:
        return next(name for name, m in self.modules.items() if m is module)

    def in_block(self, path: str) -> bool:
        return any(path.startswith(f"{prefix}.") for prefix in self.prefixes)

    def floats(self, name: str) -> mx.array:
        t = self.source.tensors[name].read()
        return t.dequantize(mx.float32) if isinstance(t, Packed) else t.astype(mx.float32)

    def load_outer(self, embedding: bool = True, head: bool = True) -> None:
        """The embedding and/or the final norm and LM head (the tied embedding when there is none)."""
        prefixes = ([self.path(self.backbone.embed_tokens)] if embedding else []) + \
            ([self.path(self.backbone.norm), "lm_head"] if head else [])
        if head and self.model.config.tie_word_embeddings:
            prefixes.append(self.path(self.backbone.embed_tokens))
        names = [n for n in self.source.tensors if any(n.startswith(f"{p}.") for p in prefixes)]
        self.model.load_weights([(n, self.floats(n)) for n in names], strict=False)

    def drop_embedding(self) -> None:
        self.backbone.embed_tokens.weight = mx.zeros((0,))

    def blocks(self, order: range | None = None) -> Iterator[tuple[int, nn.Module, str]]:
        """(index, block, its path) with the block's float32 weights loaded, in `order` (default:
        first to last); each block's weights are freed when the next is asked for."""
        for i in order if order is not None else range(len(self.prefixes)):
            block, prefix = self.model.layers[i], self.prefixes[i]
            names = [name for name in self.source.tensors if name.startswith(f"{prefix}.")]
            # update, not load_weights: a block met a second time holds the empty arrays it was freed to
            block.update(tree_unflatten([(name[len(prefix) + 1:], self.floats(name)) for name in names]))
            try:
                yield i, block, prefix
            finally:
                block.update(tree_map(lambda _: mx.zeros((0,)), block.parameters()))


def run_block(block: nn.Module, x: mx.array) -> mx.array:
    """One block over a whole window from an empty cache, with the mask `Backbone.blocks` makes."""
    mask = attention_mask(x.shape[1], 0, block.window) if block.attends else None
    return block(x, mask)


def set_module(root: nn.Module, path: str, module) -> None:
    """Replace the module at `path` (dotted, list indices as numbers) under `root`."""
    parent, _, leaf = path.rpartition(".")
    owner = root
    for part in parent.split(".") if parent else ():
        owner = owner[int(part)] if isinstance(owner, list) else owner[part]
    owner[leaf] = module


class BlockProgress:
    """A line on stderr for a pass over the blocks: steps done, elapsed time and the time left at
    the pace so far (a 7B model's calibration takes long enough to want it)."""

    def __init__(self, label: str, enabled: bool | None = None):
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        left = elapsed / done * (total - done)
        sys.stderr.write(f"\r{self.label}: step {done}/{total}  {elapsed:.0f}s, about {left:.0f}s left  ")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
