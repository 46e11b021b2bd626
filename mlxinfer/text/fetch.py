"""Fetching an http(s) URL for someone else: what a server does for an image URL in a request.

A client that names a URL makes the server connect where the client cannot, so three things
hold for every fetch:
- The address rule: a host's name is resolved once, every address it resolves to must be on
  the public internet (`public_address`), and the connection goes to an address so checked
  (a name that resolves again to somewhere else cannot swap it: DNS rebinding). Loopback,
  private, link-local (cloud metadata: 169.254.169.254), shared, multicast and reserved
  addresses are refused, unless the user allowed the host by its name (`allowed`). Each
  redirect (at most MAX_REDIRECTS) is a new fetch under the same rule.
- One deadline for all of it: resolving, connecting, the TLS handshake, sending, the headers
  and every read of the body end by `deadline`, so a sender that drips a byte at a time is cut
  off there, not after some large read fills.
- At most `max_bytes` of body, refused as soon as Content-Length or the bytes read pass it.
Why a fetch failed (`NotFetched`) is for the server's log; a client is told only that it was
not fetched, so the errors cannot map the server's network (an open port from a closed one).

HTTP/1.1 is spoken by h11 (uvicorn's own parser) over a socket this module connects; proxies
from the environment are not used (they would connect on the client's behalf, past the rule).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterable

import h11

MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
READ = 65536
# Not public, though Python's `is_global` tables (3.10-3.12) do not say so: IANA's protocol
# assignments (Oracle Cloud's metadata service is 192.0.0.192) and local-use NAT64.
NOT_PUBLIC = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("64:ff9b:1::/48"))
# RFC 3986's reserved and unreserved characters, and '%' (escapes already made): kept in a request target
TARGET_SAFE = "/?#[]@!$&'()*+,;=-._~:%"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class NotFetched(Exception):
    """Why a URL was not fetched, in words for the server's log (never for the client)."""


def public_address(address: Address) -> bool:
    """Whether `address` is on the public internet: `ipaddress`'s is_global (not private,
    loopback, link-local, shared, unspecified...), not multicast or reserved, and for an IPv6
    address that carries an IPv4 one (6to4, Teredo), that one public too."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.sixtofour or (address.teredo[1] if address.teredo else None)
        if inner is not None and not public_address(inner):
            return False
    return (address.is_global and not address.is_multicast and not address.is_reserved
            and not any(address in n for n in NOT_PUBLIC))


def host_key(name: str) -> str:
    """A host as `allowed` compares it: an IP address in its one written form, a name in lower
    case without a trailing dot (URLs and flags may spell either differently)."""
    name = name.strip().strip("[]")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.lower().rstrip(".")


def host_keys(names: Iterable[str]) -> frozenset[str]:
    return frozenset(host_key(n) for n in names if n.strip())


def fetch(url: str, max_bytes: int, deadline: float, allowed: frozenset[str] = frozenset()) -> bytes:
    """The body of an http(s) URL, following redirects, by `deadline` (a `time.monotonic()`)
    and within `max_bytes`; hosts in `allowed` (`host_keys`) may be at any address. Raises
    NotFetched, saying why."""
    try:
        for _ in range(MAX_REDIRECTS + 1):
            location, body = _get(url, max_bytes, deadline, allowed)
            if location is None:
                return body
            url = urllib.parse.urljoin(url, location)
        raise NotFetched(f"more than {MAX_REDIRECTS} redirects")
    except (OSError, h11.ProtocolError, ValueError, UnicodeError) as e:  # timeouts, refusals, TLS, bad replies
        raise NotFetched(f"{type(e).__name__}: {e}") from None


def _get(url: str, max_bytes: int, deadline: float, allowed: frozenset[str]) -> tuple[str | None, bytes]:
    """One GET: (the redirect's Location, b"") or (None, the body)."""
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in ("http", "https") or not host:
        raise NotFetched(f"{url[:100]!r} is not an http(s) URL with a host")
    port = parts.port or (443 if scheme == "https" else 80)
    sock = _connect(_addresses(host, port, allowed, deadline), deadline)
    try:
        if scheme == "https":
            sock.settimeout(_left(deadline))  # the handshake as a whole is bounded by it
            sock = _tls().wrap_socket(sock, server_hostname=host)
        return _exchange(sock, parts, max_bytes, deadline)
    finally:
        sock.close()


def _addresses(host: str, port: int, allowed: frozenset[str], deadline: float) -> list[tuple]:
    """(family, sockaddr) for each address `host` resolves to, all of them checked."""
    infos = _resolve(host, port, deadline)
    named = host_key(host) in allowed
    for info in infos:
        address = ipaddress.ip_address(info[4][0].partition("%")[0])  # an IPv6 scope is not part of it
        if not named and not public_address(address):
            raise NotFetched(f"{host} is at {address}, not a public address (the host is not allowed by name)")
    if not infos:
        raise NotFetched(f"{host} resolves to no address")
    return [(info[0], info[4]) for info in infos]


def _resolve(host: str, port: int, deadline: float) -> list[tuple]:
    """getaddrinfo within the deadline: it cannot be interrupted, so it runs on a thread of its
    own that is left to finish alone when the deadline passes first."""
    found: list = []

    def run() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as e:
            found.append(e)

    resolver = threading.Thread(target=run, name="mlxinfer-resolve", daemon=True)
    resolver.start()
    resolver.join(_left(deadline))
    if not found:
        raise TimeoutError("name resolution ran past the deadline")
    if isinstance(found[0], Exception):
        raise found[0]
    return found[0]


def _connect(addresses: list[tuple], deadline: float) -> socket.socket:
    """A socket connected to the first of `addresses` that answers (each already checked)."""
    error: OSError | None = None
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_left(deadline))
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error or NotFetched("no address to connect to")


def _exchange(sock: socket.socket, parts: urllib.parse.SplitResult, max_bytes: int,
              deadline: float) -> tuple[str | None, bytes]:
    """Send the GET and read the reply with h11, every socket operation within the deadline."""
    conn = h11.Connection(h11.CLIENT)
    target = urllib.parse.quote(parts.path or "/", safe=TARGET_SAFE)
    if parts.query:
        target += "?" + urllib.parse.quote(parts.query, safe=TARGET_SAFE)
    request = h11.Request(method="GET", target=target, headers=[
        ("Host", _host_header(parts)), ("User-Agent", "mlxinfer"), ("Accept", "image/*"), ("Connection", "close")])
    sock.settimeout(_left(deadline))
    sock.sendall(conn.send(request) + conn.send(h11.EndOfMessage()))  # sendall's timeout bounds it whole
    body: list[bytes] = []
    got = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            sock.settimeout(_left(deadline))
            conn.receive_data(sock.recv(READ))
        elif isinstance(event, h11.Response):
            headers = dict(event.headers)
            if event.status_code in REDIRECTS and b"location" in headers:
                return headers[b"location"].decode("ascii"), b""
            if event.status_code != 200:
                raise NotFetched(f"HTTP {event.status_code}")
            if int(headers.get(b"content-length", 0)) > max_bytes:
                raise NotFetched(f"Content-Length {int(headers[b'content-length']):,} is over {max_bytes:,} bytes")
        elif isinstance(event, h11.Data):
            got += len(event.data)
            if got > max_bytes:
                raise NotFetched(f"the body is over {max_bytes:,} bytes")
            body.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return None, b"".join(body)


def _host_header(parts: urllib.parse.SplitResult) -> str:
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host.encode("idna").decode("ascii")
    return host if parts.port is None else f"{host}:{parts.port}"


def _left(deadline: float) -> float:
    """Seconds to the deadline; past it, a TimeoutError (never a zero timeout, which means no wait at all)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("past the deadline")
    return left


@functools.cache
def _tls() -> ssl.SSLContext:
    """Certificates checked against the system's authorities, and the host name against them
    (one context for every fetch: loading the authorities is slow)."""
    return ssl.create_default_context()
