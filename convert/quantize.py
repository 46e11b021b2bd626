"""What precision each tensor gets: uniform affine quantization, one of MLX's floating-point
modes (mxfp4, mxfp8, nvfp4), mixed recipes, or none.

The recipes follow mlx-lm's `mixed_*` predicates (llama.cpp's Q4_K_M idea): the
tensors the output is most sensitive to keep more bits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.loading.checkpoint import FLOAT_MODES, parse_dtype

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")
MAX_TARGET_BPW = 8.5
_LAYER = re.compile(r"\.layers\.(\d+)\.")


MODES = ("affine", *FLOAT_MODES)
METHODS = ("rtn", "gptq")  # plain rounding to the nearest level; GPTQ's error-compensating rounding (calibrate.py)


@dataclass(frozen=True)
class QuantSpec:
    """MLX quantization of one layer: `bits` per weight and, per `group_size` weights, a scale and
    a bias (affine) or a scale alone (the floating-point modes, their scales stored as uint8)."""

    bits: int
    group_size: int
    mode: str = "affine"

    def as_config(self) -> dict[str, int | str]:
        """The per-layer entry mlx-lm writes into config.json."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @property
    def affine(self) -> bool:
        return self.mode == "affine"

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the packed uint32 weight and of its scales (= biases) for a float `shape`."""
        *rows, cols = shape
        return (*rows, cols * self.bits // 32), (*rows, cols // self.group_size)

    def fits(self, shape: tuple[int, ...]) -> bool:
        return shape[-1] % self.group_size == 0

    def __str__(self) -> str:
        return f"{self.bits}-bit g{self.group_size}" if self.affine else self.mode


@dataclass(frozen=True)
class Recipe:
    """Mixed precision: `high` bits for the embedding, LM head and the sensitive v/down projections."""

    low: int
    high: int

    def bits(self, path: str, num_layers: int) -> int:
        if "embed_tokens" in path or "lm_head" in path:
            return self.high
        if ("v_proj" in path or "down_proj" in path) and sensitive_layer(path, num_layers):
            return self.high
        return self.low


RECIPES = {"mixed-3-6": Recipe(3, 6), "mixed-4-6": Recipe(4, 6), "mixed-4-8": Recipe(4, 8)}


def sensitive_layer(path: str, num_layers: int) -> bool:
    """The first and last eighth of the layers and every third one between (mlx-lm's rule)."""
    match = _LAYER.search(path)
    index = int(match.group(1)) if match else 0
    eighth = num_layers // 8
    return index < eighth or index >= 7 * num_layers // 8 or (index - eighth) % 3 == 2


@dataclass(frozen=True)
class Options:
    """Validated conversion settings."""

    quantize: bool = False
    bits: int | None = None  # default: 4, or what a floating-point mode fixes
    group_size: int | None = None  # default: 64, or what a floating-point mode fixes
    recipe: str | None = None
    dtype: str | None = None
    dequantize: bool = False
    shard_size: int = 5 << 30
    mode: str = "affine"
    quantize_vision: bool = False  # a vision-language model's vision tower too (`CausalLM.unquantized`)
    target_bpw: float | None = None  # `allocate` chooses each tensor's bits and group size for this size
    method: str = "rtn"  # how each tensor is rounded (METHODS)
    calibration_tokens: int | None = None  # default: calibrate.DEFAULT_TOKENS

    def __post_init__(self) -> None:
        self._check_target()
        if self.mode not in MODES:
            raise InvalidOptionError(f"--q-mode {self.mode!r} is not an MLX quantization mode; choose one of "
                                     f"{_list(MODES)}")
        fixed = FLOAT_MODES.get(self.mode)
        if fixed is not None:
            for flag, given, own in (("--bits", self.bits, fixed[0]), ("--group-size", self.group_size, fixed[1])):
                if given not in (None, own):
                    raise InvalidOptionError(f"--q-mode {self.mode} has {flag} {own}; drop {flag} {given}")
            if self.recipe is not None:
                raise InvalidOptionError(f"--recipe mixes affine widths; it cannot be combined with --q-mode "
                                         f"{self.mode}")
        bits, group_size = fixed or (4, 64)  # the defaults: 4-bit affine, 64 weights a group
        object.__setattr__(self, "bits", bits if self.bits is None else self.bits)
        object.__setattr__(self, "group_size", group_size if self.group_size is None else self.group_size)
        if self.bits not in BITS:
            raise InvalidOptionError(f"--bits {self.bits} is not supported by MLX; choose one of {_list(BITS)}")
        if self.group_size not in GROUP_SIZES and self.mode == "affine":
            raise InvalidOptionError(
                f"--group-size {self.group_size} is not supported by MLX; choose one of {_list(GROUP_SIZES)}"
            )
        if self.recipe is not None and self.recipe not in RECIPES:
            raise InvalidOptionError(f"unknown recipe '{self.recipe}'; choose one of {_list(RECIPES)}")
        parse_dtype(self.dtype)
        if self.dequantize and self.quantizing:
            raise InvalidOptionError("--dequantize cannot be combined with -q/--recipe/--q-mode/--target-bpw/--method; "
                                     "choose one")
        self._check_method()
        if self.shard_size <= 0:
            raise InvalidOptionError(f"--shard-size must be positive, got {self.shard_size} bytes")

    def _check_target(self) -> None:
        """--target-bpw chooses bits and group sizes itself: refuse what would also choose them."""
        if self.target_bpw is None:
            return
        for flag, given in (("--bits", self.bits), ("--group-size", self.group_size), ("--recipe", self.recipe)):
            if given is not None:
                raise InvalidOptionError(f"--target-bpw chooses each tensor's bits and group size; drop {flag}")
        if self.mode != "affine":
            raise InvalidOptionError(f"--target-bpw allocates affine widths; drop --q-mode {self.mode}")
        if not 0 < self.target_bpw <= MAX_TARGET_BPW:
            raise InvalidOptionError(f"--target-bpw {self.target_bpw:g} is out of range; pass bits per weight "
                                     f"above 0 and at most {MAX_TARGET_BPW} (8-bit with its scales)")

    def _check_method(self) -> None:
        if self.method not in METHODS:
            raise InvalidOptionError(f"--method {self.method!r} is unknown; choose one of {_list(METHODS)}")
        if not self.calibrated:
            if self.calibration_tokens is not None:
                raise InvalidOptionError("--calibration-tokens is for a calibrated conversion; pass --method gptq or "
                                         "--target-bpw, or drop --calibration-tokens")
            return
        if self.mode != "affine":
            raise InvalidOptionError(f"--method {self.method} quantizes to the affine grid; drop --q-mode {self.mode}")
        if self.calibration_tokens is not None and self.calibration_tokens < 2:
            raise InvalidOptionError(f"--calibration-tokens {self.calibration_tokens} is too few; give at least 2 "
                                     "(a few thousand calibrate well)")

    @property
    def calibrated(self) -> bool:
        """Whether the conversion measures the source on calibration text first."""
        return self.method != "rtn" or self.target_bpw is not None

    @property
    def quantizing(self) -> bool:
        return self.quantize or self.recipe is not None or self.mode != "affine" or self.calibrated

    def target(self, path: str, num_layers: int) -> QuantSpec:
        """The precision a quantizable layer at `path` should get when quantizing."""
        bits = RECIPES[self.recipe].bits(path, num_layers) if self.recipe else self.bits
        return QuantSpec(bits, self.group_size, self.mode)

    def float_dtype(self, default: mx.Dtype) -> mx.Dtype:
        """--dtype when given, else the source's own float dtype."""
        return parse_dtype(self.dtype) or default


def dtype_name(dtype: mx.Dtype) -> str:
    """'float16' for mx.float16, as config.json and the report spell it."""
    return str(dtype).removeprefix("mlx.core.")


def _list(values) -> str:
    return ", ".join(str(v) for v in values)
