"""OpenAI's chat and text completions (`/v1/chat/completions`, `/v1/completions`) and
models list, translated to the typed `Request` and back; the wire shapes live in
`openai_schema`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..generate import Chunk
from ..tools import call_opener
from .common import Context, RequestError, body_of, respond, sse
from .engine_thread import chunks_of
from .openai_schema import ChatCompletion, Completion, Logprobs, TextCompletion, choice, parse, usage


def router(ctx: Context) -> APIRouter:
    """The routes, under the server's /v1 prefix."""
    api = APIRouter()
    ids = itertools.count()
    config, tokenizer, engine = ctx.config, ctx.tokenizer, ctx.engine

    def model_object() -> dict[str, Any]:
        return {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "mlxinfer"}

    @api.get("/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @api.get("/models/{name:path}")
    async def model(name: str):
        if name != config.model_name:
            raise RequestError(f"the model '{name[:200]}' does not exist; this server serves '{config.model_name}'",
                               "model", status=404, kind="not_found_error")
        return model_object()

    async def complete(request: Request, kind: type[Completion]) -> Response:
        body = parse(await body_of(request, config.max_body), kind)
        typed = engine.engine.request(body.engine_prompt(), **body.options(config.max_tokens))
        chat = kind is ChatCompletion
        o = typed.options
        calls = chat and o.tools and o.tool_choice != "none"
        reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}", chat, config.model_name,
                      Logprobs(tokenizer, chat, body.logprob_rows()) if body.logprob_rows() else None,
                      call_opener(tokenizer) if calls else None, chat and body.legacy)
        return await respond(request, chunks_of(engine, typed), bool(body.stream), reply.whole,
                             lambda first, rest: reply.events(first, rest, body.include_usage))

    @api.post("/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletion)

    @api.post("/completions")
    async def completions(request: Request):
        return await complete(request, TextCompletion)

    return api


@dataclass
class Reply:
    """One request's response: the whole object, or its Server-Sent Events."""

    rid: str
    chat: bool
    model: str
    logprobs: Logprobs | None
    opener: str | None = None  # with tools: the text a call starts with
    legacy: bool = False  # called with the legacy `functions`: a call goes out as `function_call`

    def _object(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind = f"{kind}.chunk" if chunk and self.chat else kind
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model,
                "choices": choices, **extra}

    def whole(self, chunks: list[Chunk]) -> dict[str, Any]:
        last = chunks[-1]
        text = last.content if last.tool_calls else "".join(c.text for c in chunks)
        lp = self.logprobs.of(chunks) if self.logprobs else None
        return self._object([choice(self.chat, text, last.finish_reason, lp, delta=False, calls=last.tool_calls,
                                    legacy=self.legacy)], chunk=False, usage=usage(last.stats))

    def _could_call(self, text: str) -> bool:
        start = text.lstrip()
        return self.opener is not None and (start.startswith(self.opener) or self.opener.startswith(start))

    async def events(self, first: Chunk | None, stream: AsyncIterator[Chunk],
                     include_usage: bool) -> AsyncIterator[bytes]:
        """The stream; with tools, text that may be the start of a call is held back until
        it is known: a call goes out as one `tool_calls` delta, anything else as text."""
        last, held, sent = first, [], False
        try:
            if first is not None:
                async for chunk in _chain(first, stream):
                    last = chunk
                    if not sent and self._could_call("".join(c.text for c in (*held, chunk))) \
                            and not chunk.finish_reason:
                        held.append(chunk)
                        continue
                    yield sse(self._event([*held, chunk], first=not sent))
                    held, sent = [], True
            if include_usage and last is not None:
                yield sse(self._object([], chunk=True, usage=usage(last.stats)))
        except RequestError as e:
            yield sse(e.body())
        finally:
            await stream.aclose()
        yield sse("[DONE]")

    def _event(self, chunks: list[Chunk], first: bool = False) -> dict[str, Any]:
        last = chunks[-1]
        lp = self.logprobs.of(chunks) if self.logprobs else None
        text = last.content if last.tool_calls else "".join(c.text for c in chunks)
        return self._object([choice(self.chat, text, last.finish_reason, lp, delta=True, first=first,
                                    calls=last.tool_calls, legacy=self.legacy)], chunk=True)


async def _chain(first: Chunk, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    yield first
    async for chunk in rest:
        yield chunk

