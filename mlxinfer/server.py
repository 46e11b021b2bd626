"""`mlxinfer serve`: an OpenAI-compatible HTTP server over the batched engine.

The engine (`batch.BatchGenerator`) runs on one dedicated thread, so MLX work never
blocks the event loop: requests reach it through a queue of commands (submit, cancel),
and each request's chunks come back through its own asyncio queue. Concurrent requests
share decode steps; a client that disconnects cancels its sequence at once. Requests
beyond the engine's slots wait in its queue, which is bounded: past it, a 503 with
Retry-After. One request's failure ends that request (500 or an error event), never the
server. Request and response shapes live in `openai_schema`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import json
import queue
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

import mlx.core as mx
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .batch import BatchGenerator, Prepared
from .errors import MlxinferError
from .generate import Chunk
from .openai_schema import ChatCompletion, Completion, Logprobs, RequestError, TextCompletion, choice, parse, usage
from .guard import LocalOnly, allowed_hosts, guarded_protocol
from .relay import Relay
from .tools import call_opener

RETRY_AFTER_SECONDS = 1
MAX_CONNECTIONS = 128  # under macOS's default of 256 descriptors a process
KEEP_ALIVE_SECONDS = 5  # an idle connection between requests
HEADER_SECONDS = 10  # from connecting (or the last response) to a request's last header
BODY_SECONDS = 30  # from the headers to the body's last byte
# Threads that prepare requests (render, tokenize, compile grammars) beside the engine thread.
PREPARE_THREADS = 2
T = TypeVar("T")


@dataclass
class _Request:
    """One request inside the engine thread: what to run and where its chunks go."""

    prompt: Any
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    prepared: Prepared | None = None
    uid: int | None = None


class EngineThread:
    """Runs a BatchGenerator on its own thread; `reserve`, `prepare`, `submit` and `cancel`
    are safe from any thread.

    A request first takes a place (`reserve`: at most `max_batch + max_queued` requests are
    in flight, past that a 503), is prepared on a small pool of other threads (`prepare`:
    rendering, tokenizing and compiling its grammar grow with the request, and must not
    stall the streams being decoded), then joins the engine (`submit`). It gets its chunks,
    then `None`; a refused request gets a RequestError instead. Its place is given back when
    the engine ends it, so a request whose client vanished still frees its place when it
    stops. `health` is a snapshot the engine thread refreshes before and after every step,
    so the event loop never touches the engine. With a relay (a model sharded across ranks), the
    engine commands of each round are shared before its step, and the other ranks' engines
    (`follow`) take the same commands and steps."""

    def __init__(self, engine: BatchGenerator, max_queued: int = 32, relay: Relay | None = None):
        self.engine, self.max_queued, self.relay = engine, max_queued, relay
        self.served = 0
        self._ops: list[list[Any]] = []  # what this round did to the engine, for the relay
        self.health: dict[str, Any] = {}
        self._in_flight = 0
        self.preparing = 0
        self._preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mlxinfer-prepare")
        self._lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._requests: dict[int, _Request] = {}  # engine uid -> request
        self._stop = threading.Event()
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="mlxinfer-engine", daemon=True)
        self._thread.start()

    def reserve(self) -> None:
        """Take a place for a new request, or refuse it (503) when all are taken."""
        limit = self.engine.max_batch + self.max_queued
        with self._lock:
            if self._stop.is_set():
                raise RequestError("the server is shutting down", status=503, kind="server_busy")
            if self._in_flight >= limit:
                raise RequestError(f"the server is busy ({limit} requests running or queued); retry shortly",
                                   status=503, kind="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self._in_flight += 1

    def release(self) -> None:
        """Give back the place of a request that never reached the engine."""
        with self._lock:
            self._in_flight -= 1

    async def prepare(self, request: _Request) -> None:
        """Prepare a reserved request off the engine thread; a bad one is a 400."""
        with self._lock:
            self.preparing += 1
        try:
            work = functools.partial(self.engine.prepare, request.prompt, **request.options)
            request.prepared = await asyncio.get_running_loop().run_in_executor(self._preparer, work)
        except MlxinferError as e:  # the request's own fault (options, prompt, context, grammar)
            raise RequestError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
            raise server_error(f"{type(e).__name__}: {' '.join(str(e).split())}") from None
        finally:
            with self._lock:
                self.preparing -= 1

    def submit(self, request: _Request) -> None:
        """Hand a prepared request to the engine."""
        self._commands.put(("submit", request))

    def cancel(self, request: _Request) -> None:
        self._commands.put(("cancel", request))

    def shutdown(self) -> None:
        """Refuse new requests and end those in flight now, each with its last chunk (the
        text it has); returns at once (safe in a signal handler)."""
        self._commands.put(("shutdown", None))

    def stop(self, timeout: float = 10.0) -> None:
        self.shutdown()
        self._thread.join(timeout)
        self._preparer.shutdown(wait=False, cancel_futures=True)

    def _deliver(self, request: _Request, item: Chunk | RequestError | None) -> None:
        try:
            request.loop.call_soon_threadsafe(request.chunks.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
            pass
        if item is None:
            with self._lock:
                self._in_flight -= 1

    def _refuse(self, request: _Request, error: RequestError) -> None:
        self._deliver(request, error)
        self._deliver(request, None)

    def _handle(self, command: str, request: _Request | None) -> None:
        if command == "submit":
            if self._stop.is_set():  # prepared while the server began to stop
                self._refuse(request, RequestError("the server is shutting down", status=503, kind="server_busy"))
                return
            try:
                request.uid = self.engine.enqueue(request.prepared)
            except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
                self._refuse(request, server_error(f"{type(e).__name__}: {e}"))
                return
            self._ops.append(["submit", request.prompt, request.options])
            self._requests[request.uid] = request
        elif command == "cancel" and request.uid in self._requests:
            self._cancel(request.uid)
        elif command == "shutdown":
            with self._lock:
                self._stop.set()
            for uid in self._requests:
                self._cancel(uid)

    def _cancel(self, uid: int) -> None:
        self.engine.cancel(uid)
        self._ops.append(["cancel", uid])

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.active
            try:
                while True:
                    self._handle(*self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            self._snapshot()  # a request that just arrived shows as active while its prefill runs
            if self.relay is not None:
                with self.relay.watchdog.bounded("a step"):
                    self.relay.share(self._ops)
            self._ops = []
            if self.engine.active:
                self._step()
            self._snapshot()
        if self.relay is not None:
            self.relay.share(None)
        for uid in list(self._requests):  # stopping: end the streams that are left
            self._deliver(self._requests.pop(uid), None)

    def _step(self) -> None:
        try:
            if self.relay is None:
                produced = self.engine.step()
            else:
                with self.relay.watchdog.bounded("a step"):
                    produced = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine ends a failed sequence itself; this is the last guard
            for uid, request in list(self._requests.items()):
                self._cancel(uid)
                self._refuse(request, server_error(f"{type(e).__name__}: {e}"))
            self._requests.clear()
            return
        for uid, chunk in produced:
            request = self._requests.get(uid)
            if request is None:
                continue
            if chunk.finish_reason == "error":
                self._refuse(request, server_error(chunk.error or "generation failed"))
            else:
                self._deliver(request, chunk)
                if chunk.finish_reason:
                    self._deliver(request, None)
            if chunk.finish_reason:
                del self._requests[uid]
                self.served += 1

    def _snapshot(self) -> None:
        e = self.engine
        running = min(e.active, e.max_batch)  # a step admits every waiting sequence that has a slot first
        self.health = {
            "active": running, "queued": e.active - running + self._commands.qsize(),
            "served": self.served,
            "cache_bytes": e.cache_bytes,
            "prompt_cache": dict(e.pool.stats.__dict__) if e.pool is not None else None,
            "memory": {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory()},
        }


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


def follow(engine: BatchGenerator, relay: Relay) -> None:
    """A rank other than 0: the engine commands and steps rank 0's `EngineThread` shares,
    until it stops. Waiting for the next round is not bounded (the server may be idle)."""
    while (ops := relay.share()) is not None:
        with relay.watchdog.bounded("a step"):
            for op in ops:
                if op[0] == "submit":
                    options = dict(op[2])
                    if "logit_bias" in options:  # JSON keys are strings; the engine wants token ids
                        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
                    engine.submit(op[1], **options)
                else:
                    engine.cancel(op[1])
            if engine.active:
                engine.step()


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


def server_error(message: str) -> RequestError:
    return RequestError(message, status=500, kind="server_error")


async def chunks_of(engine: EngineThread, prompt: Any, options: dict[str, Any]) -> AsyncIterator[Chunk]:
    """A request's chunks as they come: a place taken, the request prepared, then its engine
    chunks. Leaving early (a client gone) gives the place back or cancels the sequence."""
    request = _Request(prompt, options, asyncio.get_running_loop())
    engine.reserve()
    try:
        await engine.prepare(request)
    except BaseException:
        engine.release()
        raise
    engine.submit(request)
    finished = False
    try:
        while True:
            item = await request.chunks.get()
            if item is None:
                finished = True
                return
            if isinstance(item, RequestError):
                finished = True
                raise item
            yield item
    finally:
        if not finished:
            engine.cancel(request)


def check_key(header: str | None, key: str | None) -> bool:
    """Whether an Authorization header carries the API key (compared in constant time)."""
    if key is None:
        return True
    expected = f"Bearer {key}".encode()
    return header is not None and hmac.compare_digest(header.encode(), expected)


def sse(data: dict[str, Any] | str) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n".encode()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


@dataclass(frozen=True)
class ServerConfig:
    """What `create_app` needs besides the engine."""

    model_name: str
    max_tokens: int  # default for requests that give none: the model's context
    api_key: str | None = None
    cors: str | None = None
    max_body: int = 4 << 20
    hosts: frozenset[str] | None = allowed_hosts("127.0.0.1", ())  # what a request's Host may name; None: any


def create_app(engine: EngineThread, tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI application: OpenAI's chat and text completions, models, and health."""
    app = FastAPI(title="mlxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(LocalOnly, hosts=config.hosts, refusal=lambda status, message: RequestError(message).body())
    if config.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=[config.cors], allow_methods=["*"], allow_headers=["*"])
    ids = itertools.count()

    @app.exception_handler(RequestError)
    async def refused(_: Request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown path, wrong method: the API's shape too
        message = f"{request.method} {request.url.path[:200]}: {e.detail}"
        return JSONResponse(RequestError(message).body(), status_code=e.status_code, headers=e.headers)

    async def authorized(request: Request) -> None:
        if not check_key(request.headers.get("authorization"), config.api_key):
            raise RequestError("a valid API key is required (Authorization: Bearer KEY)", status=401,
                               kind="authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    async def body_of(request: Request) -> bytes:
        """The body, read no further than the size limit nor longer than BODY_SECONDS."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > config.max_body:
            raise RequestError(f"the request body is over {config.max_body} bytes", status=413)
        body = bytearray()

        async def read() -> None:
            async for part in request.stream():
                body.extend(part)
                if len(body) > config.max_body:
                    raise RequestError(f"the request body is over {config.max_body} bytes", status=413)

        try:
            await asyncio.wait_for(read(), BODY_SECONDS)
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {BODY_SECONDS} s", status=408) from None
        return bytes(body)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, **engine.health, "preparing": engine.preparing,
                "limits": {"max_concurrency": engine.engine.max_batch, "max_queued": engine.max_queued},
                "peak_rss_bytes": peak_rss_bytes()}

    def model_object() -> dict[str, Any]:
        return {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "mlxinfer"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        if name != config.model_name:
            raise RequestError(f"the model '{name[:200]}' does not exist; this server serves '{config.model_name}'",
                               "model", status=404, kind="not_found_error")
        return model_object()

    async def complete(request: Request, kind: type[Completion]) -> Response:
        body = parse(await body_of(request), kind)
        prompt, options = body.engine_prompt(), body.options(config.max_tokens)
        chat = kind is ChatCompletion
        calls = chat and options.get("tools") and options.get("tool_choice") != "none"
        reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}", chat, config.model_name,
                      Logprobs(tokenizer, chat, body.logprob_rows()) if body.logprob_rows() else None,
                      call_opener(tokenizer) if calls else None)
        stream = chunks_of(engine, prompt, options)
        gone = asyncio.ensure_future(hung_up(request))
        try:
            if not body.stream:
                return JSONResponse(reply.whole(await unless_gone(collect(stream), gone)))
            first = await unless_gone(anext(stream, None), gone)  # a refused request is a 400, not a broken stream
        except ClientGone:
            return Response(status_code=499)
        finally:
            gone.cancel()  # once streaming, the response itself notices a disconnect
        return StreamingResponse(reply.events(first, stream, body.include_usage), media_type="text/event-stream")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletion)

    @v1.post("/completions")
    async def completions(request: Request):
        return await complete(request, TextCompletion)

    app.include_router(v1)
    return app


class ClientGone(Exception):
    """The client hung up before its answer began."""


async def hung_up(request: Request) -> None:
    """Returns when the client closes its connection. The body has been read, so the next
    message the server gives is the disconnect: an event, no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], gone: asyncio.Future) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled, which cancels the request) as
    soon as `gone` is done: preparing, queueing and prefill included."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone
        return task.result()  # a refused or failed request raises its RequestError here
    finally:
        if not task.done():
            task.cancel()


async def collect(stream: AsyncIterator[Chunk]) -> list[Chunk]:
    """Every chunk of a non-streamed request."""
    return [chunk async for chunk in stream]


@dataclass
class Reply:
    """One request's response: the whole object, or its Server-Sent Events."""

    rid: str
    chat: bool
    model: str
    logprobs: Logprobs | None
    opener: str | None = None  # with tools: the text a call starts with

    def _object(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind = f"{kind}.chunk" if chunk and self.chat else kind
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model,
                "choices": choices, **extra}

    def whole(self, chunks: list[Chunk]) -> dict[str, Any]:
        last = chunks[-1]
        text = last.content if last.tool_calls else "".join(c.text for c in chunks)
        lp = self.logprobs.of(chunks) if self.logprobs else None
        return self._object([choice(self.chat, text, last.finish_reason, lp, delta=False, calls=last.tool_calls)],
                            chunk=False, usage=usage(last.stats))

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
                                    calls=last.tool_calls)], chunk=True)


async def _chain(first: Chunk, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    yield first
    async for chunk in rest:
        yield chunk
