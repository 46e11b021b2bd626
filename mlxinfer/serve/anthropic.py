"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), translated to
the typed `Request` and back; the request bodies live in `anthropic_schema`.

One `Reply` turns a request's chunks into Anthropic's content blocks (thinking, text,
tool_use) and their stream events; the whole message is what the stream builds, so a
client's accumulated stream and the non-streamed message cannot differ.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..decode.sources import Stats
from ..engine.text_stream import Chunk
from ..text.tools import ToolCall, call_opener, may_open_call
from .anthropic_schema import CountTokens, CreateMessage, parse
from .api import Api, Route
from .bodies import parsed
from .errors import RequestError
from .models import Served
from .replies import respond, sse

Event = tuple[str, dict[str, Any]]  # (event name, data)


class MessagesApi(Api):
    """Anthropic's Messages API, under /v1, its errors in Anthropic's shape."""

    def routes(self) -> tuple[Route, ...]:
        return Route("/messages", self.create), Route("/messages/count_tokens", self.count_tokens)

    @staticmethod
    def error_body(e: RequestError) -> dict[str, Any]:
        return error_body(e)

    @staticmethod
    def claims(headers: Mapping[str, str]) -> bool:
        return asks_anthropic(headers)

    async def create(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, CreateMessage)
        return await self.ctx.models.held_for(body.model, lambda served: self.answer(request, body, served))

    async def answer(self, request: Request, body: CreateMessage, served: Served) -> Response:
        engine = served.engine
        typed = await engine.request(body.chat(), served.options(body.request_options(), body.model))
        o = typed.options
        reply = Reply(rid=f"msg_{uuid.uuid4().hex}", model=served.name, max_tokens=o.max_tokens,
                      opener=call_opener(served.tokenizer) if o.tools and o.tool_choice != "none" else None)
        return await respond(request, engine.chunks(typed), bool(body.stream), reply.whole, reply.events)

    async def count_tokens(self, request: Request) -> dict[str, int]:
        body = await parsed(request, self.ctx.config.max_body, parse, CountTokens)
        async with self.ctx.models.use(body.model) as served:
            typed = await served.engine.request(body.chat(), served.options(body.request_options(), body.model))
            return {"input_tokens": await served.engine.count(typed)}


def models_page(models: list[tuple[str, float, bool]], query: Mapping[str, str]) -> dict[str, Any]:
    """A page of `GET /v1/models` in Anthropic's shape, of `models` ((id, created epoch seconds,
    loaded), in the order served), as its `limit` (1 to 1000, default 20), `after_id` and
    `before_id` ask."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise RequestError("limit must be an integer from 1 to 1000", "limit")
    ids = [m for m, _, _ in models]
    for cursor in ("after_id", "before_id"):
        if cursor in query and query[cursor] not in ids:
            raise RequestError(f"{cursor} '{query[cursor][:200]}' is not a model of this server", cursor)
    if "before_id" in query:
        end = ids.index(query["before_id"])
        page = models[max(end - limit, 0):end]
        more = end - limit > 0
    else:
        start = ids.index(query["after_id"]) + 1 if "after_id" in query else 0
        page = models[start:start + limit]
        more = start + limit < len(models)
    data = [model_info(m, created, loaded) for m, created, loaded in page]
    return {"data": data, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
            "has_more": more}


def model_info(name: str, created: float, loaded: bool) -> dict[str, Any]:
    """Anthropic's model object (`created_at` in RFC 3339: the model's files' time), and whether
    it is loaded now (`loaded`, ours, as in the OpenAI-shaped list)."""
    stamp = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp, "loaded": loaded}


def asks_anthropic(headers: Mapping[str, str]) -> bool:
    """Whether a request comes from an Anthropic client: every one sends `anthropic-version`."""
    return "anthropic-version" in headers


# Anthropic's error type for each HTTP status it documents (other 4xx: invalid_request_error).
KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(e: RequestError) -> dict[str, Any]:
    """Anthropic's error shape; its error type follows the status, as Anthropic's does."""
    kind = KINDS.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


def stop_reason(last: Chunk, max_tokens: int) -> str:
    """Anthropic's name for why a reply ended (calls before a stop string that cut them short)."""
    if last.finish_reason == "tool_calls":
        return "tool_use"
    if last.stop_sequence is not None:
        return "stop_sequence"
    if last.finish_reason == "length":
        return "max_tokens" if last.stats.generated_tokens >= max_tokens else "model_context_window_exceeded"
    return "end_turn"  # the end of the turn, or a reply cut short by the server stopping


def usage(stats: Stats) -> dict[str, Any]:
    """Tokens as Anthropic counts them: `input_tokens` are those not read from the prompt cache."""
    cached = max(stats.prompt_tokens - stats.prefill_tokens, 0)
    return {"input_tokens": stats.prompt_tokens - cached, "output_tokens": stats.generated_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


@dataclass(kw_only=True)
class Reply:
    """One request's message: its content blocks as they grow, and the events that grow them.

    With tools, answer text that may be the start of a call is held back until it is known:
    a call goes out as a tool_use block, anything else as text. Thinking is never held."""

    rid: str
    model: str
    max_tokens: int
    opener: str | None = None  # with tools: the text a call starts with
    content: list[dict[str, Any]] = field(default_factory=list, init=False)
    held: str = field(default="", init=False)  # answer text held back while it may be the start of a call
    free: bool = field(default=False, init=False)  # the text is known not to be a call: it streams as it comes
    open: bool = field(default=False, init=False)  # whether the last block of `content` is still open

    def message(self, stats: Stats, last: Chunk | None = None) -> dict[str, Any]:
        """The message, whole once `last` (the last chunk) came; before, as message_start has
        it: no content and no output yet."""
        done = last is not None
        reason = stop_reason(last, self.max_tokens) if done else None
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content if done else [], "stop_reason": reason,
                "stop_sequence": last.stop_sequence if reason == "stop_sequence" else None,
                "usage": usage(stats) if done else {**usage(stats), "output_tokens": 0}}

    def whole(self, chunks: list[Chunk]) -> dict[str, Any]:
        for chunk in chunks:
            self.take(chunk)
        self.end()
        return self.message(chunks[-1].stats, chunks[-1])

    def take(self, chunk: Chunk) -> list[Event]:
        """The events one chunk adds (none while its text is held back)."""
        events = self._add("thinking", chunk.reasoning)
        self.held += chunk.text
        self.free = self.free or not may_open_call(self.held, self.opener)
        if chunk.tool_calls and not self.free:  # what was held back were the calls
            self.held = chunk.content or ""
        if self.free or chunk.finish_reason:
            events += self._add("text", self.held)
            self.held = ""
        for call in chunk.tool_calls or []:
            events += self._tool_use(call)
        return events

    def end(self) -> list[Event]:
        """The events that end the content: text still held back, and the open block's stop."""
        events = self._add("text", self.held)
        self.held = ""
        return [*events, *self._close()]

    def _add(self, kind: str, text: str) -> list[Event]:
        """`text` appended to the open block of `kind` ("text" or "thinking"), opened if need be."""
        if not text:
            return []
        events = []
        if not (self.open and self.content[-1]["type"] == kind):
            events += self._close()
            events.append(self._start({"type": "text", "text": ""} if kind == "text" else
                                      {"type": "thinking", "thinking": "", "signature": ""}))
        self.content[-1][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return [*events, self._delta(delta)]

    def _tool_use(self, call: ToolCall) -> list[Event]:
        """A call as one block: opened with an empty input, which one JSON delta fills."""
        events = [*self._close(), self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})]
        self.content[-1]["input"] = call.arguments
        events.append(self._delta({"type": "input_json_delta",
                                   "partial_json": json.dumps(call.arguments, ensure_ascii=False)}))
        return [*events, *self._close()]

    def _start(self, block: dict[str, Any]) -> Event:
        self.content.append(dict(block))
        self.open = True
        return "content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                       "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    async def events(self, first: Chunk | None, stream: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        """The stream: message_start, ping, each block's start, deltas and stop, then
        message_delta (why it stopped, the usage) and message_stop; a failure mid-way is
        an `error` event, as Anthropic sends one."""
        try:
            if first is None:  # ended before its first token: the server is stopping
                raise RequestError("the server stopped before the reply began; retry", status=503, kind="server_busy")
            yield sse({"type": "message_start", "message": self.message(first.stats)}, "message_start")
            yield sse({"type": "ping"}, "ping")
            last = first
            for name, data in self.take(first):
                yield sse(data, name)
            async for last in stream:
                for name, data in self.take(last):
                    yield sse(data, name)
            for name, data in self.end():
                yield sse(data, name)
            whole = self.message(last.stats, last)
            yield sse({"type": "message_delta", "usage": whole["usage"],
                       "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
        except RequestError as e:
            yield sse(error_body(e), "error")
        finally:
            await stream.aclose()
