"""What `mlxinfer serve` takes from the network: a local service that a web page cannot
drive and idle clients cannot starve.

Two layers, below the routes:
- `guarded_protocol`: uvicorn's HTTP/1.1 protocol with a connection cap and a header
  deadline. Every connection holds a file descriptor (macOS allows a process 256 by
  default), so hundreds of silent or slow clients would leave none for real ones: past the
  cap the longest-idle connection is closed to make room, and a connection whose request
  headers have not all arrived within `header_seconds` is closed.
- `LocalOnly`: an ASGI middleware that refuses a request whose `Host` is not one this
  server answers to (a page that rebinds its own DNS name to 127.0.0.1 still sends its own
  name), and a POST from a web page to one of its routes whose body is not `application/json`.
  A page may POST the "simple" content types (`text/plain`, a form) to any address without
  asking first, but not JSON without CORS approval; so a page's non-JSON POST is refused (415)
  and runs nothing. A page is known by its `Origin` header: the Fetch standard has a browser
  send one on every POST (cross-origin or not; "null" where it hides the origin), while
  non-browser clients send none. Those are read as JSON whatever they declare, because the
  plainest of them do not declare it: `curl -d '{...}'`, as Ollama's and OpenAI's documentation
  write their examples, sends `application/x-www-form-urlencoded`. A POST to a path with no
  route goes on, whatever its body, to be told so (404).
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

# Descriptors kept for everything but client connections (model files, pipes, the listener, logs).
RESERVED_DESCRIPTORS = 48
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")

Refusal = Callable[[int, str, str], dict[str, Any]]  # (status, message, path) -> the API's error body


def connection_cap(wanted: int) -> int:
    """`wanted`, or fewer when the process may not open that many descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft - RESERVED_DESCRIPTORS))


class _GuardedH11(H11Protocol):
    """H11Protocol with a connection cap and a deadline for each request's headers
    (uvicorn's own keep-alive timeout stops at the first byte of a request)."""

    cap: int = 128
    header_seconds: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._seen = None  # the request cycle whose headers we have already counted
        self._idle_since = self.loop.time()
        self._deadline = self.loop.call_later(self.header_seconds, self._headers_late)
        if len(self.connections) > self.cap:
            self._make_room()

    def _make_room(self) -> None:
        """Close the connection that has waited longest without a request in progress (this
        one, when every other is busy)."""
        idle = [c for c in self.connections if c is not self and getattr(c, "idle", False)]
        victim = min(idle, key=lambda c: c._idle_since) if idle else self
        victim.transport.close()

    @property
    def idle(self) -> bool:
        """No request is in progress on this connection (it waits for one, or for its headers)."""
        return self.cycle is None or self.cycle.response_complete

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._seen and not self.cycle.response_complete:
            self._seen = self.cycle  # a request's headers are in: its handler owns the time from here
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._idle_since = self.loop.time()
            self._disarm()
            self._deadline = self.loop.call_later(self.header_seconds, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.idle and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(max_connections: int, header_seconds: float) -> type[asyncio.Protocol]:
    """The HTTP protocol class for uvicorn's `http=`: at most `max_connections` (capped by the
    descriptor limit) open at once, and `header_seconds` for a request's headers to arrive."""
    return type("GuardedH11", (_GuardedH11,), {"cap": connection_cap(max_connections),
                                               "header_seconds": header_seconds})


def allowed_hosts(bound: str, extra: Iterable[str]) -> frozenset[str] | None:
    """The names a request's Host may carry: loopback names, the bound address and `extra`;
    None (any) when `extra` holds `*`. Bound to every interface, the machine's own names and
    any IP literal are allowed too (a rebinding attack needs a DNS name)."""
    names = {n.strip().lower().strip("[]") for n in extra}
    if "*" in names:
        return None
    names |= {*LOOPBACK_NAMES, bound.lower().strip("[]")}
    if bound in WILDCARD_HOSTS:
        host = socket.gethostname().lower()
        names |= {host, f"{host}.local", socket.getfqdn().lower()}
        names.add("<ip>")
    return frozenset(names - {""})


def host_name(header: str) -> str:
    """The name in a Host header, without its port ('[::1]:8080' -> '::1')."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _is_ip(name: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, name)
            return True
        except OSError:
            pass
    return False


class LocalOnly:
    """ASGI middleware: a foreign Host is a 403, a web page's POST body (one with an `Origin`) that
    is not JSON a 415 where a route (`routed`) would read it, both in the API's error shape
    (`refusal`), before any route runs."""

    def __init__(self, app: Callable[..., Awaitable[None]], hosts: frozenset[str] | None, refusal: Refusal,
                 routed: Callable[[dict[str, Any]], bool] = lambda scope: True):
        self.app, self.hosts, self.refusal, self.routed = app, hosts, refusal, routed

    def _problem(self, scope: dict[str, Any]) -> tuple[int, str] | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if self.hosts is not None and host is not None:
            name = host_name(host)
            if name not in self.hosts and not ("<ip>" in self.hosts and _is_ip(name)):
                return 403, (f"this server does not answer to the host {host[:100]!r}; it serves "
                             f"{', '.join(sorted(self.hosts - {'<ip>'}))} (start it with --allowed-host NAME to add one)")
        if scope.get("method") == "POST" and "origin" in headers and self.routed(scope):  # a web page's
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return 415, (f"the request body must be JSON sent as Content-Type: application/json, not "
                             f"{kind[:100] or 'no content type'!r}")
        return None

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        problem = self._problem(scope) if scope["type"] == "http" else None
        if problem is None:
            await self.app(scope, receive, send)
            return
        status, message = problem
        body = json.dumps(self.refusal(status, message, scope.get("path", ""))).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
