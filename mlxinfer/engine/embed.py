"""Text embeddings: one float32 vector per text, pooled from the model's final hidden states
(after the final norm, before the LM head) the way the checkpoint's sentence-transformers
files say (`models.pooling.EmbeddingConfig`): the last token for Qwen3-Embedding-style
checkpoints, the mean of the tokens otherwise.

Texts are sorted by length and run in batches, right-padded: under the causal mask a real
token never sees the padding after it, so a text's vector is the same alone or in any batch
(to float rounding), and sorting keeps the padding short. A forward pass runs at most `chunk`
tokens, padding included: a text longer than that runs alone, in pieces, through a KV cache.
A server runs the passes one at a time between engine steps (`embed_slices`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..models.cache import LayerRows, make_cache
from ..base.checks import integer, is_integer, token_ids
from ..base.errors import ConfigError, InvalidOptionError
from ..models import CausalLM
from ..models.pooling import Pooling
from ..base.slices import Slices, run_whole
from ..text.tokenizer import Tokenizer

Text = str | Sequence[int]
BATCH_SIZE = 32
# Padded tokens per forward pass: bounds the memory of the attention scores.
BATCH_TOKENS = 8192
EPS = 1e-12  # a norm below this divides as this (torch's `normalize`, which sentence-transformers uses)


def embed(model: CausalLM, tokenizer: Tokenizer, texts: Text | Sequence[Text], *, dimensions: int | None = None,
          normalize: bool = True, batch_size: int = BATCH_SIZE) -> np.ndarray:
    """[N, D] float32: one vector per text of `texts` (a string, token ids, or a list of
    either). `dimensions` keeps the first D numbers (Matryoshka truncation); `normalize`
    scales each vector to unit length after that. With `normalize=False` a vector is what
    the checkpoint's own pipeline gives (unit length already if it ends in Normalize),
    truncated: `SentenceTransformer.encode(normalize_embeddings=False, truncate_dim=D)`."""
    return embed_tokens(model, encode_texts(model, tokenizer, texts), dimensions=dimensions, normalize=normalize,
                        batch_size=batch_size)


def encode_texts(model: CausalLM, tokenizer: Tokenizer, texts: Text | Sequence[Text],
                 what: str = "text") -> list[list[int]]:
    """The token ids of each text, checked: none empty, none longer than the model's context
    (a longer text would have to be cut, which changes its vector). Errors name the text as
    `what` and its index. A list of integers is one text as token ids, as OpenAI reads it."""
    items = [texts] if isinstance(texts, str) else list(texts)
    if items and all(is_integer(t) for t in items):
        items = [items]
    if not items:
        raise InvalidOptionError(f"no {what} to embed; give at least one")
    return [_ids(model, tokenizer, text, f"{what}[{i}]" if len(items) > 1 else what) for i, text in enumerate(items)]


def _ids(model: CausalLM, tokenizer: Tokenizer, text: Text, name: str) -> list[int]:
    if isinstance(text, str) and model.sentence_embedding.as_message:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False,
                                            tokenize=True)
    elif isinstance(text, str):
        ids = tokenizer.encode(text)
    else:
        ids = token_ids(text, model.config.vocab_size, name)
    if not ids or (isinstance(text, str) and not text):  # "" too, though a tokenizer adding EOS gives it a token
        raise InvalidOptionError(f"{name} is empty; give some text or token ids")
    limit = model.config.max_position_embeddings
    if len(ids) > limit:
        raise InvalidOptionError(f"{name} has {len(ids)} tokens but the model's context is {limit}; "
                                 "shorten it or split it into parts")
    return ids


def embed_tokens(model: CausalLM, ids: Sequence[Sequence[int]], *, dimensions: int | None = None,
                 normalize: bool = True, batch_size: int = BATCH_SIZE) -> np.ndarray:
    """`embed` of texts already tokenized (and checked) by `encode_texts`."""
    return run_whole(embed_slices(model, ids, dimensions=dimensions, normalize=normalize, batch_size=batch_size))


def embed_slices(model: CausalLM, ids: Sequence[Sequence[int]], *, dimensions: int | None = None,
                 normalize: bool = True, batch_size: int = BATCH_SIZE, chunk: int = BATCH_TOKENS
                 ) -> Slices[np.ndarray]:
    """`embed_tokens` in slices (`slices`): one forward pass of at most `chunk` tokens each."""
    config = model.sentence_embedding
    width = check_dimensions(model, dimensions)
    integer("batch_size", batch_size, 1)
    integer("chunk", chunk, 1)
    vectors = np.empty((len(ids), width), dtype=np.float32)
    for rows in _batches(ids, batch_size, chunk):
        vectors[rows] = yield from _pooled(model, [ids[i] for i in rows], config.modes, chunk)
    if config.normalize:
        vectors = _unit(vectors)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return _unit(vectors) if normalize else np.ascontiguousarray(vectors)


def check_dimensions(model: CausalLM, dimensions: int | None) -> int:
    """The width of the model's vectors, after checking that it can embed at all and that
    `dimensions` (None: all) is a width it can cut them to."""
    config = model.sentence_embedding
    if config.refusal is not None:
        raise ConfigError(f"this model cannot embed: {config.refusal}")
    width = model.config.hidden_size * len(config.modes)
    if dimensions is not None:
        integer("dimensions", dimensions, 1, width)
    return width


def _batches(ids: Sequence[Sequence[int]], batch_size: int, chunk: int) -> list[list[int]]:
    """Indices of `ids` in batches of similar length: at most `batch_size` texts and, past the
    first, `chunk` padded tokens each."""
    batches: list[list[int]] = []
    for i in sorted(range(len(ids)), key=lambda i: len(ids[i])):
        if batches and len(batches[-1]) < batch_size and (len(batches[-1]) + 1) * len(ids[i]) <= chunk:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _pooled(model: CausalLM, rows: list[Sequence[int]], modes: tuple[str, ...], chunk: int) -> Slices[np.ndarray]:
    """The pooled vectors of one batch, right-padded (with token 0: any id would do, no real token
    sees it), a forward pass at a time: the whole batch, or a text longer than `chunk` in pieces.
    Each row runs through a KV cache of its own, as a prompt chunk does, so the pass takes the same
    path as prefill (on the CPU the fused layer: 500 tokens in 0.42 s where the cacheless per-op
    pass took 1.5 s) and holds K/V, not a [heads, tokens, tokens] score matrix."""
    longest = max(map(len, rows))
    tokens = mx.array([list(r) + [0] * (longest - len(r)) for r in rows], dtype=mx.int32)
    pooling = Pooling([len(r) for r in rows], modes)
    caches = [make_cache(model) for _ in rows]
    layers = caches[0] if len(rows) == 1 else [LayerRows(list(layer)) for layer in zip(*caches)]
    for start in range(0, longest, chunk):
        pooling.add(model.hidden_states(tokens[:, start : start + chunk], layers), start)
        mx.eval(pooling.arrays(), [c.arrays() for cache in caches for c in cache])
        yield
    return np.array(pooling.vectors())


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, EPS)).astype(np.float32)
