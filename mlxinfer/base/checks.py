"""Checks for values that come from outside (options, token ids), shared by every layer.

Each failure is one `InvalidOptionError` naming the value and what is allowed, raised
before MLX sees the value: MLX gathers rows without bounds checks, so a token id
outside the vocabulary reads or writes arbitrary memory (a crash, a corrupted heap,
or silently wrong text) instead of failing, and a wrong-typed option fails deep
inside a generation as a traceback.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from .errors import InvalidOptionError

INDEX_MAX = 2**31 - 1  # MLX slices and indexes with 32-bit integers: sizes and counts stay below this
# Options become float32 on the device; a larger one turns to inf there, and inf * 0 to NaN.
FLOAT_MAX = 3.4028234663852886e38


def is_integer(value: Any) -> bool:
    """An int (numpy's too), but not a bool: `True` as a token id or a size is a mistake."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(name: str, value: Any, minimum: int, maximum: int = INDEX_MAX) -> None:
    """`value` is an integer in [minimum, maximum]."""
    rule = f">= {minimum}" if maximum == INDEX_MAX else f"in [{minimum}, {maximum}]"
    if not is_integer(value):
        raise InvalidOptionError(f"{name} must be an integer {rule}, got {value!r}")
    if value < minimum:
        raise InvalidOptionError(f"{name} must be {rule}, got {value}")
    if value > maximum:
        raise InvalidOptionError(f"{name} must be <= {maximum}, got {value}")


def number(name: str, value: Any, rule: str = "", ok: Callable[[float], bool] = lambda x: True) -> None:
    """`value` is a finite real number for which `ok` holds (`rule` says what that means)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    try:
        finite = real and math.isfinite(value) and abs(value) <= FLOAT_MAX
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise InvalidOptionError(f"{name} must be a finite number (at most {FLOAT_MAX:.4g} in size), got {value!r}")
    if not ok(value):
        raise InvalidOptionError(f"{name} must be {rule}, got {value}")


def flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {value!r}")


def token_ids(ids: Iterable[Any], vocab_size: int, what: str) -> list[int]:
    """`ids` as a list of ints, each a valid index into a vocabulary of `vocab_size`
    tokens (the model's embedding rows and logits width)."""
    if not isinstance(ids, Iterable) or isinstance(ids, (str, bytes)):
        raise InvalidOptionError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for i in ids:
        if not is_integer(i) or not 0 <= i < vocab_size:
            raise InvalidOptionError(
                f"{what} holds {i!r}, which is not a token id of this model (integers in [0, {vocab_size}))"
            )
        out.append(int(i))
    return out
