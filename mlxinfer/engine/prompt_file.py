"""A prompt cache as a file (safetensors: each layer's keys, values or recurrent state, and the token
ids they cover), so a long conversation resumes without prefilling it again; a file that is damaged
or made by another model is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..models.cache import KV_BITS, KV_GROUP_SIZES, KVCache, Parts, RotatingKVCache, StateCache
from ..base.checks import INDEX_MAX, is_integer
from ..base.errors import CorruptCheckpointError, InvalidOptionError, MlxinferError
from ..base.files import replacing
from ..base.safetensors import safetensors_header
from ..models.prompt_cache import PromptCache


def save_prompt_cache(path: str | Path, cache: PromptCache, metadata: dict[str, str] | None = None) -> None:
    """Write caches, their token ids and metadata as one safetensors file (atomically). A cache
    that holds an image is refused: its image tokens are listed as keys of the pixels (negative,
    `prompt.image_key`), which the file's token ids cannot carry."""
    if any(t < 0 for t in cache.tokens):
        raise InvalidOptionError("a prompt cache that holds an image cannot be saved; save one of a text prompt")
    arrays: dict[str, mx.array] = {"tokens": mx.array(np.array(cache.tokens, dtype=np.int32))}
    layers = []
    for i, c in enumerate(cache.caches):
        if isinstance(c, StateCache):
            for j, a in enumerate(c.state or ()):
                arrays[f"{i}.state.{j}"] = a
            layers.append({**c.meta(), "parts": len(c.state or ())})
            continue
        keys, values = c.state
        for j, (k, v) in enumerate(zip(keys, values)):
            arrays[f"{i}.keys.{j}"], arrays[f"{i}.values.{j}"] = k, v
        arrays[f"{i}.positions"] = mx.array(np.sort(c.positions()).astype(np.int32))
        layers.append({**c.meta(), "parts": len(keys)})
    meta = {"mlxinfer.layers": json.dumps(layers), "mlxinfer.metadata": json.dumps({**cache.metadata, **(metadata or {})})}
    with replacing(Path(path), suffix=".safetensors") as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata=meta)


def load_prompt_cache(path: str | Path) -> PromptCache:
    """Read a file written by `save_prompt_cache`. The file is untrusted: its header, layer
    descriptions, array shapes and dtypes, positions and offsets must agree with each other
    (a CorruptCheckpointError otherwise); whether it fits a model is `PromptCache.check_fits`."""
    path = Path(path)
    try:
        safetensors_header(path)  # bounds checked before MLX maps the file
        arrays, meta = mx.load(str(path), return_metadata=True)
        layers = json.loads(meta["mlxinfer.layers"])
        user = json.loads(meta["mlxinfer.metadata"])
    except (MlxinferError, OSError, RuntimeError, ValueError, KeyError, RecursionError) as e:
        raise CorruptCheckpointError(f"'{path}' is not a prompt cache written by mlxinfer ({e})") from None
    if not isinstance(user, dict) or not all(isinstance(v, str) for v in user.values()):
        raise _unusable(path, "its metadata is not an object of strings")
    if not isinstance(layers, list) or not all(isinstance(m, dict) for m in layers):
        raise _unusable(path, "its layer list is not a list of objects")
    tokens = _int_vector(path, arrays, "tokens")
    if tokens.size and tokens.min() < 0:
        raise _unusable(path, f"it holds token id {tokens.min()}")
    caches = [_read_layer(path, i, m, arrays, len(tokens)) for i, m in enumerate(layers)]
    return PromptCache(caches, tokens.tolist(), user)


def _unusable(path: Path, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"'{path}' is not a usable prompt cache: {why}; save it again")


def _int_vector(path: Path, arrays: dict[str, mx.array], name: str) -> np.ndarray:
    a = arrays.get(name)
    if a is None or a.ndim != 1 or not mx.issubdtype(a.dtype, mx.integer):
        raise _unusable(path, f"'{name}' is missing or not a vector of integers")
    return np.array(a).astype(np.int64)


def _setting(path: Path, i: int, m: dict[str, Any], key: str, allowed: Any) -> Any:
    """Layer `i`'s `key`, which must be an int in `allowed` (a range or a tuple), or None where allowed has it."""
    value = m.get(key)
    if value is None:
        ok = isinstance(allowed, tuple) and None in allowed
    else:  # checked as an integer first: `in range` scans linearly for anything else
        ok = is_integer(value) and value in allowed
    if not ok:
        raise _unusable(path, f"layer {i} has {key} {value!r:.40}")
    return value


def _read_layer(path: Path, i: int, m: dict[str, Any], arrays: dict[str, mx.array], n_tokens: int
                ) -> KVCache | StateCache:
    """One layer's cache from its description and arrays, each checked against the others."""
    kind = m.get("kind")
    if kind not in ("KVCache", "RotatingKVCache", "StateCache"):
        raise _unusable(path, f"layer {i} has unknown kind {kind!r:.40}")
    if kind == "StateCache":
        return _read_state(path, i, m, arrays, n_tokens)
    bits = _setting(path, i, m, "bits", (None, *KV_BITS))
    group = _setting(path, i, m, "group_size", KV_GROUP_SIZES)
    offset = _setting(path, i, m, "offset", range(INDEX_MAX))
    parts = _setting(path, i, m, "parts", (0, 1 if bits is None else 3))
    if n_tokens and offset != n_tokens:  # no tokens: an older file whose caches were filled without a token list
        raise _unusable(path, f"layer {i} covers {offset} tokens but the file lists {n_tokens}")
    keys = _parts(path, arrays, f"{i}.keys", parts, bits, group)
    values = _parts(path, arrays, f"{i}.values", parts, bits, group)
    positions = _int_vector(path, arrays, f"{i}.positions")
    stored = keys[0].shape[2] if keys else 0
    if (values and values[0].shape[2] != stored) or len(positions) != stored:
        raise _unusable(path, f"layer {i}'s keys, values and positions disagree in length")
    if len(positions) and (positions[0] < 0 or positions[-1] >= offset or np.any(np.diff(positions) <= 0)):
        raise _unusable(path, f"layer {i}'s positions are not increasing token positions below {offset}")
    c: KVCache
    if kind == "RotatingKVCache":
        size = _setting(path, i, m, "max_size", range(2, INDEX_MAX))
        c = RotatingKVCache(size, _setting(path, i, m, "keep", range(size)), bits, group)
    else:
        if stored != offset:
            raise _unusable(path, f"layer {i} keeps {stored} entries for {offset} tokens")
        c = KVCache(bits, group)
    c.restore(keys, values, offset, positions)
    c.position_delta = m.get("position_delta", 0)  # files from before vision-language prompts have none
    if not is_integer(c.position_delta) or abs(c.position_delta) >= INDEX_MAX:
        raise _unusable(path, f"layer {i} has position_delta {c.position_delta!r:.40}")
    return c


def _read_state(path: Path, i: int, m: dict[str, Any], arrays: dict[str, mx.array], n_tokens: int) -> StateCache:
    """A recurrent layer's state: floating arrays [1, ...], present exactly when tokens were seen
    (whether their shapes fit the model is `PromptCache.check_fits`)."""
    offset = _setting(path, i, m, "offset", range(INDEX_MAX))
    parts = _setting(path, i, m, "parts", range(8))
    if n_tokens and offset != n_tokens:
        raise _unusable(path, f"layer {i} covers {offset} tokens but the file lists {n_tokens}")
    state = tuple(arrays.get(f"{i}.state.{j}") for j in range(parts))
    if any(a is None or a.ndim < 2 or a.shape[0] != 1 or not mx.issubdtype(a.dtype, mx.floating) for a in state):
        raise _unusable(path, f"layer {i}'s state is missing or not floating arrays [1, ...]")
    if bool(state) != bool(offset):
        raise _unusable(path, f"layer {i} has a state of {parts} arrays for {offset} tokens")
    c = StateCache()
    c.restore(state, offset)
    return c


def _parts(path: Path, arrays: dict[str, mx.array], name: str, count: int, bits: int | None, group: int) -> Parts:
    """`count` arrays [1, heads, tokens, dims]: floats, or MLX's (packed uint32, scales, biases)."""
    parts = tuple(arrays.get(f"{name}.{j}") for j in range(count))
    if any(p is None or p.ndim != 4 or p.shape[0] != 1 for p in parts):
        raise _unusable(path, f"'{name}' is missing or not shaped [1, heads, tokens, dims]")
    if len({p.shape[:3] for p in parts}) > 1:
        raise _unusable(path, f"the parts of '{name}' disagree in shape")
    if bits is None and parts and not mx.issubdtype(parts[0].dtype, mx.floating):
        raise _unusable(path, f"'{name}' is not floating point")
    if bits is not None and parts:
        packed, scales, biases = parts
        ok = packed.dtype == mx.uint32 and scales.shape == biases.shape and mx.issubdtype(scales.dtype, mx.floating)
        if not ok or packed.shape[3] * 32 // bits != scales.shape[3] * group:
            raise _unusable(path, f"'{name}' is not {bits}-bit data in groups of {group}")
    return parts
