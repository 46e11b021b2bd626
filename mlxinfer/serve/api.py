"""What an HTTP API of `mlxinfer serve` is: a class of its own (`Api`) whose methods are its
routes (`Route`), over what every API is given (`Context`: the models it serves, each taken per
request through `models.use`, and how the server was started, `ServerConfig`), writing its
errors in its own shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from .errors import RequestError
from .guard import allowed_hosts
from .models import Models


@dataclass(frozen=True)
class ServerConfig:
    """How the server was started, as the API modules need it."""

    api_key: str | None = None
    cors: str | None = None
    max_body: int = 4 << 20
    hosts: frozenset[str] | None = allowed_hosts("127.0.0.1", ())  # what a request's Host may name; None: any
    responses_store: int = 256  # Responses API objects kept for retrieval and previous_response_id
    responses_store_bytes: int = 256 << 20  # ... and the bytes they may hold in all
    max_adapters: int = 8  # LoRA adapters loaded at once on one model (POST /v1/adapters)
    web: bool = True  # the chat page at / (`serve --no-web`: none)
    attention: bool = True  # POST /v1/attention: off on a non-loopback host without an API key


@dataclass(frozen=True)
class Context:
    """What each API is given: the models (`Models`: a request takes its own with
    `models.use(body.model)`), and the server's config."""

    models: Models
    config: ServerConfig


@dataclass(frozen=True)
class Route:
    """One route of an API: its path under the API's prefix, the method that serves it, and the
    HTTP methods it answers."""

    path: str
    endpoint: Callable[..., Awaitable[object]]
    methods: tuple[str, ...] = ("POST",)


class Api:
    """One HTTP API of the server: its routes (`routes`, methods of the API over its `Context`)
    and the shape its errors take (`error_body`: OpenAI's, which most clients read, unless it has
    its own). Adding an API is one subclass in a module of its own, listed in `app.APIS`."""

    prefix = "/v1"  # where its routes are mounted ("": at the server's root)
    keyed = True  # behind the API key (False: open to all, as the web page and /health are)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def routes(self) -> tuple[Route, ...]:
        """Its routes, under `prefix`: one table per API, so its paths are read in one place."""
        raise NotImplementedError

    @staticmethod
    def error_body(e: RequestError) -> dict[str, Any]:
        """`e` in this API's shape."""
        return e.body()

    @staticmethod
    def claims(headers: Mapping[str, str]) -> bool:
        """Whether a request's headers say its client speaks this API, wherever it was sent (its
        errors then take this API's shape): none but an API whose clients mark themselves."""
        return False

    def router(self) -> APIRouter:
        """Its routes as FastAPI mounts them; a route's return value is written as it is (no
        response model re-validates it)."""
        api = APIRouter(prefix=self.prefix)
        for route in self.routes():
            api.add_api_route(route.path, route.endpoint, methods=list(route.methods), response_model=None)
        return api
