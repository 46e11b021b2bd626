"""The safetensors file format, read as untrusted input: its JSON header within the format's own
bounds, every tensor's dtype, shape and byte span checked against the file before MLX maps it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError

# safetensors dtypes and their element sizes in bytes (the format's spec); others are refused.
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


MAX_HEADER = 100_000_000  # the format's own limit on the JSON header


def safetensors_header(file: Path) -> dict[str, Any]:
    """The tensor entries of a safetensors file, checked against the format before MLX maps it:
    an object of {dtype, shape, data_offsets} entries whose byte ranges match their shapes, lie
    inside the file and do not overlap. A file that fails is a CorruptCheckpointError naming it."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{file.name} is truncated ({size} bytes); re-download or re-convert it")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise CorruptCheckpointError(
                f"{file.name} is truncated inside its header ({size} bytes, header needs {8 + n}); re-download it"
            )
        if n > MAX_HEADER:
            raise CorruptCheckpointError(f"{file.name} has a {n}-byte header, over the format's limit; re-download it")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise CorruptCheckpointError(f"{file.name} has a corrupt safetensors header; re-download it") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{file.name}'s safetensors header is not a JSON object; re-download it")
    meta = header.pop("__metadata__", None) or {}  # MLX writes null when there is none
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{file.name}'s __metadata__ is not an object of strings; re-download it")
    spans = sorted((_tensor_span(file, name, info, 8 + n, size), name) for name, info in header.items())
    for (prev, a), (cur, b) in zip(spans, spans[1:]):
        if cur[0] < prev[1]:
            raise CorruptCheckpointError(f"{file.name}: tensors {a[:80]!r} and {b[:80]!r} overlap; re-download or re-convert it")
    return header


def _tensor_span(file: Path, name: str, info: Any, start: int, size: int) -> tuple[int, int]:
    """The (begin, end) byte range of one header entry (its data begins at `start` in a file
    of `size` bytes), after checking its fields."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{file.name}: tensor {name[:80]!r} {what}; re-download or re-convert it")

    if not isinstance(info, dict):
        raise bad("has no {dtype, shape, data_offsets} entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise bad(f"has unknown dtype {dtype!r:.40}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"has an invalid shape {shape!r:.60}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has invalid data_offsets {offsets!r:.60}")
    if start + offsets[1] > size:
        raise CorruptCheckpointError(
            f"{file.name} is truncated: tensor '{name[:80]}' needs {start + offsets[1]} bytes but the file has "
            f"{size}; re-download or re-convert it"
        )
    count = 1
    for d in shape:
        count *= d
    if count * SAFETENSORS_DTYPES[dtype] != offsets[1] - offsets[0]:
        raise bad(f"has {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
    return offsets[0], offsets[1]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_safetensors(file: Path) -> None:
    """Fail with a one-line error naming the file (and tensor) if it does not hold what its header says."""
    safetensors_header(file)
