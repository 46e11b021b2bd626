"""LoRA: low-rank updates on a loaded model's linear and expert layers, several adapters at once.

A layer an adapter targets is wrapped (`LoRALinear`, `LoRASwitchLinear`) around its base layer,
which stays as it was (a quantized base stays quantized, and with no adapter selected the
wrapper returns its output untouched). Each adapter adds `B·(A·x)` (the scale folded into B);
DoRA rescales each output row by `magnitude / ‖W + s·B·A‖` (computed once, when the adapter is
loaded: the weights never change).

Which adapter each row of a batch uses is set around one forward pass (`selecting`): rows with
different adapters (and rows with none) share the base product, and each row adds only its own
update: the A and B of each row's adapter are gathered from a stack of every adapter the layer
has (zero-padded to one rank, slot 0 all zeros for the base), so a batch costs one more
batched product per layer, not one per adapter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import InvalidOptionError

MAX_NAME_CHARS = 128


def adapter_name(name: Any) -> str:
    """`name` if it may name an adapter: 1 to `MAX_NAME_CHARS` printable characters (no newline,
    NUL or other control character: a name is echoed in model ids, listings, logs and one-line
    errors), without ':' or '/' (a server's model id `BASE:NAME` must split one way)."""
    if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and name.isprintable()
            and ":" not in name and "/" not in name):
        shown = repr(name[:40]) + (f"... ({len(name):,} characters)" if len(name) > 40 else "") \
            if isinstance(name, str) else type(name).__name__
        raise InvalidOptionError(f"adapter name {shown} is refused: a name is 1 to {MAX_NAME_CHARS} printable "
                                 "characters (no newline, NUL or other control character), without ':' or '/'")
    return name


@dataclass(frozen=True)
class Update:
    """One adapter's update of one layer: `a` [r, in] and `b` [out, r], the scale folded into b
    (experts: [E, r, in] and [E, out, r]); DoRA's `gain` [out] multiplies the adapted output
    (bias excluded)."""

    a: mx.array
    b: mx.array
    gain: mx.array | None = None


class Adapters:
    """The adapters registered on one model, each in a slot (0 is the base), and the slots of
    the rows of the forward pass being built (None outside one: every row the default's)."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}
        self.default: str | None = None  # the adapter a row that names none uses
        self.rows: tuple[int, ...] | None = None
        self.version = 0  # bumped on every change, so layers rebuild their stacks
        self._serial = 0
        self._identity: dict[str, int] = {}

    def check_free(self, name: str) -> None:
        """Refuse `name` unless a new adapter may take it (`adapter_name`, and not loaded)."""
        if adapter_name(name) in self.slots:
            raise InvalidOptionError(f"an adapter named '{name}' is already loaded; unload it or choose another name")

    def add(self, name: str) -> int:
        self.check_free(name)
        slot = next(s for s in range(1, len(self.slots) + 2) if s not in self.slots.values())
        self.slots[name] = slot
        self._serial += 1
        self._identity[name] = self._serial
        self.version += 1
        return slot

    def remove(self, name: str) -> int:
        slot = self.slot(name)
        del self.slots[name], self._identity[name]
        if self.default == name:
            self.default = None
        self.version += 1
        return slot

    def resolve(self, name: str | None) -> str | None:
        """The adapter a row asking for `name` runs with (None: the model's default)."""
        return self.default if name is None else name

    def slot(self, name: str | None) -> int:
        name = self.resolve(name)
        if name is None:
            return 0
        if name not in self.slots:
            known = ", ".join(sorted(self.slots)) or "none is loaded"
            raise InvalidOptionError(f"no adapter named '{name}' is loaded on this model (loaded: {known})")
        return self.slots[name]

    def identity(self, name: str | None) -> int:
        """A number that differs for every adapter ever loaded (0: the base), so K/V made with
        one is never taken for another's, even after an unload and a load under the same name."""
        name = self.resolve(name)
        self.slot(name)
        return 0 if name is None else self._identity[name]

    @contextmanager
    def selecting(self, names: Sequence[str | None]) -> Iterator[None]:
        self.rows = tuple(self.slot(n) for n in names)
        try:
            yield
        finally:
            self.rows = None


def adapters_of(model: nn.Module) -> Adapters | None:
    """The model's adapter registry (None: no adapter was ever loaded on it)."""
    return model.__dict__.get("adapters")


def registry(model: nn.Module) -> Adapters:
    """The model's adapter registry, made on first use."""
    found = adapters_of(model)
    if found is None:
        found = Adapters()
        object.__setattr__(model, "adapters", found)
    return found


_NONE = Adapters()  # what a model that never had an adapter has: its rows all run the base


@contextmanager
def selecting(model: nn.Module, names: Sequence[str | None]) -> Iterator[None]:
    """Build the forward pass inside with row i running adapter `names[i]` (None: the default)."""
    with (adapters_of(model) or _NONE).selecting(names):
        yield


def identity(model: nn.Module, name: str | None) -> int:
    """`Adapters.identity` of the model's registry (refusing a name it does not have)."""
    return (adapters_of(model) or _NONE).identity(name)


class _Table:
    """A layer's updates by slot and their stacks (rebuilt when the registry changes); a plain
    object, so the arrays stay out of the model's parameter tree."""

    def __init__(self, adapters: Adapters):
        self.adapters = adapters
        self.updates: dict[int, Update] = {}
        self._stack: tuple[int, mx.array, mx.array, mx.array | None] | None = None
        self._fused: tuple[int, tuple[mx.array, mx.array] | None] | None = None

    def uniform(self) -> Update | None | bool:
        """The one update every row uses (outside `selecting`: the default adapter's), None
        where they all use none, False when rows differ."""
        rows = self.adapters.rows
        if rows is None:
            return self.updates.get(self.adapters.slot(None))
        if not any(slot in self.updates for slot in rows):
            return None
        return self.updates[rows[0]] if len(set(rows)) == 1 else False

    def stack(self) -> tuple[mx.array, mx.array, mx.array | None]:
        """Every slot's a and b zero-padded to one rank and stacked [slots, ...] (slot 0 and
        slots without an update all zeros), and the gains (ones where none) if any has one."""
        version = self.adapters.version
        if self._stack is None or self._stack[0] != version:
            self._stack = (version, *self._build())
        return self._stack[1:]

    def fused_stacks(self) -> tuple[mx.array, mx.array] | None:
        """A's stack and B's transposed [slots, rank, out] (contiguous, kept per registry version)
        as the CPU layer primitives take them; None where an update has a DoRA gain or the
        stacks are not float32 (those rows take the per-op path)."""
        version = self.adapters.version
        if self._fused is None or self._fused[0] != version:
            a, b, gains = self.stack()
            ok = gains is None and a.dtype == b.dtype == mx.float32
            self._fused = (version, (a, mx.contiguous(b.swapaxes(-1, -2))) if ok else None)
            if ok:
                mx.eval(self._fused[1])
        return self._fused[1]

    def _build(self) -> tuple[mx.array, mx.array, mx.array | None]:
        some = next(iter(self.updates.values()))
        rank = max(u.a.shape[-2] for u in self.updates.values())
        slots = max(self.adapters.slots.values(), default=0) + 1
        a = mx.zeros((slots, *some.a.shape[:-2], rank, some.a.shape[-1]), some.a.dtype)
        b = mx.zeros((slots, *some.b.shape[:-1], rank), some.b.dtype)
        gains = any(u.gain is not None for u in self.updates.values())
        g = mx.ones((slots, some.b.shape[-2]), some.b.dtype) if gains else None
        for slot, u in self.updates.items():
            r = u.a.shape[-2]
            a[slot, ..., :r, :] = u.a
            b[slot, ..., :r] = u.b
            if g is not None and u.gain is not None:
                g[slot] = u.gain
        mx.eval(a, b, *([] if g is None else [g]))
        return a, b, g


def _bias(base: nn.Module) -> mx.array | None:
    return base["bias"] if "bias" in base else None


def _adapted(y: mx.array, delta: mx.array, gain: mx.array | None, bias: mx.array | None) -> mx.array:
    """The base output `y` (bias included) plus `delta`, DoRA's gain applied to all but the bias."""
    if gain is None:
        return y + delta.astype(y.dtype)
    if bias is None:
        return (gain * (y + delta)).astype(y.dtype)
    return (gain * (y - bias + delta) + bias).astype(y.dtype)


class LoRALinear(nn.Module):
    """A Linear or QuantizedLinear with adapters' low-rank updates added per row."""

    def __init__(self, base: nn.Module, adapters: Adapters):
        super().__init__()
        self.base = base
        self.table = _Table(adapters)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        one = self.table.uniform()
        if one is None:
            return y
        if one is not False:
            return _adapted(y, (x @ one.a.T) @ one.b.T, one.gain, _bias(self.base))
        a, b, g = self.table.stack()
        slots = mx.array(self.table.adapters.rows)
        rows = x.reshape(x.shape[0], -1, x.shape[-1])
        delta = ((rows @ a[slots].swapaxes(-1, -2)) @ b[slots].swapaxes(-1, -2)).reshape(*x.shape[:-1], -1)
        gain = None if g is None else g[slots].reshape(x.shape[0], *([1] * (x.ndim - 2)), -1)
        return _adapted(y, delta, gain, _bias(self.base))


class LoRASwitchLinear(nn.Module):
    """A (Quantized)SwitchLinear with adapters' per-expert low-rank updates added per row."""

    def __init__(self, base: nn.Module, adapters: Adapters):
        super().__init__()
        self.base = base
        self.table = _Table(adapters)

    @property
    def num_experts(self) -> int:
        return self.base.num_experts

    @property
    def row_bound(self) -> bool:
        """Rows use different adapters: routed rows must stay in batch order (see moe.SwitchGLU)."""
        return self.table.uniform() is False

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base(x, indices, sorted_indices)
        one = self.table.uniform()
        if one is None:
            return y
        if one is not False:
            a, b, experts = one.a, one.b, indices
        else:  # slot s's expert e is row s * E + e of the stacks
            a, b, _ = self.table.stack()
            a, b = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
            slots = mx.array(self.table.adapters.rows).reshape(-1, *([1] * (indices.ndim - 1)))
            experts = slots * self.num_experts + indices
        z = mx.gather_mm(x, a.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=sorted_indices)
        return y + mx.gather_mm(z, b.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=sorted_indices).astype(y.dtype)

    def dense(self, x: mx.array, expert: int) -> mx.array:
        """Expert `expert` on rows of one adapter (the caller sorted them: see `row_bound`)."""
        y = self.base.dense(x, expert)
        one = self.table.uniform()
        if not one:
            return y
        return y + ((x @ one.a[expert].T) @ one.b[expert].T).astype(y.dtype)
