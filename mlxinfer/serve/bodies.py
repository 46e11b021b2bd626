"""Request bodies read as a server must read a stranger's: within a size and a time bound
(`body_of`), strict JSON in UTF-8 nested and sized within bounds (`load_json`), then validated
by the API's own pydantic model on a worker thread (`parsed`)."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel

from .errors import RequestError

BODY_SECONDS = 30  # from the headers to the body's last byte
M = TypeVar("M", bound=BaseModel)


MAX_BODY_DEPTH = 128
# Most objects and arrays in one body: far above any real request (a conversation of thousands of
# messages, a schema, a batch of token lists), far below what 4 MiB of `{}` holds (1.3 million), so
# no validator ever meets a million values that each fail (a million errors take a minute to list).
MAX_BODY_CONTAINERS = 100_000
_CONTAINERS = frozenset({dict, list})  # what json.loads makes of objects and arrays (never a subclass)
_SURROGATE = re.compile("[\ud800-\udfff]")
# An escape that may decode to an unpaired surrogate: a high one not followed by a low one, or a low
# one not after a high one (a pair, as clients that escape emoji write them, decodes to one character).
# It begins with a literal (backslash, u), so the regex engine skips from escape to escape at C speed.
_LONE_ESCAPE = re.compile(r"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                          r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD])[c-fC-F][0-9a-fA-F]{2})")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def load_json(raw: bytes) -> Any:
    """Strict JSON in UTF-8 (RFC 8259; no NaN or Infinity, no number that overflows), nested at
    most MAX_BODY_DEPTH deep, at most MAX_BODY_CONTAINERS objects and arrays, every string valid
    Unicode; anything else a 400 saying what is wrong. Linear in the body, and at C speed for all
    but a body that breaks a rule (`_fault` then walks it once to name the place)."""
    try:
        text = raw.decode("utf-8-sig")  # strict: no surrogate can come from the bytes, only from escapes
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid JSON in UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise RequestError(f"the request body is nested too deeply (the limit is {MAX_BODY_DEPTH})") from None
    except ValueError as e:  # JSONDecodeError, an integer of too many digits
        raise RequestError(f"the request body is not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not _within_bounds(data) or _LONE_ESCAPE.search(text):
        _fault(data)
    return data


def _within_bounds(data: Any) -> bool:
    """Whether `data` is at most MAX_BODY_DEPTH deep (one with too many containers is refused
    here). Walked level by level over its containers only: the values of one are looked at in
    Python only when C code (`map(type, ...)`) found a container among them, so a list of a
    million numbers costs one pass at C speed."""
    level, containers = [data] if type(data) in _CONTAINERS else [], 0
    for depth in range(MAX_BODY_DEPTH + 1):
        if not level:
            return True
        containers += len(level)
        if containers > MAX_BODY_CONTAINERS:
            raise RequestError(f"the request body holds over {MAX_BODY_CONTAINERS:,} JSON objects and arrays (the "
                               "limit); send fewer items, or split the request")
        if depth == MAX_BODY_DEPTH:
            return not any(level)  # anything inside these is too deep
        below: list = []
        for value in level:
            values = value.values() if type(value) is dict else value
            if not _CONTAINERS.isdisjoint(map(type, values)):
                below.extend(v for v in values if type(v) in _CONTAINERS)
        level = below
    return True


def _fault(data: Any) -> None:
    """Name what is wrong with a body `load_json` found at fault (too deep, or an unpaired
    surrogate in a key or string), walking it without recursion (a deep body must not overflow us)."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise RequestError(f"the request body is nested over {MAX_BODY_DEPTH} deep; the limit is {MAX_BODY_DEPTH}",
                               _dotted(path[:4]))
        if isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise RequestError("a key holds an unpaired UTF-16 surrogate (not valid Unicode)", _dotted(path))
                stack.append((item, (*path, key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, (*path, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise RequestError(f"{_dotted(path) or 'the body'} holds an unpaired UTF-16 surrogate (not valid "
                               "Unicode); send UTF-8 text", _dotted(path))


def _dotted(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None


async def body_of(request: Request, max_body: int) -> bytes:
    """The body, read no further than `max_body` bytes nor longer than BODY_SECONDS."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body:
        raise RequestError(f"the request body is over {max_body} bytes", status=413)
    body = bytearray()

    async def read() -> None:
        async for part in request.stream():
            body.extend(part)
            if len(body) > max_body:
                raise RequestError(f"the request body is over {max_body} bytes", status=413)

    try:
        await asyncio.wait_for(read(), BODY_SECONDS)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {BODY_SECONDS} s", status=408) from None
    return bytes(body)


def json_object(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object (strict: `load_json`)."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return data


async def parsed(request: Request, max_body: int, parse: Callable[[bytes, type[M]], M], kind: type[M]) -> M:
    """The body as `kind`, read within bounds (`body_of`), then parsed and validated by `parse`
    (each API's own, which words its refusals) on a worker thread: that work grows with the
    body, and the event loop must go on answering every other client meanwhile."""
    return await asyncio.to_thread(parse, await body_of(request, max_body), kind)
