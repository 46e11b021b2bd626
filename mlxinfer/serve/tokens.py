"""`POST /tokenize` and `POST /detokenize`: the model's tokenizer over HTTP.

Two families of clients call these, with different bodies, and both are served:
- llama.cpp's server: `/tokenize` {"content", "add_special" (default false),
  "parse_special" (default true), "with_pieces"} -> {"tokens"} (ids, or {"id", "piece"}
  objects with `with_pieces`); `/detokenize` {"tokens"} -> {"content"}.
- vLLM's: `/tokenize` {"prompt", "add_special_tokens" (default true)} or {"messages",
  "add_generation_prompt", "tools"} -> {"tokens", "count", "max_model_len", "token_strs"};
  `/detokenize` {"tokens"} -> {"prompt"}.
The answer carries every key either family reads. Chat messages become exactly the ids a
chat completion would prefill (the same rendering, tools included), so a client can count
a conversation's tokens before sending it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import model_validator
from pydantic_core import PydanticCustomError

from ..base.checks import token_ids
from ..engine.options import RequestOptions
from ..engine.prompt import ImagePrompt, image_prompt, tool_plan
from .api import Api, Route
from .bodies import parsed
from .errors import RequestError
from .models import Served
from .replies import json_reply
from .openai_schema import ChatCompletion, Message, Strict, parse


class Tokenize(Strict):
    """One body for both families: `content` (llama.cpp) or `prompt` (vLLM) text, or
    `messages` (vLLM's chat form)."""

    model: str | None = None  # vLLM clients name the model
    content: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special: bool | None = None  # llama.cpp's name
    add_special_tokens: bool | None = None  # vLLM's name
    parse_special: bool = True
    with_pieces: bool = False
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def one_input(self) -> Tokenize:
        given = [k for k in ("content", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError("input", 'send one of "content" (text), "prompt" (text) or "messages" (chat '
                                      "messages)", {})
        if self.tools is not None and self.messages is None:
            raise PydanticCustomError("input", "tools are rendered with chat messages: send messages", {})
        return self

    def add_bos(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS, ...) around text: llama.cpp's
        default is no, vLLM's is yes; chat templates write their own."""
        for flag in (self.add_special_tokens, self.add_special):
            if flag is not None:
                return flag
        return self.prompt is not None


class Detokenize(Strict):
    model: str | None = None
    tokens: list[int]


async def chat_prompt(served: Served, messages: list[Message],
                      tools: list[dict[str, Any]] | None = None) -> tuple[list[int], ImagePrompt | None]:
    """The ids a chat completion of these messages (and tools) prefills and, when they hold
    images, the images as the engine prepares them: `engine.prompt.image_prompt`, as the engine
    itself renders a request (each image's placeholder expanded to its tokens), so the count is
    the completion's `usage.prompt_tokens`. The images are read as a completion's are
    (`EngineThread.request`), then rendered on a worker: the event loop is never held."""
    chat = ChatCompletion(messages=messages, tools=tools)
    options = RequestOptions(tools=tools or None, tool_choice="none")  # rendered, no grammar needed
    request = await served.engine.request(chat.engine_prompt(), options)
    return await asyncio.to_thread(image_prompt, served.model, served.tokenizer, request,
                                   tool_plan(request.options, served.tokenizer))


class TokensApi(Api):
    """The model's tokenizer over HTTP, at the server's root (where llama.cpp and vLLM serve it)."""

    prefix = ""

    def routes(self) -> tuple[Route, ...]:
        return Route("/tokenize", self.tokenize), Route("/detokenize", self.detokenize)

    async def tokenize(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, Tokenize)
        if not body.parse_special:
            raise RequestError("parse_special: false (special tokens' text read as plain text) is not supported; "
                               "leave it out", "parse_special")
        async with self.ctx.models.use(body.model) as served:
            ids = None
            if body.messages is not None:
                if not body.add_generation_prompt or body.add_special_tokens:
                    raise RequestError("chat messages are counted as a chat completion renders them: with the "
                                       "generation prompt and the template's own special tokens; leave "
                                       "add_generation_prompt and add_special_tokens out",
                                       "add_generation_prompt" if not body.add_generation_prompt
                                       else "add_special_tokens")
                ids = (await chat_prompt(served, body.messages, body.tools))[0]
            # a long text or template must not stall the loop
            return await json_reply(lambda: self.tokens(body, ids, served))

    @staticmethod
    def tokens(body: Tokenize, ids: list[int] | None, served: Served) -> dict[str, Any]:
        """The answer for `body`: its text's ids, or `ids` (its messages', `chat_prompt`)."""
        tokenizer = served.tokenizer
        if ids is None:
            ids = tokenizer.encode(body.content if body.content is not None else body.prompt, body.add_bos())
        tokens: list[Any] = [{"id": i, "piece": p} for i, p in zip(ids, tokenizer.pieces(ids))] if body.with_pieces \
            else ids
        strs = [tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"tokens": tokens, "count": len(ids), "max_model_len": served.model.config.max_position_embeddings,
                "token_strs": strs}

    async def detokenize(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, Detokenize)
        async with self.ctx.models.use(body.model) as served:
            tokenizer = served.tokenizer

            def detokenized() -> dict[str, str]:
                text = tokenizer.decode(token_ids(body.tokens, tokenizer.vocab_size, "tokens"))
                return {"content": text, "prompt": text}

            return await json_reply(detokenized)
