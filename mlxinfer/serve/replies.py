"""Replies as every API writes them: JSON made and encoded off the event loop (`json_reply`),
Server-Sent Events (`sse`), a request's chunks collected or streamed once its first came
(`respond`, `respond_each`), and a client that hangs up noticed as an event (`hung_up`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.text_stream import Chunk

T = TypeVar("T")


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
                  events: Callable[[Chunk | None, AsyncIterator[Chunk]], AsyncIterator[bytes]],
                  media_type: str = "text/event-stream") -> Response:
    """A request's reply in an API's shape: `whole` of every chunk, or `events` as a stream
    (of `media_type`: Server-Sent Events unless the API streams otherwise) that begins once the
    first chunk came (so a refused request is a 4xx, not a broken stream). A client that hangs up
    before then cancels its request (499, seen by no one)."""
    return await respond_each(request, [stream], streamed, lambda chunks: whole(chunks[0]),
                              lambda firsts, streams: events(firsts[0], streams[0]), media_type)


async def respond_each(request: Request, streams: list[AsyncIterator[Chunk]], streamed: bool,
                       whole: Callable[[list[list[Chunk]]], dict[str, Any]],
                       events: Callable[[list[Chunk | None], list[AsyncIterator[Chunk]]], AsyncIterator[bytes]],
                       media_type: str = "text/event-stream") -> Response:
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
    return StreamingResponse(events(firsts, streams), media_type=media_type)


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
