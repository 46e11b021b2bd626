"""What each HTTP API of `mlxinfer serve` is given: how the server was started (`ServerConfig`)
and the engine, model and tokenizer it serves (`Context`)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, replace
from typing import Any

from ..engine.options import RequestOptions
from ..text.images import downloads, has_images
from .guard import allowed_hosts


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
