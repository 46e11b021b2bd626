"""Read GGUF files (llama.cpp's format) without loading them whole.

The header and metadata are parsed once; tensor data stays memory-mapped and is
converted one tensor at a time, so a conversion never holds the whole model.
Q8_0, Q4_0 and Q4_1 blocks are exactly MLX affine quantization with group size
32 (w = scale * q + bias), so they are repacked bit for bit; K-quants and other
types are dequantized with llama.cpp's own `gguf` package (an optional extra).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxinfer.errors import ConversionError, CorruptCheckpointError

from .quantize import QuantSpec

MAGIC = b"GGUF"
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
FLOAT_TYPES = {F32: np.dtype("<f4"), F16: np.dtype("<f2"), BF16: np.dtype("<u2")}
# Legacy block layouts: 32 weights per block, fp16 scale `d` (and Q4_1's fp16 minimum `m`).
BLOCK_TYPES = {
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
}
_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
# Metadata value types: GGUF type id -> numpy dtype; 8 is a string, 9 an array.
_SCALARS = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Packed:
    """A layer already in MLX affine form: packed uint32 weight plus per-group scales and biases."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    spec: QuantSpec


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
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, KeyError) as e:
            raise CorruptCheckpointError(
                f"{path.name} is not a valid GGUF file ({type(e).__name__}: {e}); re-download it"
            ) from None

    def close(self) -> None:
        # A traceback may still hold a view of the map; it is then closed when collected.
        with contextlib.suppress(BufferError):
            self._map.close()

    def read(self, info: TensorInfo) -> mx.array | Packed:
        """One tensor: floats as they are stored, legacy quants repacked, other types dequantized."""
        if info.type in FLOAT_TYPES:
            array = mx.array(self._view(info, FLOAT_TYPES[info.type], int(np.prod(info.shape))).reshape(info.shape))
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
    return int(np.prod(info.shape[:-1])), info.shape[-1]


def _repack(blocks: np.ndarray, kind: int, shape: tuple[int, ...]) -> Packed:
    """Legacy GGUF blocks as MLX affine quantization (values in a uint32 fill it from the low bits).

    Q8_0 stores signed q * d: shift q by 128 and use bias -128 d. Q4_0 stores (q - 8) * d:
    bias -8 d. Q4_1 stores q * d + m: bias m. Powers of two times d are exact in fp16.
    """
    rows = blocks.shape[0]
    d = blocks["d"]
    if kind == Q8_0:
        packed = (blocks["qs"].view(np.uint8) ^ np.uint8(0x80)).reshape(rows, -1)
        bits, bias = 8, d * np.float16(-128)
    else:
        qs = blocks["qs"]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # a block's 32 weights in order
        packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).reshape(rows, -1)
        bits, bias = 4, (blocks["m"] if kind == Q4_1 else d * np.float16(-8))
    spec = QuantSpec(bits, 32)
    wshape, sshape = spec.packed_shape(shape)
    # Contiguous copies first: mx.array of a strided view would keep the whole block buffer.
    weight, scales, biases = (np.ascontiguousarray(a) for a in (packed, d, bias))
    return Packed(
        mx.array(weight.view("<u4").reshape(wshape)), mx.array(scales.reshape(sshape)),
        mx.array(biases.reshape(sshape)), spec,
    )


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


class _Parser:
    """Sequential reader of the GGUF header: magic, version, counts, metadata, tensor infos."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        if self.buf[:4] != MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes")
        self.pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        metadata = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(metadata.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        tensors = [TensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in infos]
        return metadata, tensors

    def _scalar(self, kind: int):
        dtype = np.dtype(_SCALARS[kind])
        value = np.frombuffer(self.buf, dtype, 1, self.pos)[0]
        self.pos += dtype.itemsize
        return value.item()

    def _string(self) -> str:
        n = self._scalar(10)
        text = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            return self._scalar(kind)
        item, count = self._scalar(4), self._scalar(10)
        if item == _STRING:
            return [self._string() for _ in range(count)]
        if item == _ARRAY:
            return [self._value(_ARRAY) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += dtype.itemsize * count
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = [self._scalar(10) for _ in range(self._scalar(4))]
        return name, tuple(reversed(dims)), self._scalar(4), self._scalar(10)
