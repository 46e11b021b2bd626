"""`mlxinfer ps`: which models a running server holds, the memory each takes, and when each
unloads, read from the server's `GET /api/ps` in Ollama's documented shape (`models: [{name,
model, size, digest, details, expires_at, size_vram}]`), so it reads an Ollama server too."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..base.errors import MlxinferError

FOREVER_YEAR = 2200  # Ollama writes "never unloads" as an expiry centuries away
TIMEOUT_SECONDS = 10
RFC3339 = re.compile(r"(\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d)(?:\.(\d+))?([Zz]|[+-]\d\d:\d\d)")


class ServerUnreachableError(MlxinferError):
    """No server answered where `ps` asked, or it answered something else than /api/ps."""


@dataclass(frozen=True)
class Running:
    """One loaded model as /api/ps describes it."""

    name: str
    size: int  # bytes it takes in memory
    family: str
    parameters: str
    quantization: str
    expires_at: datetime | None  # None: never

    @classmethod
    def of(cls, item: dict[str, Any]) -> Running:
        details = item.get("details") or {}
        return cls(item.get("name") or item.get("model") or "?", int(item.get("size") or 0),
                   details.get("family") or "?", details.get("parameter_size") or "?",
                   details.get("quantization_level") or "?", expiry(item.get("expires_at")))


def expiry(text: str | None) -> datetime | None:
    """An RFC 3339 time (Go writes nanoseconds and "Z"), None when absent or centuries away."""
    if not text:
        return None
    found = RFC3339.fullmatch(text.strip())
    if found is None:
        raise ServerUnreachableError(f"/api/ps gave an expiry that is not an RFC 3339 time: {text[:100]!r}")
    seconds, fraction, zone = found.groups()
    zone = "+00:00" if zone in ("Z", "z") else zone
    moment = datetime.fromisoformat(f"{seconds}.{(fraction or '').ljust(6, '0')[:6]}{zone}")
    return None if moment.year >= FOREVER_YEAR else moment


def running(host: str, port: int) -> list[Running]:
    """The models the server at host:port has loaded."""
    url = f"http://{host}:{port}/api/ps"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        raise ServerUnreachableError(f"the server at {host}:{port} answered GET /api/ps with {e.code}; is it an "
                                     "mlxinfer (or Ollama) server?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnreachableError(f"no server answers at {host}:{port} ({reason}); start one with `mlxinfer "
                                     "serve`, or pass its --host and --port") from None
    except ValueError:
        raise ServerUnreachableError(f"the server at {host}:{port} answered GET /api/ps with something other "
                                     "than JSON; is it an mlxinfer (or Ollama) server?") from None
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, list):
        raise ServerUnreachableError(f"the server at {host}:{port} answered GET /api/ps without a models list")
    return [Running.of(m) for m in models if isinstance(m, dict)]


def until(moment: datetime | None, now: datetime | None = None) -> str:
    """When a model unloads, as a person reads it ("4 minutes from now", "forever")."""
    if moment is None:
        return "forever"
    seconds = (moment - (now or datetime.now(timezone.utc))).total_seconds()
    if seconds <= 1:
        return "now"
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= length:
            n = int(seconds // length)
            return f"{n} {unit}{'s' if n > 1 else ''} from now"
    return "now"
