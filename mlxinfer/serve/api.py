"""What each HTTP API of `mlxinfer serve` is given: how the server was started (`ServerConfig`)
and the engine, model and tokenizer it serves (`Context`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine.options import RequestOptions
from ..models.layers import CausalLM
from ..text.tokenizer import Tokenizer
from .engine_thread import EngineThread
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

    engine: EngineThread
    model: CausalLM
    tokenizer: Tokenizer
    config: ServerConfig
