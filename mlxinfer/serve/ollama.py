"""Ollama's native API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/version`...), translated to the typed `Request` and back; the request bodies
live in `ollama_schema`. Errors take Ollama's shape, `{"error": "..."}`.

Replies stream as NDJSON unless `stream: false`: one object a line, each `done: false` with the
text (or thinking, or tool calls) it adds, then one `done: true` with why it ended and the
measured numbers, durations in nanoseconds as Ollama documents them: `total_duration` from the
request's arrival to its end, `load_duration` the time taken to get the model, `prompt_eval_duration`
from the request reaching the engine to its first token, `eval_duration` from the first token to
the last; `prompt_eval_count` the prompt's tokens, `eval_count` the tokens generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from mlx.utils import tree_flatten

from .. import __version__
from ..base.errors import MlxinferError, ModelNotFoundError
from ..convert.pull import PullProgress, pull
from ..loading import store
from ..loading.store import LocalModel
from ..engine.text_stream import Chunk
from ..models.layers import CausalLM
from ..text.reasoning import tags_for
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolCall, call_opener, may_open_call
from .api import Api, Route
from .bodies import parsed
from .embeddings import embedded
from .engine_thread import EngineThread
from .errors import RequestError
from .ollama_schema import Chat, Copy, Embed, Embeddings, Generate, Named, Pull, Show, parse
from .replies import ClientGone, json_reply, respond

NDJSON = "application/x-ndjson"
FOREVER = datetime(9999, 12, 31, tzinfo=timezone.utc)  # the expiry of a model kept loaded for good
STARTED = datetime.now(timezone.utc)  # when the server's model was loaded: its listing's modified_at


@dataclass(frozen=True)
class Served:
    """The model a request runs on, and its name as this API reports it."""

    name: str
    engine: EngineThread
    model: CausalLM
    tokenizer: Tokenizer
    max_tokens: int


class OllamaApi(Api):
    """Ollama's native API, under /api, its errors in Ollama's shape."""

    prefix = "/api"

    def routes(self) -> tuple[Route, ...]:
        return (Route("/chat", self.chat), Route("/generate", self.generate), Route("/embed", self.embed),
                Route("/embeddings", self.embeddings), Route("/tags", self.tags, ("GET",)),
                Route("/show", self.show), Route("/ps", self.ps, ("GET",)), Route("/version", self.version, ("GET",)),
                Route("/delete", self.delete, ("DELETE",)), Route("/copy", self.copy), Route("/pull", self.pull))

    @staticmethod
    def error_body(e: RequestError) -> dict[str, Any]:
        return {"error": str(e)}

    def names(self) -> list[str]:
        return [self.ctx.config.model_name]

    @contextlib.asynccontextmanager
    async def served(self, name: str, keep_alive: float | None = None) -> AsyncIterator[Served]:
        """The model `name` names (its `:latest` tag optional, as Ollama's names have one), held
        for the block; a name this server does not serve is a 404."""
        config = self.ctx.config
        if name.removesuffix(":latest") not in self.names():
            raise RequestError(f'model "{name[:200]}" not found; this server serves {", ".join(self.names())} '
                               "(GET /api/tags lists them)", "model", status=404)
        yield Served(config.model_name, self.ctx.engine, self.ctx.model, self.ctx.tokenizer, config.max_tokens)

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, Chat)

    async def generate(self, request: Request) -> Response:
        return await self.complete(request, Generate)

    async def complete(self, request: Request, kind: type[Chat] | type[Generate]) -> Response:
        """A chat or generation: its chunks as NDJSON lines, or one object; no messages (or no
        prompt) only loads the model, or with keep_alive 0 lets it go."""
        arrived = time.perf_counter_ns()
        body = await parsed(request, self.ctx.config.max_body, parse, kind)
        keep_alive = body.keep_alive_seconds
        async with contextlib.AsyncExitStack() as hold:
            served = await hold.enter_async_context(self.served(body.model, keep_alive))
            loaded = time.perf_counter_ns()
            chat = kind is Chat
            if body.loads_only:
                return JSONResponse(loaded_reply(served.name, chat, keep_alive == 0))
            if body.think and tags_for(served.tokenizer) is None:
                raise RequestError(f'"{served.name}" does not support thinking: its chat template has no thinking '
                                   "part; leave think out", "think")
            options = body.request_options(served.max_tokens)
            if options.max_tokens is None:
                options = replace(options, max_tokens=served.max_tokens)
            prompt = body.prompt() if isinstance(body, Chat) else body.engine_prompt()
            typed = await served.engine.request(prompt, options)
            o = typed.options
            calls = chat and o.tools and o.tool_choice != "none"
            reply = Reply(model=served.name, chat=chat, arrived=arrived, loaded=loaded,
                          opener=call_opener(served.tokenizer) if calls else None, top=body.top,
                          tokenizer=served.tokenizer)
            response = await respond(request, reply.timed(served.engine.chunks(typed)), body.streamed, reply.whole,
                                     reply.lines, NDJSON)
            if isinstance(response, StreamingResponse):  # the model stays held until the stream ends
                response.body_iterator = held(response.body_iterator, hold.pop_all())
            return response

    async def embed(self, request: Request) -> Response:
        arrived = time.perf_counter_ns()
        body = await parsed(request, self.ctx.config.max_body, parse, Embed)
        async with self.served(body.model, body.keep_alive_seconds) as served:
            loaded = time.perf_counter_ns()
            try:
                vectors, tokens = await embedded(request, served.engine, served.model, served.tokenizer,
                                                 body.input, body.dimensions)
            except ClientGone:
                return Response(status_code=499)
        done = time.perf_counter_ns()
        return await json_reply(lambda: {"model": served.name, "embeddings": [v.tolist() for v in vectors],
                                         "total_duration": done - arrived, "load_duration": loaded - arrived,
                                         "prompt_eval_count": tokens})

    async def embeddings(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, Embeddings)
        async with self.served(body.model, body.keep_alive_seconds) as served:
            try:
                vectors, _ = await embedded(request, served.engine, served.model, served.tokenizer, [body.prompt],
                                            None)
            except ClientGone:
                return Response(status_code=499)
        return await json_reply(lambda: {"embedding": vectors[0].tolist()})

    async def tags(self) -> dict[str, Any]:
        return {"models": [{**self.listed(self.ctx.model, name), "modified_at": rfc3339(STARTED)}
                           for name in self.names()]}

    async def ps(self) -> dict[str, Any]:
        model = self.ctx.model
        return {"models": [{**self.listed(model, name), "expires_at": rfc3339(FOREVER), "size_vram": memory(model),
                            "context_length": self.ctx.config.max_tokens} for name in self.names()]}

    async def show(self, request: Request) -> dict[str, Any]:
        body = await parsed(request, self.ctx.config.max_body, parse, Show)
        async with self.served(body.target) as served:
            model, tokenizer = served.model, served.tokenizer
            return {"details": details(model), "model_info": model_info(model, tokenizer),
                    "template": tokenizer.chat_template or "", "parameters": parameters(served),
                    "capabilities": capabilities(model, tokenizer), "modified_at": rfc3339(STARTED),
                    "license": ""}

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def pull(self, request: Request) -> Response:
        """Pull a model into mlxinfer's cache (`convert.pull.pull`: a hub id, a model folder, a GGUF
        file or URL, converted on the way) on a worker thread; its steps as NDJSON status lines,
        or `{"status": "success"}` alone with stream false. A source refused before any step is a
        4xx; a failure later, an `{"error"}` line. A client that leaves does not stop the pull: it
        runs to its end (a half-made model is never listed), as Ollama's does."""
        body = await parsed(request, self.ctx.config.max_body, parse, Pull)
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[PullProgress] = asyncio.Queue()
        work = asyncio.ensure_future(stored(functools.partial(
            pull, progress=lambda step: loop.call_soon_threadsafe(steps.put_nowait, step)), body.target))
        if not body.streamed:
            await work
            return JSONResponse({"status": "success"})
        first = asyncio.ensure_future(steps.get())
        await asyncio.wait({work, first}, return_when=asyncio.FIRST_COMPLETED)
        if work.done() and work.exception() is not None:
            first.cancel()
            await work  # refused before any step: its status code
        return StreamingResponse(pull_lines(await first, steps, work), media_type=NDJSON)

    async def delete(self, request: Request) -> Response:
        """Delete a model from mlxinfer's cache (only there: `store.remove`)."""
        body = await parsed(request, self.ctx.config.max_body, parse, Named)
        await stored(store.remove, body.target)
        return Response(status_code=200)

    async def copy(self, request: Request) -> Response:
        """Copy a model into mlxinfer's cache under a new name (`store.copy`)."""
        body = await parsed(request, self.ctx.config.max_body, parse, Copy)
        await stored(store.copy, body.source, body.destination)
        return Response(status_code=200)

    def listed(self, model: CausalLM, name: str) -> dict[str, Any]:
        """What /api/tags and /api/ps say of a model."""
        return {"name": name, "model": name, "size": memory(model), "digest": digest(name),
                "details": details(model)}


async def stored(change: Callable[..., LocalModel], *names: str) -> LocalModel:
    """A change to the model store, made on a worker thread (it moves and writes files); a model it
    does not find is a 404, as Ollama answers, any other refusal a 400."""
    try:
        return await asyncio.to_thread(change, *names)
    except ModelNotFoundError as e:
        raise RequestError(str(e), "model", status=404) from None
    except MlxinferError as e:
        raise RequestError.of(e, "model") from None


async def pull_lines(first: PullProgress, steps: asyncio.Queue[PullProgress],
                     work: asyncio.Future) -> AsyncIterator[bytes]:
    """A pull's steps as Ollama's progress lines (`status`, and `total` / `completed` bytes for a
    download), until it ends; a failure is an `{"error"}` line."""
    step: PullProgress | None = first
    while step is not None:
        yield _line({"status": step.status, **({"total": step.total} if step.total is not None else {}),
                     **({"completed": step.completed} if step.completed is not None else {})})
        following = asyncio.ensure_future(steps.get())
        await asyncio.wait({work, following}, return_when=asyncio.FIRST_COMPLETED)
        if following.done():
            step = following.result()
            continue
        following.cancel()
        step = steps.get_nowait() if not steps.empty() else None
    try:
        await work
    except RequestError as e:
        yield _line({"error": str(e)})


def rfc3339(when: datetime) -> str:
    """A time as Ollama writes it (RFC 3339, UTC)."""
    return when.isoformat().replace("+00:00", "Z")


def now() -> str:
    return rfc3339(datetime.now(timezone.utc))


def digest(name: str) -> str:
    """An identifier for a model, in the shape of Ollama's digests (64 hex digits)."""
    return hashlib.sha256(name.encode()).hexdigest()


def memory(model: CausalLM) -> int:
    """Bytes the model's weights hold."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def parameter_count(model: CausalLM) -> int:
    """Parameters as the unquantized model has them: a quantized weight packs 32/bits values a word."""
    flat = dict(tree_flatten(model.parameters()))
    total = 0
    for name, value in flat.items():
        base = name.rsplit(".", 1)[0]
        quantized = f"{base}.scales" in flat
        if quantized and name.endswith((".scales", ".biases")):
            continue
        n = value.size
        if quantized and name.endswith(".weight"):
            n = n * 32 // ((model.config.quantization or {}).get("bits") or 4)
        total += n
    return total


def human(n: int) -> str:
    """A parameter count as Ollama writes it ("135.27M", "8B")."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + unit
    return str(n)


def quantization(model: CausalLM) -> str:
    q = model.config.quantization
    if q:
        return f"Q{q.get('bits', '?')}" + (f"_g{q['group_size']}" if q.get("group_size") else "")
    dtype = str(model.model.embed_tokens.weight.dtype).rpartition(".")[2]
    return {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(dtype, dtype.upper())


def details(model: CausalLM) -> dict[str, Any]:
    family = model.config.model_type
    return {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
            "parameter_size": human(parameter_count(model)), "quantization_level": quantization(model)}


def model_info(model: CausalLM, tokenizer: Tokenizer) -> dict[str, Any]:
    """The architecture's numbers under Ollama's (GGUF's) keys."""
    c = model.config
    arch = c.model_type
    info: dict[str, Any] = {
        "general.architecture": arch, "general.parameter_count": parameter_count(model),
        f"{arch}.context_length": c.max_position_embeddings, f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers, f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads, f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.key_length": c.head_dim, f"{arch}.attention.value_length": c.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps, f"{arch}.rope.freq_base": c.rope.theta,
        f"{arch}.vocab_size": c.vocab_size}
    if c.sliding_window:
        info[f"{arch}.attention.sliding_window"] = c.sliding_window
    if tokenizer.eos_token_ids:
        info["tokenizer.ggml.eos_token_id"] = min(tokenizer.eos_token_ids)
    return info


def capabilities(model: CausalLM, tokenizer: Tokenizer) -> list[str]:
    """What the model can be asked for here, in Ollama's words."""
    found = ["completion"]
    if "tools" in tokenizer.template_variables:
        found.append("tools")
    if model.image_token_id is not None:
        found.append("vision")
    if tags_for(tokenizer) is not None:
        found.append("thinking")
    if model.sentence_embedding.refusal is None:
        found.append("embedding")
    return found


def parameters(served: Served) -> str:
    """The defaults a request gets, as a Modelfile's PARAMETER lines."""
    return f"num_ctx                        {served.max_tokens}"


def loaded_reply(name: str, chat: bool, unload: bool) -> dict[str, Any]:
    """The answer to a request that only loads (or unloads) the model."""
    body: dict[str, Any] = {"model": name, "created_at": now()}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return {**body, "done": True, "done_reason": "unload" if unload else "load"}


def tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in Ollama's shape: arguments as an object, each with its index."""
    return [{**({"id": c.id} if c.id else {}), "function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


@dataclass(kw_only=True)
class Reply:
    """One request's reply: the NDJSON lines, or the whole object; the times it measures."""

    model: str
    chat: bool
    arrived: int  # perf_counter_ns at the request's arrival
    loaded: int  # ... once its model was there
    opener: str | None = None  # with tools: the text a call starts with
    top: int | None = None  # logprobs: alternatives per token (None: no logprobs)
    tokenizer: Tokenizer | None = None  # with logprobs: what names the tokens
    first: int | None = field(default=None, init=False)  # ... at its first chunk
    last: int | None = field(default=None, init=False)  # ... at its last

    async def timed(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """The chunks, their arrival times noted."""
        try:
            async for chunk in chunks:
                self.last = time.perf_counter_ns()
                self.first = self.first or self.last
                yield chunk
        finally:
            await chunks.aclose()

    def _logprobs(self, chunks: list[Chunk]) -> list[dict[str, Any]]:
        """The tokens' logprobs in Ollama's shape, with `top` alternatives each."""
        decode = self.tokenizer.decode

        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"token": decode([token]), "logprob": logprob}

        return [{**entry(c.token, c.logprob),
                 **({"top_logprobs": [entry(t, lp) for t, lp in c.top_logprobs[: self.top]]} if self.top else {})}
                for c in chunks if c.token is not None and c.logprob is not None]

    def _object(self, text: str, thinking: str, calls: list[ToolCall] | None, done: bool,
                chunks: list[Chunk] = ()) -> dict[str, Any]:
        """One reply object (a line, or the whole) from its text, thinking, calls, and the chunks
        whose logprobs it carries."""
        out: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = tool_calls(calls)
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if self.top is not None and chunks:
            out["logprobs"] = self._logprobs(chunks)
        out["done"] = done
        return out

    def _final(self, out: dict[str, Any], last: Chunk) -> dict[str, Any]:
        """`out` as the last object: why the reply ended, and its numbers."""
        stats, ended = last.stats, time.perf_counter_ns()
        first, final = self.first or ended, self.last or ended
        return {**out, "done": True, "done_reason": "length" if last.finish_reason == "length" else "stop",
                "total_duration": ended - self.arrived, "load_duration": self.loaded - self.arrived,
                "prompt_eval_count": stats.prompt_tokens, "prompt_eval_duration": round(stats.ttft * 1e9),
                "eval_count": stats.generated_tokens, "eval_duration": final - first}

    def whole(self, chunks: list[Chunk]) -> dict[str, Any]:
        last = chunks[-1]
        text = last.content if last.tool_calls else "".join(c.text for c in chunks)
        return self._final(self._object(text or "", "".join(c.reasoning for c in chunks), last.tool_calls, True,
                                        chunks), last)

    async def lines(self, first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        """The NDJSON stream: a line per chunk that adds something, then the final one. With tools,
        answer text that may be the start of a call is held until that is known: a call goes out
        as `tool_calls`, anything else as text; thinking is never held. A failure mid-stream is
        an `{"error"}` line, which Ollama's clients raise."""
        held: list[Chunk] = []
        unsent: list[Chunk] = []  # chunks whose logprobs have not gone out yet
        sent = False  # answer text went out: it is not a call
        last: Chunk | None = None
        try:
            async for chunk in _chained(first, rest):
                last = chunk
                unsent.append(chunk)
                pending = [*held, chunk]
                text = "".join(c.text for c in pending)
                if not sent and may_open_call(text, self.opener) and not chunk.finish_reason \
                        and (not chunk.reasoning or text):
                    held = pending
                    continue
                held = []
                calls = chunk.tool_calls
                if calls and not sent:
                    text = chunk.content or ""
                sent = sent or bool(text)
                thinking = "".join(c.reasoning for c in pending)
                if text or thinking or calls:
                    yield _line(self._object(text, thinking, calls, False, unsent))
                    unsent = []
            if last is not None:
                yield _line(self._final(self._object("", "", None, True, unsent), last))
        except RequestError as e:
            yield _line({"error": str(e)})


async def held(lines: AsyncIterator[bytes], hold: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """`lines`, the model they come from held (`hold`) until the last has gone or the client left."""
    try:
        async for line in lines:
            yield line
    finally:
        await hold.aclose()


async def _chained(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


def _line(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()
