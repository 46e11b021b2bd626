"""`mlxinfer serve`: the HTTP server over the batched engine.

The engine runs on its own thread (`engine_thread`); each HTTP API is a thin
translation module beside this one that parses its wire shape once into the typed
`Request` and writes the engine's chunks back in its own shape. This module assembles
them: the host and content-type guard, the API key, errors in each API's own shape,
health, and uvicorn with its connection limits.
"""

from __future__ import annotations

import hmac
import resource
import sys

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from . import adapters, anthropic, embeddings, health, inspect, metrics, openai, page, responses, tokens
from .api import Context, ServerConfig
from .errors import RequestError, dotted, refusal
from .engine_thread import EngineThread
from ..base.errors import MlxinferError
from .guard import LocalOnly, guarded_protocol

MAX_CONNECTIONS = 128  # under macOS's default of 256 descriptors a process
KEEP_ALIVE_SECONDS = 5  # an idle connection between requests
HEADER_SECONDS = 10  # from connecting (or the last response) to a request's last header

__all__ = ["EngineThread", "ServerConfig", "create_app", "run"]


class _Uvicorn(uvicorn.Server):
    """uvicorn whose first Ctrl-C / SIGTERM also ends the requests in flight, so their
    connections close at once instead of holding the shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, engine: EngineThread):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame) -> None:
        self.engine.shutdown()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has stopped; a stop the user asked for is a clean exit (status 0)
        getattr(self, "_captured_signals", []).clear()


def run(app: FastAPI, engine: EngineThread, host: str, port: int, max_connections: int = MAX_CONNECTIONS) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop the engine. At most `max_connections` are
    open at once (fewer when the descriptor limit says so); idle ones close after
    KEEP_ALIVE_SECONDS, and a request's headers must arrive within HEADER_SECONDS."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            http=guarded_protocol(max_connections, HEADER_SECONDS),
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    try:
        _Uvicorn(config, engine).run()
    finally:
        engine.stop()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


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


def error_body(path: str, e: RequestError) -> dict:
    """`e` in the shape of the API at `path`."""
    return e.anthropic_body() if path.startswith("/v1/messages") else e.body()


def error_response(request: Request, e: RequestError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, e), status_code=e.status, headers=e.headers)


def create_app(engine: EngineThread, model, tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI application: every API module's routes under /v1; /tokenize,
    /detokenize and /metrics at the root (where llama.cpp, vLLM and Prometheus look for
    them), behind the API key like /v1; health and the web app (unless `config.web` is
    off), open to all."""
    app = FastAPI(title="mlxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(LocalOnly, hosts=config.hosts, refusal=lambda status, message, path: error_body(path, RequestError(message, status=status)))
    if config.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=[config.cors], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(metrics.Counted, metrics=engine.metrics)  # outermost: every response is counted

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError):
        return error_response(request, e)

    @app.exception_handler(MlxinferError)
    async def invalid(request: Request, e: MlxinferError):  # a typed request that could not be made: the client's
        return error_response(request, RequestError.of(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown path, wrong method: the API's shape too
        allow = (e.headers or {}).get("Allow")
        message = f"{request.method} {request.url.path[:200]}: {e.detail}" + (f"; use {allow}" if allow else "")
        return error_response(request, RequestError(message, status=e.status_code, headers=e.headers))

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError):  # a route's typed parameter: a 400 as ours
        return error_response(request, refusal(e.errors(), place=parameter))

    async def authorized(request: Request) -> None:
        if not key_given(request, config.api_key):
            raise RequestError("a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                               status=401, kind="authentication_error")

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: a probe's headers, no body (uvicorn drops it)
    async def state():
        return {"status": "ok", "model": config.model_name, **engine.health, "preparing": engine.preparing,
                "limits": {"max_concurrency": engine.max_batch, "max_queued": engine.max_queued},
                "peak_rss_bytes": peak_rss_bytes(), "api_key_required": config.api_key is not None}

    ctx = Context(engine, model, tokenizer, config)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])
    for api in (openai, responses, anthropic, embeddings, adapters, inspect):
        v1.include_router(api.router(ctx))
    root = APIRouter(dependencies=[Depends(authorized)])
    for api in (tokens, health):
        root.include_router(api.router(ctx))
    app.include_router(v1)
    app.include_router(root)
    if config.web:
        app.include_router(page.router())  # the page and its assets: open to all, as the page asks for the key
    return app
