"""`mlxinfer serve`: the HTTP server over the batched engine.

The engine runs on its own thread (`engine_thread`); each HTTP API is a thin
translation module beside this one (an `api.Api`) that parses its wire shape once into the
typed `Request` and writes the engine's chunks back in its own shape. This module assembles
them (`APIS`): the host and content-type guard, the API key, errors in each API's own shape
(`ErrorShapes`), and uvicorn with its connection limits.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Sequence

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from ..base.errors import MlxinferError
from . import metrics
from .adapters import AdaptersApi
from .anthropic import MessagesApi
from .api import Api, Context, ServerConfig
from .embeddings import EmbeddingsApi
from .engine_thread import EngineThread
from .errors import RequestError, dotted, refusal
from .guard import LocalOnly, guarded_protocol
from .health import HealthApi, MetricsApi
from .inspect import InspectApi
from .models import Models, WatchesClients
from .ollama import OllamaApi
from .openai import OpenAIApi
from .page import PageApi
from .responses import ResponsesApi
from .tokens import TokensApi

MAX_CONNECTIONS = 128  # under macOS's default of 256 descriptors a process
KEEP_ALIVE_SECONDS = 5  # an idle connection between requests
HEADER_SECONDS = 10  # from connecting (or the last response) to a request's last header

__all__ = ["EngineThread", "Models", "ServerConfig", "create_app", "run"]

# Every API the server offers (the web page joins them unless `serve --no-web`); adding one is
# adding its module and its class here.
APIS: tuple[type[Api], ...] = (HealthApi, OpenAIApi, ResponsesApi, MessagesApi, EmbeddingsApi, AdaptersApi,
                               InspectApi, TokensApi, MetricsApi, OllamaApi)


class _Uvicorn(uvicorn.Server):
    """uvicorn whose first Ctrl-C / SIGTERM also ends the requests in flight, so their
    connections close at once instead of holding the shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, models: Models):
        super().__init__(config)
        self.models = models

    def handle_exit(self, sig: int, frame) -> None:
        self.models.shutdown()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has stopped; a stop the user asked for is a clean exit (status 0)
        getattr(self, "_captured_signals", []).clear()


def run(app: FastAPI, models: Models, host: str, port: int, max_connections: int = MAX_CONNECTIONS) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop every model's engine. At most `max_connections` are
    open at once (fewer when the descriptor limit says so); idle ones close after
    KEEP_ALIVE_SECONDS, and a request's headers must arrive within HEADER_SECONDS."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            http=guarded_protocol(max_connections, HEADER_SECONDS),
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    try:
        _Uvicorn(config, models).run()
    finally:
        models.stop()


def key_given(request: Request, key: str | None) -> bool:
    """Whether the request carries the API key, as OpenAI's clients send it (Authorization:
    Bearer) or Anthropic's (x-api-key); compared in constant time."""
    if key is None:
        return True
    bearer = request.headers.get("authorization")
    anthropic = request.headers.get("x-api-key")
    return (bearer is not None and hmac.compare_digest(bearer.encode(), f"Bearer {key}".encode())) or \
        (anthropic is not None and hmac.compare_digest(anthropic.encode(), key.encode()))


def parameter(loc: tuple[int | str, ...]) -> str | None:
    """A route parameter's name, without where FastAPI read it from."""
    return dotted(tuple(p for p in loc if p not in ("body", "query", "path", "header")))


class ErrorShapes:
    """Which API's shape a request's error takes: that of an API whose clients mark their
    requests (`Api.claims`: Anthropic's send `anthropic-version`), else by its path: that of the
    API one of whose routes' paths (up to its first parameter) is the longest prefix of it, so an
    unknown path or a wrong method among an API's routes answers as that API does; OpenAI's shape
    elsewhere."""

    def __init__(self, apis: Sequence[Api]) -> None:
        owned = [((api.prefix + route.path.partition("{")[0]).rstrip("/"), api) for api in apis
                 for route in api.routes()]
        self.owners = sorted(owned, key=lambda owner: len(owner[0]), reverse=True)
        self.apis = apis

    def body(self, path: str, e: RequestError, headers: Mapping[str, str] = {}) -> dict[str, Any]:
        """`e` in the shape of the API whose client sent `headers`, or of the API at `path`."""
        for api in self.apis:
            if api.claims(headers):
                return api.error_body(e)
        for prefix, api in self.owners:
            if path == prefix or path.startswith(f"{prefix}/"):
                return api.error_body(e)
        return e.body()


def create_app(models: Models, config: ServerConfig) -> FastAPI:
    """The FastAPI application over `models`: every API's routes (`APIS`, and the web page unless
    `config.web` is off), behind the API key but for health and the page; errors in each API's own shape."""
    ctx = Context(models, config)
    apis = [api(ctx) for api in (*APIS, *((PageApi,) if config.web else ()))]
    shapes = ErrorShapes(apis)
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        models.start()  # the preloaded models' keep-alive countdowns
        yield

    app = FastAPI(title="mlxinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(WatchesClients)  # innermost: a request waiting for its model's load learns its client left
    app.add_middleware(LocalOnly, hosts=config.hosts,
                       refusal=lambda status, message, path: shapes.body(path, RequestError(message, status=status)),
                       routed=lambda scope: any(r.matches(scope)[0] != Match.NONE for r in app.router.routes))
    if config.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=[config.cors], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(metrics.Counted, metrics=models.metrics)  # outermost: every response is counted

    def error_response(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(shapes.body(request.url.path, e, request.headers), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError) -> JSONResponse:
        return error_response(request, e)

    @app.exception_handler(MlxinferError)
    async def invalid(request: Request, e: MlxinferError) -> JSONResponse:  # a request our code refused: the client's
        return error_response(request, RequestError.of(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown path, wrong method
        allow = (e.headers or {}).get("Allow")
        message = f"{request.method} {request.url.path[:200]}: {e.detail}" + (f"; use {allow}" if allow else "")
        return error_response(request, RequestError(message, status=e.status_code, headers=e.headers))

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError) -> JSONResponse:  # a route's typed parameter
        return error_response(request, refusal(e.errors(), place=parameter))

    async def authorized(request: Request) -> None:
        if not key_given(request, config.api_key):
            raise RequestError("a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                               status=401, kind="authentication_error")

    for api in apis:
        app.include_router(api.router(), dependencies=[Depends(authorized)] if api.keyed else [])
    return app
