"""`mlxinfer serve`: an OpenAI-compatible HTTP server over the batched engine.

The engine (`batch.BatchGenerator`) runs on one dedicated thread, so MLX work never
blocks the event loop: requests reach it through a queue of commands (submit,
cancel), and each request's chunks come back through its own asyncio queue. Concurrent
requests share decode steps; a client that disconnects cancels its sequence at once.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .batch import BatchGenerator
from .errors import MlxinferError
from .generate import Chunk

# Request fields that change the output but are not supported: refused, never ignored.
UNSUPPORTED = ("response_format", "tools", "tool_choice", "functions", "function_call", "logprobs_offset",
               "best_of", "echo", "suffix", "audio", "modalities", "prediction", "n_probs")


@dataclass
class _Request:
    """One request inside the engine thread: where its chunks go."""

    prompt: Any
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue
    uid: int | None = None


@dataclass
class EngineStats:
    """What /health reports."""

    active: int = 0
    queued: int = 0
    served: int = 0
    pool: dict[str, int] = field(default_factory=dict)


class EngineThread:
    """Runs a BatchGenerator on its own thread; `submit` and `cancel` are safe from any thread.

    Chunks (or an exception, which ends that request only) are handed to the request's
    event loop with `call_soon_threadsafe`; `None` marks the end of a request."""

    def __init__(self, engine: BatchGenerator, max_queued: int = 64):
        self.engine = engine
        self.max_queued = max_queued
        self._commands: queue.Queue = queue.Queue()
        self._requests: dict[int, _Request] = {}  # engine uid -> request
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.served = 0
        self._thread = threading.Thread(target=self._run, name="mlxinfer-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._commands.qsize()

    def submit(self, request: _Request) -> None:
        self._commands.put(("submit", request))

    def cancel(self, request: _Request) -> None:
        self._commands.put(("cancel", request))

    def stop(self, timeout: float = 10.0) -> None:
        """End every request in flight with what it has, then stop the thread."""
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def stats(self) -> EngineStats:
        pool = self.engine.pool.stats.__dict__ if self.engine.pool is not None else {}
        return EngineStats(self.engine.active, self.queued, self.served, dict(pool))

    def _deliver(self, request: _Request, item: Chunk | Exception | None) -> None:
        request.loop.call_soon_threadsafe(request.chunks.put_nowait, item)

    def _handle(self, command: str, request: _Request | None) -> None:
        if command == "submit":
            try:
                request.uid = self.engine.submit(request.prompt, **request.options)
            except MlxinferError as e:  # the request's own fault (options, prompt, context): a 400
                self._deliver(request, RequestError(str(e)))
                self._deliver(request, None)
                return
            self._requests[request.uid] = request
        elif command == "cancel" and request.uid in self._requests:
            self.engine.cancel(request.uid)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.active
            try:
                while True:
                    self._handle(*self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            if not self.engine.active:
                continue
            try:
                produced = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one failed step ends the requests in it, not the server
                self._fail_all(e)
                continue
            for uid, chunk in produced:
                request = self._requests.get(uid)
                if request is None:
                    continue
                self._deliver(request, chunk)
                if chunk.finish_reason:
                    self._deliver(request, None)
                    del self._requests[uid]
                    self.served += 1
        for uid in list(self._requests):  # stopping: end the streams that are left
            self._deliver(self._requests.pop(uid), None)

    def _fail_all(self, error: Exception) -> None:
        for uid, request in list(self._requests.items()):
            self.engine.cancel(uid)
            self._deliver(request, error)
            self._deliver(request, None)
        self._requests.clear()


async def chunks_of(engine: EngineThread, prompt: Any, options: dict[str, Any]) -> AsyncIterator[Chunk]:
    """A request's chunks as they come; leaving early (a client gone) cancels it."""
    request = _Request(prompt, options, asyncio.get_running_loop(), asyncio.Queue())
    engine.submit(request)
    finished = False
    try:
        while True:
            item = await request.chunks.get()
            if item is None:
                finished = True
                return
            if isinstance(item, Exception):
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


def now() -> int:
    return int(time.time())


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
KNOWN_FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stop", "logit_bias",
                "logprobs", "top_logprobs", "n", "stream", "stream_options", "user", *SAMPLING_FIELDS}


class RequestError(Exception):
    """A request the server refuses: HTTP `status` with an OpenAI-shaped error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": None}}


def generation_options(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The engine options an OpenAI request body asks for; RequestError for what cannot be honoured."""
    for name in body:
        if name in UNSUPPORTED or name not in KNOWN_FIELDS:
            raise RequestError(f"parameter '{name}' is not supported by this server", name)
    if (body.get("n") or 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    options = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    limit = body.get("max_completion_tokens") if chat else None
    limit = limit if limit is not None else body.get("max_tokens")
    if limit is not None:
        options["max_tokens"] = limit
    if body.get("stop") is not None:
        options["stop"] = body["stop"]
    if body.get("logit_bias"):
        try:
            options["logit_bias"] = {int(k): v for k, v in body["logit_bias"].items()}
        except (TypeError, ValueError, AttributeError):
            raise RequestError("logit_bias must map token ids to numbers", "logit_bias") from None
    wants = body.get("logprobs")
    if chat and wants:
        options["logprobs"] = max(int(body.get("top_logprobs") or 0), 1)
    elif not chat and wants:
        options["logprobs"] = int(wants)
    return options


def usage(stats) -> dict[str, Any]:
    cached = max(stats.prompt_tokens - stats.prefill_tokens, 0)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish(reason: str | None) -> str | None:
    return "stop" if reason == "cancelled" else reason


def chat_logprobs(tokenizer, chunk: Chunk) -> list[dict[str, Any]]:
    if chunk.token is None or chunk.top_logprobs is None:
        return []
    top = [{"token": tokenizer.decode([t]), "logprob": lp} for t, lp in chunk.top_logprobs]
    return [{"token": tokenizer.decode([chunk.token]), "logprob": chunk.logprob, "top_logprobs": top}]


def create_app(engine: EngineThread, tokenizer, model_name: str, api_key: str | None = None,
               cors: str | None = None, max_body: int = 4 << 20):
    """The FastAPI application: OpenAI's chat and text completions, models, and health."""
    app = FastAPI(title="mlxinfer", docs_url=None, redoc_url=None)
    if cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=[cors], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(RequestError)
    async def refused(_: Request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/v1/") and not check_key(request.headers.get("authorization"), api_key):
            return JSONResponse(RequestError("a valid API key is required (Authorization: Bearer KEY)",
                                             status=401).body(), status_code=401)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body:
            return JSONResponse(RequestError(f"the request body is over {max_body} bytes", status=413).body(),
                                status_code=413)
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        s = engine.stats()
        return {"status": "ok", "model": model_name, "active": s.active, "queued": s.queued, "served": s.served,
                "prompt_cache": s.pool}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "mlxinfer"}]}

    async def complete(request: Request, chat: bool):
        body = await body_of(request)
        options = generation_options(body, chat)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("messages must be a non-empty list", "messages")
            prompt: Any = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in messages
                           if isinstance(m, dict)]
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, (str, list)) or not prompt:
                raise RequestError("prompt must be a non-empty string or list of token ids", "prompt")
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids)}"
        stream = chunks_of(engine, prompt, options)
        if body.get("stream"):
            first = await _first(stream)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_events(first, stream, rid, kind, chat, include_usage, tokenizer, model_name),
                                     media_type="text/event-stream")
        text, last, logprobs = [], None, []
        async for chunk in stream:
            text.append(chunk.text)
            logprobs += chat_logprobs(tokenizer, chunk) if options.get("logprobs") else []
            last = chunk
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish(last.finish_reason),
                                  "logprobs": {"content": logprobs} if options.get("logprobs") else None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return {"id": rid, "object": kind, "created": now(), "model": model_name, "choices": [choice],
                "usage": usage(last.stats)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


_ids = itertools.count()


def _text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError("message content must be a string or a list of text parts", "messages")


async def _first(stream: AsyncIterator[Chunk]) -> Chunk | None:
    """The first chunk, awaited before the response starts so a refused request is a 400, not a broken stream."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _events(first, stream, rid, kind, chat, include_usage, tokenizer, model_name) -> AsyncIterator[bytes]:
    def event(chunk: Chunk, role: bool = False) -> dict[str, Any]:
        if chat:
            delta = {"role": "assistant", "content": chunk.text} if role else {"content": chunk.text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish(chunk.finish_reason)}
        else:
            choice = {"index": 0, "text": chunk.text, "finish_reason": finish(chunk.finish_reason)}
        return {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": now(), "model": model_name,
                "choices": [choice]}

    last = first
    try:
        if first is not None:
            yield sse(event(first, role=True))
            async for chunk in stream:
                last = chunk
                yield sse(event(chunk))
        if include_usage and last is not None:
            yield sse({"id": rid, "object": f"{kind}.chunk", "created": now(), "model": model_name, "choices": [],
                       "usage": usage(last.stats)})
    except MlxinferError as e:
        yield sse({"error": {"message": str(e), "type": "server_error"}})
    finally:
        await stream.aclose()
    yield sse("[DONE]")
