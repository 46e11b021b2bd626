"""Read GGUF files (llama.cpp's format) without loading them whole.

The header and metadata are parsed once; tensor data stays memory-mapped and is
converted one tensor at a time, so a conversion never holds the whole model.
Q8_0, Q4_0 and Q4_1 blocks are exactly MLX affine quantization with group size
32 (w = scale * q + bias), and MXFP4 blocks exactly MLX's mxfp4 mode (E2M1 codes, an
E8M0 exponent per 32), so they are repacked bit for bit; K-quants and other types are
dequantized with llama.cpp's own `gguf` package (an optional extra).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxinfer.base.errors import ConversionError, CorruptCheckpointError

from .quantize import QuantSpec

MAGIC = b"GGUF"
F32, F16, Q4_0, Q4_1, Q8_0, BF16, MXFP4 = 0, 1, 2, 3, 8, 30, 39
FLOAT_TYPES = {F32: np.dtype("<f4"), F16: np.dtype("<f2"), BF16: np.dtype("<u2")}
# Block layouts MLX runs as they are: 32 weights per block, fp16 scale `d` (and Q4_1's fp16
# minimum `m`), or MXFP4's exponent `e`.
BLOCK_TYPES = {
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    MXFP4: np.dtype([("e", "u1"), ("qs", "u1", 16)]),
}
_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", MXFP4: "MXFP4"}
# Metadata value types: GGUF type id -> numpy dtype; 8 is a string, 9 an array.
_SCALARS = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count


@dataclass(frozen=True)
class Packed:
    """A layer already in MLX quantized form: packed uint32 weight plus per-group scales, and
    biases in affine mode (the floating-point modes have none; their scales are uint8)."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    spec: QuantSpec

    def tensors(self, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
        """weight, scales (and biases) by their leaf names; float scales and biases as `dtype`."""
        out = {"weight": self.weight, "scales": self.scales}
        if self.biases is not None:
            out["biases"] = self.biases
        if dtype is None:
            return out
        return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in out.items()}

    def dequantize(self, dtype: mx.Dtype | None = None) -> mx.array:
        """The float weight, computed in `dtype` (default: the scales' float type, bfloat16 for uint8 ones)."""
        t, spec = self.tensors(dtype), self.spec
        return mx.dequantize(t["weight"], t["scales"], t.get("biases"), spec.group_size, spec.bits, mode=spec.mode,
                             dtype=dtype)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the last axis is GGUF's contiguous ne[0]
    type: int
    offset: int  # absolute position in the file

    @property
    def type_name(self) -> str:
        return _NAMES.get(self.type) or gguf_type(self.type, self.name).name


class GGUFFile:
    """A GGUF file's metadata (a plain dict) and memory-mapped tensors."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise CorruptCheckpointError(f"{path.name} is empty; re-download it") from None
        try:
            self.metadata, self.tensors = _Parser(self._map).parse()
        except ValueError as e:
            self.close()
            raise CorruptCheckpointError(f"{path.name} is not a valid GGUF file: {e}; re-download it") from None

    def close(self) -> None:
        # A traceback may still hold a view of the map; it is then closed when collected.
        with contextlib.suppress(BufferError):
            self._map.close()

    def read(self, info: TensorInfo) -> mx.array | Packed:
        """One tensor: floats as they are stored, legacy quants repacked, other types dequantized."""
        if info.type in FLOAT_TYPES:
            array = mx.array(self._view(info, FLOAT_TYPES[info.type], int(math.prod(info.shape))).reshape(info.shape))
            return array.view(mx.bfloat16) if info.type == BF16 else array
        if info.type in BLOCK_TYPES:
            rows, cols = _rows_cols(info)
            blocks = self._view(info, BLOCK_TYPES[info.type], rows * cols // 32).reshape(rows, cols // 32)
            return _repack(blocks, info.type, info.shape)
        return mx.array(self._dequantize(info).reshape(info.shape))

    def check_dequantizable(self) -> None:
        """Fail before any work when a tensor's type cannot be dequantized: try one row of each type."""
        firsts = {t.type: t for t in reversed(self.tensors) if t.type not in FLOAT_TYPES and t.type not in BLOCK_TYPES}
        for info in firsts.values():
            self._dequantize(info, rows=1)

    def _view(self, info: TensorInfo, dtype: np.dtype, count: int) -> np.ndarray:
        end = info.offset + dtype.itemsize * count
        if end > len(self._map):
            raise CorruptCheckpointError(
                f"{self.path.name} is truncated: tensor '{info.name}' needs {end} bytes but the file has "
                f"{len(self._map)}; re-download it"
            )
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset)

    def _dequantize(self, info: TensorInfo, rows: int | None = None) -> np.ndarray:
        """The first `rows` rows (default all) as float32, by the gguf package."""
        qtype = gguf_type(info.type, info.name)
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        total, cols = _rows_cols(info)
        rows = rows or total
        block, size = GGML_QUANT_SIZES[qtype]
        raw = self._view(info, np.dtype("u1"), rows * cols // block * size).reshape(rows, -1)
        try:
            return dequantize(raw, qtype)
        except NotImplementedError:
            raise ConversionError(
                f"GGUF tensor '{info.name}' has type {qtype.name}, which cannot be dequantized; "
                "convert from a GGUF with another quantization (e.g. Q8_0, Q4_K_M) or from the original model"
            ) from None


def _rows_cols(info: TensorInfo) -> tuple[int, int]:
    return int(math.prod(info.shape[:-1])), info.shape[-1]


def _repack(blocks: np.ndarray, kind: int, shape: tuple[int, ...]) -> Packed:
    """GGUF blocks as MLX quantization (values in a uint32 fill it from the low bits).

    Q8_0 stores signed q * d: shift q by 128 and use bias -128 d. Q4_0 stores (q - 8) * d:
    bias -8 d. Q4_1 stores q * d + m: bias m. Powers of two times d are exact in fp16.
    MXFP4 stores E2M1 codes and an E8M0 exponent per block, which MLX's mxfp4 mode reads as
    they are (ggml doubles the code values and halves the scale: the same numbers). The 4-bit
    kinds keep weight j of a block in the low nibble of byte j, weight j + 16 in its high one.
    """
    rows = blocks.shape[0]
    if kind == Q8_0:
        packed = (blocks["qs"].view(np.uint8) ^ np.uint8(0x80)).reshape(rows, -1)
    else:
        qs = blocks["qs"]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # a block's 32 weights in order
        packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).reshape(rows, -1)
    if kind == MXFP4:
        spec, scales, biases = QuantSpec(4, 32, "mxfp4"), blocks["e"], None
    else:
        d = blocks["d"]
        bias = d * np.float16(-128) if kind == Q8_0 else blocks["m"] if kind == Q4_1 else d * np.float16(-8)
        spec, scales, biases = QuantSpec(8 if kind == Q8_0 else 4, 32), d, bias
    wshape, sshape = spec.packed_shape(shape)
    # Contiguous copies first: mx.array of a strided view would keep the whole block buffer.
    weight = np.ascontiguousarray(packed).view("<u4").reshape(wshape)
    return Packed(mx.array(weight), mx.array(np.ascontiguousarray(scales).reshape(sshape)),
                  None if biases is None else mx.array(np.ascontiguousarray(biases).reshape(sshape)), spec)


def gguf_type(type_id: int, name: str):
    """The `gguf` package's enum member for a tensor type we do not read natively."""
    try:
        from gguf import GGMLQuantizationType
    except ImportError:
        raise ConversionError(
            f"GGUF tensor '{name}' is quantized with a type (id {type_id}) that needs the optional gguf package "
            "to dequantize; install it with: pip install 'mlxinfer[gguf]'"
        ) from None
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        raise ConversionError(
            f"GGUF tensor '{name}' has unknown type id {type_id}; upgrade the gguf package or use another GGUF"
        ) from None


MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions
MAX_NESTING = 8  # arrays of arrays deeper than this are no model's metadata
# The fewest bytes a header record can take, to refuse counts the file cannot hold before
# looping over them: a key-value pair (key length, value type, a 1-byte value) and a tensor
# info (name length, dimension count, one dimension, type, offset).
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
_MIN_ITEM = {_STRING: 8, _ARRAY: 12}


def tensor_nbytes(shape: tuple[int, ...], kind: int, name: str) -> int | None:
    """Bytes a tensor of this type and shape takes; None for a type the `gguf` package
    is needed to size (it is checked when the tensor is read)."""
    if kind in FLOAT_TYPES:
        return int(math.prod(shape)) * FLOAT_TYPES[kind].itemsize
    if kind in BLOCK_TYPES:
        block, size = 32, BLOCK_TYPES[kind].itemsize
    else:
        try:
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ImportError, ValueError, KeyError):
            return None
    if shape[-1] % block:
        raise ValueError(f"tensor '{name}' has rows of {shape[-1]} values, not a multiple of its type's {block}")
    return int(math.prod(shape)) // block * size


class _Parser:
    """Sequential reader of the GGUF header: magic, version, counts, metadata, tensor infos.

    Every length, count and offset comes from the file, so each is checked against the
    bytes that remain before it is used: a damaged header is a ValueError naming the field,
    never a huge allocation, a long loop or a read past the end."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        if self.buf[:4] != MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes")
        self.pos = 4
        version = self._scalar(4, "the version")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
        n_tensors, n_kv = self._scalar(10, "the tensor count"), self._scalar(10, "the metadata count")
        self._fits(n_kv, _MIN_KV, f"the metadata count ({n_kv})")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            if key in metadata:
                raise ValueError(f"metadata key '{key}' appears twice")
            metadata[key] = self._value(self._scalar(4, f"metadata '{key}' type"), key)
        self._fits(n_tensors, _MIN_TENSOR, f"the tensor count ({n_tensors})")
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        align = metadata.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise ValueError(f"metadata 'general.alignment' is {align!r}, not a power of two")
        start = -(-self.pos // align) * align
        tensors = [TensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in infos]
        self._check_tensors(tensors, align)
        return metadata, tensors

    def _check_tensors(self, tensors: list[TensorInfo], align: int) -> None:
        """Names unique, offsets aligned, and every tensor's bytes inside the file."""
        seen: set[str] = set()
        for t in tensors:
            if t.name in seen:
                raise ValueError(f"tensor '{t.name}' appears twice")
            seen.add(t.name)
            if t.offset % align:
                raise ValueError(f"tensor '{t.name}' starts at {t.offset}, not a multiple of the alignment {align}")
            size = tensor_nbytes(t.shape, t.type, t.name)
            if size is not None and t.offset + size > len(self.buf):
                raise ValueError(
                    f"tensor '{t.name}' ends at byte {t.offset + size} but the file has {len(self.buf)} (truncated)"
                )

    def _fits(self, count: int, item: int, what: str) -> None:
        if count * item > len(self.buf) - self.pos:
            raise ValueError(f"{what} is more than the file's remaining {len(self.buf) - self.pos} bytes can hold")

    def _scalar(self, kind: int, what: str):
        dtype = np.dtype(_SCALARS[kind])
        self._fits(1, dtype.itemsize, what)
        value = np.frombuffer(self.buf, dtype, 1, self.pos)[0]
        self.pos += dtype.itemsize
        return value.item()

    def _string(self, what: str) -> str:
        n = self._scalar(10, f"{what}'s length")
        self._fits(n, 1, f"{what}'s length ({n})")
        try:
            text = self.buf[self.pos : self.pos + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not valid UTF-8") from None
        self.pos += n
        return text

    def _strings(self, count: int, key: str) -> list[str]:
        """`_string` `count` times, in one loop: a vocabulary holds hundreds of thousands. An item that
        would not read cleanly is read by `_string`, which raises what is wrong with it."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _LENGTH.unpack_from
        for i in range(count):
            n = length(buf, pos)[0] if end - pos >= 8 else end
            try:
                if n > end - pos - 8:
                    raise ValueError
                out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
            except ValueError:  # UnicodeDecodeError included
                self.pos = pos
                self._string(f"metadata '{key}' item #{i}")  # raises, naming what is wrong
                raise
            pos += 8 + n
        self.pos = pos
        return out

    def _value(self, kind: int, key: str, depth: int = 0) -> Any:
        if kind == _STRING:
            return self._string(f"metadata '{key}'")
        if kind in _SCALARS:
            return self._scalar(kind, f"metadata '{key}'")
        if kind != _ARRAY:
            raise ValueError(f"metadata '{key}' has unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise ValueError(f"metadata '{key}' nests arrays more than {MAX_NESTING} deep")
        item, count = self._scalar(4, f"metadata '{key}' item type"), self._scalar(10, f"metadata '{key}' count")
        if item not in _SCALARS and item not in _MIN_ITEM:
            raise ValueError(f"metadata '{key}' has unknown item type {item}")
        size = _MIN_ITEM.get(item) or np.dtype(_SCALARS[item]).itemsize
        self._fits(count, size, f"metadata '{key}' item count ({count})")
        if item == _STRING:
            return self._strings(count, key)
        if item == _ARRAY:
            return [self._value(_ARRAY, key, depth + 1) for _ in range(count)]
        values = np.frombuffer(self.buf, np.dtype(_SCALARS[item]), count, self.pos).tolist()
        self.pos += size * count
        return values

    def _tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string(f"tensor name #{i}")
        n_dims = self._scalar(4, f"tensor '{name}' dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor '{name}' has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        dims = [self._scalar(10, f"tensor '{name}' shape") for _ in range(n_dims)]
        if not all(0 < d <= len(self.buf) * 8 for d in dims):  # no tensor has more values than the file has bits
            raise ValueError(f"tensor '{name}' has impossible shape {dims}")
        kind, offset = self._scalar(4, f"tensor '{name}' type"), self._scalar(10, f"tensor '{name}' offset")
        return name, tuple(reversed(dims)), kind, offset
