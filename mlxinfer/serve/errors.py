"""The server's refusals: `RequestError` (an HTTP status, a one-line message, the field at
fault), made from our own exceptions once (`RequestError.of`); each API writes it in its own shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic_core import ErrorDetails

from ..base.errors import InvalidOptionError, MlxinferError


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, a one-line message, and what kind of
    error it is; each API writes it in its own shape (`api.Api.error_body`: OpenAI's, `body`, unless
    it has its own)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.headers, self.code = param, status, kind, headers, code

    @classmethod
    def of(cls, e: MlxinferError, param: str | None = None) -> RequestError:
        """What our code refused (the client's fault: options, prompt, images, a file) as a 400
        naming the field at fault: `param`, or the option a shared rule names
        (`InvalidOptionError.option`)."""
        return cls(str(e), param or (e.option if isinstance(e, InvalidOptionError) else None))

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape: the server's own, which most clients read."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def server_error(message: str) -> RequestError:
    return RequestError(message, status=500, kind="server_error")


# Deepest nesting of a request body (a JSON Schema inside response_format included).


def dotted(loc: tuple[int | str, ...]) -> str | None:
    """A field's place in a body as a dotted path ("messages.0.content")."""
    return ".".join(map(str, loc)) or None


def refusal(errors: Sequence[ErrorDetails], unknown: str = "unknown parameter", refused: Mapping[str, str] = {},
            place: Callable[[tuple[int | str, ...]], str | None] = dotted) -> RequestError:
    """A body its pydantic model refused, as one line naming the first field at fault (`place`
    writes where) and counting the other problems, in the API's own words: `unknown` for a field it
    does not define, and for a top-level field it knows and cannot honour, its sentence in `refused`.
    Every API refuses through this, so each supplies only its words."""
    first, count = errors[0], len(errors)
    where = place(first["loc"])
    more = f" (and {count - 1} more problems)" if count > 1 else ""
    if first["type"] in ("extra_forbidden", "none_required") and len(first["loc"]) == 1 \
            and first["loc"][0] in refused:
        name = str(first["loc"][0])
        return RequestError(f"{refused[name]}; remove it from the request", name)
    if first["type"] == "extra_forbidden":
        return RequestError(f"{unknown} '{where}'{more}; remove it from the request", where)
    return RequestError(f"{where}: {first['msg']}{more}" if where else f"{first['msg']}{more}", where)
