"""The server's refusals: `RequestError` (an HTTP status, a one-line message, the field at
fault), made from our own exceptions once (`RequestError.of`); each API writes it in its own shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic_core import ErrorDetails

from ..base.errors import InvalidOptionError, MlxinferError


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, a one-line message, and what kind of
    error it is; each API writes it in its own shape (`body`, `anthropic_body`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
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
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error shape; its error type follows the status, as Anthropic's does."""
        kind = ANTHROPIC_KINDS.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": str(self)}}


# Anthropic's error type for each HTTP status it documents (other 4xx: invalid_request_error).
ANTHROPIC_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   529: "overloaded_error"}


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
