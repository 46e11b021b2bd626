"""OpenAI's Responses API (`/v1/responses`), translated to the typed `Request` and back.

A request's items (after those of the response it continues, `previous_response_id`)
become chat messages and its fields engine options (`responses_schema`); the engine's
chunks become a Response object, or its stream of named events in OpenAI's order:
`response.created`, `response.in_progress`, then per output item `output_item.added`,
its content (`content_part.added`, text deltas, `..._text.done`, `content_part.done`,
or a function call's arguments), `output_item.done`, and `response.completed` (or
`response.incomplete` when max_output_tokens cut it). Responses are kept in memory, as JSON,
in a store bounded in count and in bytes (least recently used first out) to be retrieved,
deleted, continued or have their items referenced.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, NamedTuple

from fastapi import Request
from fastapi.responses import Response

from ..engine.text_stream import Chunk
from ..engine.request import Request as TypedRequest
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolCall, call_opener, may_open_call
from .api import Api, Context, Route
from .bodies import parsed
from .errors import RequestError
from .models import Served
from .replies import respond, sse
from .openai_schema import parse
from .responses_schema import ITEM, UNRENDERED, CountInputTokens, CreateResponse, ItemReference, listed, messages


# What the store spends on one item beside its JSON (its bytes object, its record, its places in its
# entry and in the index of item ids), and on one entry beside its items (measured with tracemalloc:
# about 400 and 1,000 bytes).
ITEM_OVERHEAD = 512
ENTRY_OVERHEAD = 2048


def _json(value: Any) -> bytes:
    """`value` as compact JSON, as the server writes its replies."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class Kept(NamedTuple):
    """One item as the store keeps it: its JSON, immutable, so entries share it safely, and
    its type, so an item the prompt leaves out (`UNRENDERED`) is never parsed again."""

    id: str
    kind: str
    json: bytes


def kept(item: Any) -> Kept:
    """An item of a request's input as the store keeps it."""
    return Kept(item.id, item.type, item.model_dump_json(by_alias=True, exclude_none=True).encode())


@dataclass(frozen=True)
class Turn:
    """The items one request answers, in order: the response it continues (its items, then its
    output), then its own input with each item_reference resolved. `kept` holds them all as
    the store keeps them (those taken from the store shared, not copied); `items`, parsed, those
    the prompt renders."""

    items: list
    kept: tuple[Kept, ...]


@dataclass(frozen=True)
class Stored:
    """A finished response, kept as JSON only (the parsed objects of a hostile body take 20 times
    its size): the Response object, what GET answers; the items it answered (those of the
    responses it continues included) and its output items, each alone so that a later request
    takes one without parsing the rest. `nbytes` is all it holds, counted against the store's bound."""

    response: bytes
    context: tuple[Kept, ...]
    output: tuple[Kept, ...]
    nbytes: int

    @classmethod
    def of(cls, response: dict[str, Any], turn: Turn) -> Stored:
        output = tuple(Kept(o["id"], o["type"], _json(o)) for o in response["output"])
        whole = _json(response)
        held = (*turn.kept, *output)
        return cls(whole, turn.kept, output,
                   ENTRY_OVERHEAD + len(whole) + sum(len(k.json) + ITEM_OVERHEAD for k in held))


class Store:
    """Responses kept for `GET`, `DELETE`, `previous_response_id` and `item_reference`: at most
    `size` of them and `max_bytes` in all (`Stored.nbytes`), the least recently used dropped
    first (size 0: none kept; a response over `max_bytes` alone is not kept). An entry shares
    only immutable JSON with the entries it continues, and counts all it refers to, so a dropped
    entry is freed and the count bounds what the store holds. Items are indexed by id.
    Thread-safe: the routes call it from worker threads, as its work grows with the entries."""

    def __init__(self, size: int, max_bytes: int):
        self.size, self.max_bytes, self.nbytes = size, max_bytes, 0
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._index: dict[str, dict[str, Kept]] = {}  # item id -> {id of a response holding it: the item}, latest last
        self._lock = threading.Lock()

    def put(self, rid: str, entry: Stored) -> None:
        if self.size <= 0 or entry.nbytes > self.max_bytes:
            return
        with self._lock:
            if rid in self._kept:
                self._drop(rid)
            self._kept[rid] = entry
            self.nbytes += entry.nbytes
            for item in (*entry.context, *entry.output):
                self._index.setdefault(item.id, {})[rid] = item
            while len(self._kept) > self.size or self.nbytes > self.max_bytes:
                self._drop(next(iter(self._kept)))

    def _drop(self, rid: str) -> None:
        entry = self._kept.pop(rid)
        self.nbytes -= entry.nbytes
        for item in (*entry.context, *entry.output):
            holders = self._index.get(item.id, {})
            holders.pop(rid, None)  # an id twice in one entry went the first time
            if not holders:
                self._index.pop(item.id, None)

    def get(self, rid: str) -> Stored:
        with self._lock:
            if rid not in self._kept:
                raise RequestError(f"Response with id '{rid[:100]}' not found.", status=404)
            self._kept.move_to_end(rid)
            return self._kept[rid]

    def delete(self, rid: str) -> None:
        with self._lock:
            if rid not in self._kept:
                raise RequestError(f"Response with id '{rid[:100]}' not found.", status=404)
            self._drop(rid)

    def item(self, iid: str) -> Kept:
        """The item with id `iid` among the stored responses' inputs and outputs (the latest stored)."""
        with self._lock:
            holders = self._index.get(iid)
            if holders:
                return next(reversed(holders.values()))
        raise RequestError(f"no stored response holds the item '{iid[:100]}' (item_reference); send the item "
                           "itself", "input")


def turn_of(store: Store, body: CreateResponse, max_body: int) -> Turn:
    """The items `body` answers (`Turn`). The items its references name, each counted every
    time it is named, are bounded by `max_body` as the body itself is: a reference stands for an
    item the client could have sent, never for more."""
    if not body.input:
        raise RequestError("input is empty: give a string or a list of items", "input")
    earlier: tuple[Kept, ...] = ()
    if body.previous_response_id is not None:
        try:
            prev = store.get(body.previous_response_id)
        except RequestError:
            raise RequestError(f"Previous response with id '{body.previous_response_id[:100]}' not found.",
                               "previous_response_id", code="previous_response_not_found") from None
        earlier = (*prev.context, *prev.output)
    items = [ITEM.validate_json(k.json) for k in earlier if k.kind not in UNRENDERED]
    held, referenced = list(earlier), 0
    named: dict[str, Any] = {}  # each referenced item parsed once, however often it is named
    for item in body.input:
        if isinstance(item, ItemReference):
            one = store.item(item.id)
            referenced += len(one.json)
            if referenced > max_body:
                raise RequestError(f"the items this request's item_references name come to over {max_body} bytes "
                                   "(each counted every time it is named), more than a request may send; name "
                                   "fewer", "input")
            if one.kind not in UNRENDERED:
                if one.id not in named:
                    named[one.id] = ITEM.validate_json(one.json)
                items.append(named[one.id])
        else:
            item = item if item.id is not None else item.model_copy(update={"id": _id("msg")})
            one = kept(item)
            items.append(item)
        held.append(one)
    return Turn(items, tuple(held))


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesApi(Api):
    """OpenAI's Responses API, under /v1, with its store of responses."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.store = Store(ctx.config.responses_store, ctx.config.responses_store_bytes)

    def routes(self) -> tuple[Route, ...]:
        return (Route("/responses", self.create), Route("/responses/input_tokens", self.input_tokens),
                Route("/responses/{rid}", self.retrieve, ("GET",)), Route("/responses/{rid}", self.delete, ("DELETE",)),
                Route("/responses/{rid}/input_items", self.input_items, ("GET",)))

    async def typed(self, body: CreateResponse, served: Served) -> tuple[TypedRequest, Turn]:
        """The one typed request `body` makes, and the items it answers. Resolving them and
        writing them as messages grow with the body and the store: a worker thread does both."""
        config = self.ctx.config

        def answered() -> tuple[Turn, list[dict[str, Any]]]:
            turn = turn_of(self.store, body, config.max_body)
            return turn, messages(turn.items, body.instructions)

        turn, chat = await asyncio.to_thread(answered)
        return await served.engine.request(chat, served.options(body.request_options(), body.model)), turn

    async def create(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, CreateResponse)
        return await self.ctx.models.held_for(body.model, lambda served: self.answer(request, body, served))

    async def answer(self, request: Request, body: CreateResponse, served: Served) -> Response:
        tokenizer = served.tokenizer
        typed_request, turn = await self.typed(body, served)
        o = typed_request.options
        reply = Reply(body=body, model=served.name, tokenizer=tokenizer,
                      opener=call_opener(tokenizer) if o.tools and o.tool_choice != "none" else None)

        def keep(response: dict[str, Any]) -> dict[str, Any]:
            """Stores the response (on a worker thread: `respond` builds a whole reply there, and a
            streamed one calls this through `asyncio.to_thread`)."""
            if body.store is not False:
                self.store.put(response["id"], Stored.of(response, turn))
            return response

        def whole(chunks: list[Chunk]) -> dict[str, Any]:
            if not chunks:  # the server stopped before the first token
                raise RequestError("the server is shutting down", status=503, kind="server_busy")
            return keep(reply.whole(chunks))

        return await respond(request, served.engine.chunks(typed_request), bool(body.stream), whole,
                             lambda first, rest: reply.events(first, rest, keep))

    async def input_tokens(self, request: Request) -> dict[str, Any]:
        """How many tokens the input is as `create` would render it (tools included)."""
        body = await parsed(request, self.ctx.config.max_body, parse, CountInputTokens)
        async with self.ctx.models.use(body.model) as served:
            count = await served.engine.count((await self.typed(body, served))[0])
        return {"object": "response.input_tokens", "input_tokens": count}

    async def retrieve(self, rid: str, request: Request) -> Response:
        if request.query_params.get("stream", "false") != "false":
            raise RequestError("a stored response cannot be streamed again (background responses are not supported)",
                               "stream")
        return Response((await asyncio.to_thread(self.store.get, rid)).response, media_type="application/json")

    async def delete(self, rid: str) -> dict[str, Any]:
        await asyncio.to_thread(self.store.delete, rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def input_items(self, rid: str, request: Request) -> dict[str, Any]:
        """A page of the items a stored response answered (`limit`, `order`, `after`, as OpenAI's)."""
        page = Page.of(request.query_params)
        return await asyncio.to_thread(lambda: page.listing(self.store.get(rid)))


@dataclass(frozen=True)
class Page:
    """A page of `GET /v1/responses/{id}/input_items`: OpenAI's query parameters, checked."""

    limit: int
    order: str
    after: str | None

    @classmethod
    def of(cls, query: Mapping[str, str]) -> Page:
        limit, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
        if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
            raise RequestError(f"limit must be an integer from 1 to 100, got {limit[:20]!r}", "limit")
        if order not in ("asc", "desc"):
            raise RequestError(f"order must be 'asc' or 'desc', got {order[:20]!r}", "order")
        return cls(int(limit), order, after)

    def listing(self, entry: Stored) -> dict[str, Any]:
        """The page of `entry`'s input items; only the items on it are parsed."""
        items = entry.context if self.order == "asc" else entry.context[::-1]
        if self.after is not None:
            start = next((k for k, item in enumerate(items) if item.id == self.after), None)
            if start is None:
                raise RequestError(f"after names no input item of this response ('{self.after[:100]}')", "after")
            items = items[start + 1:]
        page = [listed(ITEM.validate_json(item.json)) for item in items[:self.limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def usage(chunks: list[Chunk]) -> dict[str, Any]:
    s = chunks[-1].stats
    thinking = sum(1 for c in chunks if c.reasoning and c.token is not None)
    return {"input_tokens": s.prompt_tokens,
            "input_tokens_details": {"cached_tokens": max(s.prompt_tokens - s.prefill_tokens, 0)},
            "output_tokens": s.generated_tokens, "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": s.prompt_tokens + s.generated_tokens}


def call_item(call: ToolCall) -> dict[str, Any]:
    return {"id": f"fc_{call.id}", "type": "function_call", "status": "completed", "call_id": call.id,
            "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}


@dataclass(kw_only=True)
class Reply:
    """One request's Response object, whole or as its stream of events. Its items' ids are
    fixed up front, so the streamed items and the final object name the same ones."""

    body: CreateResponse
    model: str
    tokenizer: Tokenizer
    opener: str | None  # with tools: the text a call starts with
    rid: str = field(default_factory=lambda: _id("resp"), init=False)
    message_id: str = field(default_factory=lambda: _id("msg"), init=False)
    reasoning_id: str = field(default_factory=lambda: _id("rs"), init=False)
    created: int = field(default_factory=lambda: int(time.time()), init=False)

    def object(self, status: str, output: list[dict[str, Any]], chunks: list[Chunk] | None = None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object: this request's settings echoed, with `output` and its state."""
        b = self.body
        choice = b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None \
            else b.tool_choice.model_dump()
        text = b.text.model_dump(by_alias=True, exclude_none=True) if b.text is not None else {}
        reasoning = b.reasoning.model_dump(include={"effort", "summary"}) if b.reasoning is not None else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls, "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": b.previous_response_id,
            "reasoning": reasoning or {"effort": None, "summary": None}, "store": b.store is not False,
            "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": b.truncation or "disabled", "usage": usage(chunks) if chunks else None,
            "user": b.user, "metadata": b.metadata or {}, "service_tier": b.service_tier or "default",
            "background": False, "prompt_cache_key": b.prompt_cache_key, "safety_identifier": b.safety_identifier,
        }

    def logprobs(self, chunks: list[Chunk]) -> list[dict[str, Any]]:
        """The tokens' logprobs, when `include` asks for them."""
        if not self.body.logprob_rows():
            return []
        text, top = self.tokenizer.decode, self.body.top_logprobs or 0
        return [{"token": text([c.token]), "bytes": list(text([c.token]).encode()), "logprob": c.logprob,
                 "top_logprobs": [{"token": text([t]), "bytes": list(text([t]).encode()), "logprob": lp}
                                  for t, lp in c.top_logprobs[:top]]}
                for c in chunks if c.token is not None and c.top_logprobs is not None]

    def reasoning_item(self, text: str | None) -> dict[str, Any]:
        """The thinking item (`text` None: just opened)."""
        return {"id": self.reasoning_id, "type": "reasoning", "status": "in_progress" if text is None else "completed",
                "summary": [], "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}

    def message_item(self, part: dict[str, Any] | None, status: str) -> dict[str, Any]:
        """The message item (`part` None: just opened)."""
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [part] if part else []}

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def finished(self, chunks: list[Chunk], thought: str, text: str) -> dict[str, Any]:
        """The final Response object: the thinking, the message (unless the reply is calls
        only), the calls."""
        last = chunks[-1]
        status = "incomplete" if last.finish_reason == "length" else "completed"
        items = [self.reasoning_item(thought)] if thought else []
        calls = last.tool_calls or []
        if text or not calls:
            items.append(self.message_item(self.part(text, self.logprobs(chunks)), status))
        return self.object(status, [*items, *(call_item(c) for c in calls)], chunks)

    def whole(self, chunks: list[Chunk]) -> dict[str, Any]:
        last = chunks[-1]
        text = (last.content or "") if last.tool_calls else "".join(c.text for c in chunks)
        return self.finished(chunks, "".join(c.reasoning for c in chunks), text)

    async def events(self, first: Chunk | None, stream: AsyncIterator[Chunk],
                     keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
        """The stream of events; with tools, text that may be the start of a call is held
        back until it is known: a call goes out as a function_call item, anything else as text."""
        out = _Events(self)
        try:
            yield out("response.created", response=self.object("in_progress", []))
            yield out("response.in_progress", response=self.object("in_progress", []))
            chunks: list[Chunk] = []
            held: list[Chunk] = []
            if first is not None:
                async for chunk in _chain(first, stream):
                    chunks.append(chunk)
                    for event in out.think(chunk.reasoning):
                        yield event
                    held.append(chunk)
                    text = "".join(c.text for c in held)
                    if chunk.tool_calls or (out.said is None and not chunk.finish_reason
                                            and (not text or may_open_call(text, self.opener))):
                        continue
                    for event in out.say(text, held):
                        yield event
                    held = []
            if not chunks:  # the server stopped before the first token
                raise RequestError("the server is shutting down", status=503, kind="server_busy")
            events, response = out.finish(chunks)
            for event in events:
                yield event
            await asyncio.to_thread(keep, response)  # stored before the client hears it is done
            yield out(f"response.{response['status']}", response=response)
        except RequestError as e:
            error = {"code": "server_error", "message": str(e)}
            yield out("response.failed", response=self.object("failed", [], error=error))
        finally:
            await stream.aclose()


class _Events:
    """The events of one streamed response, numbered in order; its output items open and
    close as the reply goes from thinking to text to calls."""

    def __init__(self, reply: Reply):
        self.reply, self.sequence, self.index = reply, 0, 0
        self.thinking: str | None = None  # the reasoning item's text while it is open
        self.thought = ""  # its text once closed
        self.said: str | None = None  # the message's text once it is open

    def __call__(self, kind: str, **data: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return sse(event, event=kind)

    def _at(self, item_id: str) -> dict[str, Any]:
        return {"item_id": item_id, "output_index": self.index}

    def think(self, text: str) -> list[bytes]:
        if not text or self.said is not None or self.thought:  # thinking comes first, in one piece
            return []
        r, events = self.reply, []
        if self.thinking is None:
            self.thinking = ""
            events += [self("response.output_item.added", output_index=self.index, item=r.reasoning_item(None)),
                       self("response.content_part.added", **self._at(r.reasoning_id), content_index=0,
                            part={"type": "reasoning_text", "text": ""})]
        self.thinking += text
        return [*events, self("response.reasoning_text.delta", **self._at(r.reasoning_id), content_index=0,
                              delta=text)]

    def _close_thought(self) -> list[bytes]:
        if self.thinking is None:
            return []
        r, self.thought, self.thinking = self.reply, self.thinking, None
        item = r.reasoning_item(self.thought)
        events = [self("response.reasoning_text.done", **self._at(r.reasoning_id), content_index=0,
                       text=self.thought),
                  self("response.content_part.done", **self._at(r.reasoning_id), content_index=0,
                       part=item["content"][0]),
                  self("response.output_item.done", output_index=self.index, item=item)]
        self.index += 1
        return events

    def _open_message(self) -> list[bytes]:
        r, self.said = self.reply, ""
        return [self("response.output_item.added", output_index=self.index, item=r.message_item(None, "in_progress")),
                self("response.content_part.added", **self._at(r.message_id), content_index=0, part=r.part("", []))]

    def say(self, text: str, chunks: list[Chunk]) -> list[bytes]:
        if not text:
            return []
        events = self._close_thought() + (self._open_message() if self.said is None else [])
        self.said += text
        return [*events, self("response.output_text.delta", **self._at(self.reply.message_id), content_index=0,
                              delta=text, logprobs=self.reply.logprobs(chunks))]

    def finish(self, chunks: list[Chunk]) -> tuple[list[bytes], dict[str, Any]]:
        """The events that close the reply, and the final Response object."""
        r, last = self.reply, chunks[-1]
        events = self._close_thought()
        if last.tool_calls and self.said is None:
            events += self.say(last.content or "", [])  # the text outside the calls, if any
        response = r.finished(chunks, self.thought, self.said or "")
        for item in response["output"][self.index:]:
            at = self._at(item["id"])
            if item["type"] == "message":
                events += self._open_message() if self.said is None else []
                part = item["content"][0]
                events += [self("response.output_text.done", **at, content_index=0, text=part["text"],
                                logprobs=part["logprobs"]),
                           self("response.content_part.done", **at, content_index=0, part=part)]
            else:
                events += [self("response.output_item.added", output_index=self.index,
                                item={**item, "status": "in_progress", "arguments": ""}),
                           self("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                           self("response.function_call_arguments.done", **at, name=item["name"],
                                arguments=item["arguments"])]
            events.append(self("response.output_item.done", output_index=self.index, item=item))
            self.index += 1
        return events, response


async def _chain(first: Chunk, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    yield first
    async for chunk in rest:
        yield chunk
