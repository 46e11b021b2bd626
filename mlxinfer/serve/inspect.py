"""`POST /v1/inspect` and `POST /v1/attention`: one chat's pipeline made visible, for the web
app's "Look inside" (and any client).

- `/v1/inspect` {"messages"}: what `mlxinfer inspect` reports for the prompt those messages
  render to (tokens, embedding, layers, KV cache bytes, prefill timing, the next token's
  distribution), computed by `inspection.inspect_pipeline` itself.
- `/v1/attention` {"messages", "reply", "layer", "head"}: the attention weights of the last
  token of prompt + reply over all of it, in one layer and head (`inspection.attention_weights`).

Both rerun the model over the context on the engine thread, one prefill chunk at a time between
the engine's own steps (`EngineThread.run_slices`), so no other stream waits longer than a chunk
for them; the context is bounded (MAX_TOKENS). Attention weights expose more of the model than
its text does and cost a forward pass each: the server offers them on a loopback address, or
behind --api-key elsewhere (`ServerConfig.attention`).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from .guard import LOOPBACK_NAMES
from ..engine.inspection import attention_slices, inspect_slices
from .api import Api, Route
from .bodies import parsed
from .errors import RequestError
from .models import Served
from .replies import json_reply
from .openai_schema import ImagePart, Message, Strict, parse
from .tokens import chat_prompt

MAX_TOKENS = 8192  # context a look inside reruns at most


class Inspect(Strict):
    messages: list[Message] = Field(min_length=1)
    model: str | None = None  # the model to look inside (none: the server's default)


class Attention(Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    reply: str = ""  # the assistant's reply so far: its last token is the one whose attention is shown
    layer: int = Field(0, ge=0)
    head: int = Field(0, ge=0)

    @field_validator("messages")
    @classmethod
    def text_only(cls, messages: list[Message]) -> list[Message]:
        """`attention_weights` runs the text layers over token ids: an image's placeholders
        would stand there without its pixels, so the weights would be of another prompt."""
        if any(isinstance(p, ImagePart) for m in messages if isinstance(m.content, list) for p in m.content):
            raise PydanticCustomError("images", "attention over image prompts is not offered; send text only", {})
        return messages


def attention_offered(host: str, api_key: str | None) -> bool:
    """Whether a server listening on `host` offers /v1/attention: on a loopback address, or
    behind an API key (`serve` warns when it is neither, as anyone who can reach it can use it)."""
    return host in LOOPBACK_NAMES or api_key is not None


class InspectApi(Api):
    """One chat's pipeline made visible, under /v1: its report, and its attention weights."""

    def routes(self) -> tuple[Route, ...]:
        return Route("/inspect", self.inspect), Route("/attention", self.attention)

    @staticmethod
    def bounded(ids: list[int], served: Served) -> list[int]:
        limit = min(MAX_TOKENS, served.model.config.max_position_embeddings)
        if len(ids) > limit:
            raise RequestError(f"the context is {len(ids)} tokens; a look inside reruns at most {limit}", "messages")
        if not ids:
            raise RequestError("the messages render to no tokens", "messages")
        return ids

    async def inspect(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, Inspect)
        async with self.ctx.models.use(body.model) as served:
            ids, images = await chat_prompt(served, body.messages)
            self.bounded(ids, served)
            report = await served.engine.run_slices(inspect_slices(served.model, served.tokenizer, ids, steps=1,
                                                                   images=images, chunk=served.engine.prefill_step))
        return await json_reply(lambda: report)

    async def attention(self, request: Request) -> Response:
        if not self.ctx.config.attention:
            raise RequestError("attention weights are offered on a loopback address, or with --api-key; restart "
                               "the server with --api-key KEY to use them here", status=403, kind="permission_error")
        body = await parsed(request, self.ctx.config.max_body, parse, Attention)
        async with self.ctx.models.use(body.model) as served:
            tokenizer = served.tokenizer
            reply = await asyncio.to_thread(tokenizer.encode, body.reply, False)
            ids = self.bounded((await chat_prompt(served, body.messages))[0] + reply, served)
            weights = await served.engine.run_slices(attention_slices(served.model, ids, body.layer, body.head,
                                                                      served.engine.prefill_step))
        return await json_reply(lambda: {"layer": body.layer, "head": body.head, "weights": weights, "tokens": [
            {"id": i, "text": p} for i, p in zip(ids, tokenizer.pieces(ids))]})
