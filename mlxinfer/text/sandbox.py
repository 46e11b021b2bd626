"""A jinja2 sandbox bounded in time and size, for chat templates (untrusted code from model repos).

jinja2's sandbox stops attribute tricks but not work: nested `range` loops run for hours, and
`'x' * 3000000000` allocates gigabytes in one C call. So, on top of it:
- time: while a template renders, a trace function watches the template's own frames (the code
  jinja compiles, named "<template>") line by line and stops it past `TIME_LIMIT`; other frames are
  not traced, so the cost stays small;
- size: every string, list or number the template makes is bounded by `MAX_CHARS` *before* it is
  made where one operation could make it huge (`*`, `**`, `+`, `%`, calls and filters with a huge
  number), and after each line for what loops build up (`~`, `append`); the output is counted as
  it is produced.
Each limit is a one-line `TokenizerError`, as is everything else a template can raise.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..base.errors import TokenizerError

TIME_LIMIT = 2.0  # seconds; real templates render a long conversation in milliseconds
MAX_CHARS = 16 * 2**20  # a rendered prompt far beyond any context window
CHECK_EVERY = 4  # template lines between checks: a string doubling each line stays under 16x the bound
MAX_BITS = 4096  # numbers: arithmetic on huge integers is as slow as a loop
_WIDE_FORMAT = re.compile(r"[%{:][^%{}]*?[*]|\d{8,}")  # a '*' width, or a width of 8+ digits


class TemplateLimit(Exception):
    """A chat template went past a bound; carries the one-line reason."""


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_CHARS:
        raise TemplateLimit(f"{what} is over {MAX_CHARS:,} items")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise TemplateLimit(f"{what} is a number over {MAX_BITS} bits")
    return value


def _weight(value: Any) -> int:
    """Items plus the characters of the strings among them: what `*`, `+` and a later `join` cost."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(item) for item in value if isinstance(item, (str, bytes)))
    return 1


def _check_args(args: tuple, kwargs: dict, what: str) -> None:
    """Numbers that would size a result: a width, a count."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
            raise TemplateLimit(f"{what} got the number {value}, over {MAX_CHARS:,}")


def _guarded(name: str, f: Callable) -> Callable:
    """`f` with its size arguments and its result checked."""
    def call(*args: Any, **kwargs: Any) -> Any:
        # The filtered value itself (args[0], or args[1] after a context) may be any number.
        start = 2 if getattr(f, "jinja_pass_arg", None) else 1
        if name == "format" and isinstance(args[start - 1], str) and _WIDE_FORMAT.search(args[start - 1]):
            raise TemplateLimit("filter format asks for a width of millions of characters")
        _check_args(args[start:], kwargs, f"filter {name}")
        return _check_size(f(*args, **kwargs), f"the result of filter {name}")

    if hasattr(f, "jinja_pass_arg"):  # jinja passes the context or environment first to such filters
        call.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]

    return call


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with operators, calls and filters checked against `MAX_CHARS`."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters = {name: _guarded(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, f: Callable) -> None:
        self.filters[name] = _guarded(name, f)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for item, count in ((left, right), (right, left)):
                if isinstance(count, int) and not isinstance(item, int) and _weight(item) * count > MAX_CHARS:
                    raise TemplateLimit(f"'*' would make over {MAX_CHARS:,} items")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * left.bit_length() > MAX_BITS:
            raise TemplateLimit(f"'**' would make a number over {MAX_BITS} bits")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise TemplateLimit("'%' formatting asks for a width of millions of characters")
        elif operator == "+" and _weight(left) + _weight(right) > MAX_CHARS:
            raise TemplateLimit(f"'+' would make over {MAX_CHARS:,} items")
        return _check_size(super().call_binop(context, operator, left, right), f"the result of '{operator}'")

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        what = f"call to {getattr(__obj, '__name__', type(__obj).__name__)}"
        _check_args(args, kwargs, what)
        return _check_size(super().call(__context, __obj, *args, **kwargs), f"the result of the {what}")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _WIDE_FORMAT.search(value.__self__):
            raise TemplateLimit("str.format asks for a width of millions of characters")
        return wrapped


def render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template.render(**variables)` within the time and size bounds; any failure is one TokenizerError."""
    pieces: list[str] = []
    total = 0
    try:
        with _deadline(TIME_LIMIT):
            for piece in template.generate(**variables):
                total += len(piece)
                if total > MAX_CHARS:
                    raise TemplateLimit(f"its output is over {MAX_CHARS:,} characters")
                pieces.append(piece)
    except TokenizerError:
        raise
    except TemplateLimit as e:
        raise TokenizerError(f"chat template stopped: {e}; fix the template or pass a raw prompt") from e
    except (jinja2.TemplateError, ArithmeticError, MemoryError, RecursionError, TypeError, ValueError,
            LookupError, AttributeError) as e:
        raise TokenizerError(
            f"chat template failed to render: {' '.join(str(e).split())}; check the messages or pass a raw prompt"
        ) from e
    return "".join(pieces)


class _deadline:
    """Trace the template's frames and raise `TemplateLimit` past `seconds` or on a huge local."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self) -> None:
        self.previous = sys.gettrace()
        self.end = time.monotonic() + self.seconds
        self.lines = 0
        sys.settrace(self._on_call)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)

    def _on_call(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        return self._on_line if frame.f_code.co_filename == "<template>" else None

    def _on_line(self, frame: FrameType, event: str, arg: Any) -> Callable:
        self.lines += 1
        if self.lines % CHECK_EVERY == 0:
            if time.monotonic() > self.end:
                raise TemplateLimit(f"it ran for over {self.seconds:g} s")
            for local, value in frame.f_locals.items():
                name = re.sub(r"^l_\d+_", "", local)  # jinja compiles `x` to `l_0_x`
                _check_size(value, f"variable {name}")
                if isinstance(value, Namespace):  # `{% set ns.x = ns.x ~ ns.x %}` grows it in place
                    for attr, item in object.__getattribute__(value, "_Namespace__attrs").items():
                        _check_size(item, f"{name}.{attr}")
        return self._on_line

