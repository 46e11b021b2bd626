"""What every HTTP API of `mlxinfer serve` shares: errors in each API's own shape, strict
JSON bodies read within bounds, Server-Sent Events, and noticing a client that left.

Each API module (`openai`, `responses`, `anthropic`, `embeddings`, ...) is a thin
translation from its wire shapes to the typed `Request` and back; this module is what
they have in common, so none of them reaches into another.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..base.errors import InvalidOptionError, MlxinferError
from ..engine.options import RequestOptions
from ..engine.text_stream import Chunk
from .guard import allowed_hosts
from ..text.images import downloads, has_images

BODY_SECONDS = 30  # from the headers to the body's last byte
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerConfig:
    """How the server was started, as the API modules need it."""

    model_name: str
    max_tokens: int  # default for requests that give none: the model's context
    api_key: str | None = None
    cors: str | None = None
    max_body: int = 4 << 20
    hosts: frozenset[str] | None = allowed_hosts("127.0.0.1", ())  # what a request's Host may name; None: any
    responses_store: int = 256  # Responses API objects kept for retrieval and previous_response_id
    responses_store_bytes: int = 256 << 20  # ... and the bytes they may hold in all
    max_adapters: int = 8  # LoRA adapters loaded at once (POST /v1/adapters)
    web: bool = True  # the chat page at / (`serve --no-web`: none)
    attention: bool = True  # POST /v1/attention: off on a non-loopback host without an API key

    def served(self, options: RequestOptions, model: str | None) -> RequestOptions:
        """A request's `options` with this server's defaults: `max_tokens` when it gives none, and
        the LoRA adapter its `model` names as `BASE:NAME` (none for the base model; any other name
        is taken as the base, as clients send their own defaults)."""
        prefix = f"{self.model_name}:"
        adapter = model[len(prefix):] if model is not None and model.startswith(prefix) else None
        return replace(options, max_tokens=self.max_tokens if options.max_tokens is None else options.max_tokens,
                       adapter=adapter)


@dataclass(frozen=True)
class Context:
    """What each API module is given: the engine (an `EngineThread`), the model and its
    tokenizer, and the server's config."""

    engine: Any
    model: Any
    tokenizer: Any
    config: ServerConfig


async def typed_request(engine: Any, prompt: Any, options: RequestOptions) -> Any:
    """The engine's typed `Request` for `prompt`. Making one reads its images (base64, headers),
    so a prompt with images is made on a worker thread: the event loop keeps answering every
    other request. One that downloads them (`serve --allow-image-urls`, for up to
    --image-url-timeout) is made on the engine's own download threads (`EngineThread.download`),
    never on the workers that other requests' images, /tokenize and token counts run on."""
    keywords = options.keywords(engine.engine.tokenizer)
    if not has_images(prompt):
        return engine.engine.request(prompt, **keywords)
    make = functools.partial(engine.engine.request, prompt, **keywords)
    if downloads(prompt, engine.engine.image_sources):
        return await engine.download(make)
    return await asyncio.to_thread(make)


def image_part(url: str) -> dict[str, Any]:
    """An image as chat templates (and `images.take_images`) take it, whatever API sent it."""
    return {"type": "image_url", "image_url": {"url": url}}


def template_content(parts: Sequence[str | dict[str, Any]], separator: str = "") -> str | list[dict[str, Any]]:
    """A message's content as chat templates take it, from its parts in order (texts, and images
    as `image_part`s): the texts joined by `separator`; or, with an image among them, the parts
    as they came, so the template writes each image's placeholder where the image was."""
    if all(isinstance(p, str) for p in parts):
        return separator.join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


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


def model_body(raw: bytes, kind: type[M], refusal: Callable[[ValidationError], RequestError]) -> M:
    """A body as the pydantic model `kind`, or the API's `refusal` of it (a RequestError
    naming the first field at fault)."""
    try:
        return kind.model_validate(json_object(raw))
    except ValidationError as e:
        raise refusal(e) from None


# Items of a long list encoded per `json.dumps` call (`json_bytes`): a few milliseconds of work each.
JSON_PIECE = 4096


def json_bytes(data: Any) -> bytes:
    """`data` as JSON (as Starlette's JSONResponse writes it: compact, no NaN), each long list
    encoded a few thousand items at a time. Why: one `json.dumps` call holds the GIL throughout
    (a second for a million token pieces), which would stop the engine's thread; between pieces
    the GIL changes hands."""
    parts: list[str] = []
    stack: list[Any] = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, _Raw):
            parts.append(value.text)
        elif isinstance(value, dict):
            items: list[Any] = [_Raw("{")]
            for i, (key, item) in enumerate(value.items()):
                items += [_Raw(("," if i else "") + _dumps(str(key)) + ":"), item]
            stack.extend(reversed([*items, _Raw("}")]))
        elif isinstance(value, list) and len(value) > JSON_PIECE:
            pieces = [_Raw(("," if i else "[") + _dumps(value[i:i + JSON_PIECE])[1:-1])
                      for i in range(0, len(value), JSON_PIECE)]
            stack.extend(reversed([*pieces, _Raw("]")]))
        else:
            parts.append(_dumps(value))
    return "".join(parts).encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@dataclass(frozen=True)
class _Raw:
    """JSON text already written, in `json_bytes`' stack."""

    text: str


async def json_reply(make: Callable[[], Any]) -> Response:
    """The JSON response of `make()`, made and encoded on a worker thread (`json_bytes`): a reply
    of megabytes (a long text's token pieces, a scored prompt's logprobs) must not hold the event
    loop, which every other client's stream goes through. (FastAPI's own encoding of a returned
    dict walks it in Python on the event loop: 13 s for a million pieces.)"""
    return Response(await asyncio.to_thread(lambda: json_bytes(make())), media_type="application/json")


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event; `event` names it (the Responses and Messages APIs do, OpenAI's chat does not)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {body}\n\n".encode()


class ClientGone(Exception):
    """The client hung up before its answer began."""


async def hung_up(request: Request) -> None:
    """Returns when the client closes its connection. The body has been read, so the next
    message the server gives is the disconnect: an event, no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], gone: asyncio.Future) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled, which cancels the request) as
    soon as `gone` is done: preparing, queueing and prefill included."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone
        return task.result()  # a refused or failed request raises its RequestError here
    finally:
        if not task.done():
            task.cancel()


async def collect(stream: AsyncIterator[Chunk]) -> list[Chunk]:
    """Every chunk of a non-streamed request."""
    return [chunk async for chunk in stream]



async def respond(request: Request, stream: AsyncIterator[Chunk], streamed: bool,
                  whole: Callable[[list[Chunk]], dict[str, Any]],
                  events: Callable[[Chunk | None, AsyncIterator[Chunk]], AsyncIterator[bytes]]) -> Response:
    """A request's reply in an API's shape: `whole` of every chunk, or `events` as a stream
    that begins once the first chunk came (so a refused request is a 4xx, not a broken
    stream). A client that hangs up before then cancels its request (499, seen by no one)."""
    return await respond_each(request, [stream], streamed, lambda chunks: whole(chunks[0]),
                              lambda firsts, streams: events(firsts[0], streams[0]))


async def respond_each(request: Request, streams: list[AsyncIterator[Chunk]], streamed: bool,
                       whole: Callable[[list[list[Chunk]]], dict[str, Any]],
                       events: Callable[[list[Chunk | None], list[AsyncIterator[Chunk]]], AsyncIterator[bytes]]
                       ) -> Response:
    """`respond` for a request of several sequences (a choice each, as a list of prompts
    asks), run together: one refused or failed ends the others."""
    gone = asyncio.ensure_future(hung_up(request))
    try:
        if not streamed:  # the reply's object is built and written on a worker: it grows with the reply
            chunks = await unless_gone(collect_all(streams), gone)
            return await json_reply(lambda: whole(chunks))
        firsts = await unless_gone(first_chunks(streams), gone)
    except ClientGone:
        return Response(status_code=499)
    finally:
        gone.cancel()  # once streaming, the response itself notices a disconnect
    return StreamingResponse(events(firsts, streams), media_type="text/event-stream")


async def collect_all(streams: list[AsyncIterator[Chunk]]) -> list[list[Chunk]]:
    """Every chunk of each stream, the streams run together; one that fails ends the others."""
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a stream left early cancels its sequence
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_chunks(streams: list[AsyncIterator[Chunk]]) -> list[Chunk | None]:
    """The first chunk of each stream (None: it ended with none); one refused ends the others."""

    async def first(stream: AsyncIterator[Chunk]) -> Chunk | None:
        return await anext(stream, None)

    tasks = [asyncio.ensure_future(first(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise


async def merged(firsts: list[Chunk | None], streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, chunk) from every stream as each comes, after their first chunks (`first_chunks`);
    closing it closes every stream (cancelling the sequences still running)."""
    for i, chunk in enumerate(firsts):
        if chunk is not None:
            yield i, chunk
    if len(streams) == 1:  # one stream needs no relay
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def relay(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - raised where the chunks are read
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(relay(i, s)) for i, s in enumerate(streams) if firsts[i] is not None]
    try:
        for _ in tasks:
            while (item := await queue.get())[1] is not None:
                if isinstance(item[1], Exception):
                    raise item[1]
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
