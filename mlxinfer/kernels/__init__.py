"""Custom Metal kernels and their references in plain MLX ops, behind one
dispatching function each: the engine and the speculative decoder call only these.

A dispatcher runs the Metal kernel when Metal is available, the kernel handles
the shapes, `MLXINFER_KERNELS` is not `reference`, and the kernel has not been
disabled (by `mlxinfer doctor` after disagreeing with its reference); otherwise
the reference, whose inputs, outputs and semantics are the same. The first time
a process is about to run a kernel, it is checked against its reference on small
random inputs (`check`, cases in `selfcheck`), so a kernel that is wrong on this GPU is
disabled with a warning before it can touch any output.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import mlx.core as mx

from ..base.errors import InvalidOptionError
from . import attention, sampling, selfcheck, verification
from .sampling import SamplingParams
from .selfcheck import Check, Sizes

NAMES = ("attention", "sampling", "verify")
MODES = ("auto", "reference")
_disabled: dict[str, str] = {}
_checked: set[str] = set()


def metal_available() -> bool:
    return mx.metal.is_available()


def mode() -> str:
    value = os.environ.get("MLXINFER_KERNELS", "auto")
    if value not in MODES:
        raise InvalidOptionError(f"MLXINFER_KERNELS must be one of {', '.join(MODES)}, got {value!r}")
    return value


def implementation(name: str) -> str:
    """'metal' or 'reference': what the dispatcher `name` runs (for shapes the kernel handles)."""
    if mode() == "reference" or not metal_available() or name in _disabled:
        return "reference"
    return "metal"


def selection() -> dict[str, str]:
    return {name: implementation(name) for name in NAMES}


def disable(name: str, reason: str) -> None:
    """Run the reference instead of kernel `name` for the rest of this process."""
    _disabled[name] = reason


def disabled() -> dict[str, str]:
    return dict(_disabled)


def enable_all() -> None:
    _disabled.clear()


def _use_kernel(name: str) -> bool:
    """Whether dispatcher `name` runs its kernel; the first time, after a self-check."""
    if implementation(name) != "metal":
        return False
    if name not in _checked:
        _checked.add(name)
        result = check(name, selfcheck.SMALL, repeat=0)
        if not result.ok:
            warnings.warn(f"mlxinfer: kernel '{name}' disagrees with its reference ({result.metric} "
                          f"{result.error:.3g}); the reference runs instead", RuntimeWarning, stacklevel=3)
    return name not in _disabled


def check(name: str, sizes: Sizes = Sizes(), repeat: int = 5, seed: int = 0) -> Check:
    """Kernel `name` against its reference on random inputs; disabled for the rest of this
    process if they disagree beyond the tolerance, so a wrong kernel never touches output."""
    result = selfcheck.compare(selfcheck.case(name), sizes, repeat, seed)
    if not result.ok:
        disable(name, f"{result.metric} {result.error:.3g} > {result.tolerance:.3g} against the reference")
    return result


def quantized_attention(q: mx.array, keys: tuple[mx.array, ...], values: tuple[mx.array, ...], scale: float, mask,
                        group_size: int, bits: int, length: int | None = None) -> mx.array:
    """Attention of q [B, H, T, D] over the first `length` slots (default: all) of
    quantized key/value buffers, read in place; see kernels.attention."""
    length = keys[0].shape[2] if length is None else length
    use_kernel = attention.supported(q, group_size, bits) and _use_kernel("attention")
    impl = attention.metal if use_kernel else attention.reference
    return impl(q, keys, values, scale, mask, group_size, bits, length)


def sample(logits: mx.array, u: mx.array, params: SamplingParams) -> mx.array:
    """Tokens [B] from logits [B, V] after temperature/top-k/top-p/min-p, at uniforms u [B]."""
    impl = sampling.metal if _use_kernel("sampling") else sampling.reference
    return impl(logits, u, params)


def verify(p: mx.array, drafts: Sequence[int], q: mx.array | None, u: mx.array) -> mx.array:
    """(accepted, token) as int32 [2] by exact speculative sampling; see kernels.verification."""
    impl = verification.metal if _use_kernel("verify") else verification.reference
    return impl(p, drafts, q, u)


__all__ = ["NAMES", "SamplingParams", "check", "disable", "disabled", "enable_all", "implementation",
           "metal_available", "mode", "quantized_attention", "sample", "selection", "verify"]
