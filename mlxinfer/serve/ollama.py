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
import functools
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from ..base.errors import MlxinferError, ModelExistsError, ModelNotFoundError
from ..convert.pull import PullProgress, pull
from ..engine.text_stream import Chunk
from ..loading import store
from ..loading.checkpoint import read_config
from ..loading.store import LocalModel
from ..models import model_config
from ..models.config import ModelConfig
from ..text.reasoning import tags_for
from ..text.tokenizer import Tokenizer, load_tokenizer_from_dir
from ..text.tools import ToolCall, call_opener, may_open_call
from .api import Api, Route
from .bodies import parsed
from .embeddings import embedded
from .errors import RequestError
from .models import ModelEntry, Served
from .ollama_schema import Chat, Copy, Embed, Embeddings, Generate, Named, Pull, Show, parse
from .replies import ClientGone, json_reply, respond

NDJSON = "application/x-ndjson"
FOREVER = "9999-12-31T23:59:59Z"  # the expiry of a model kept loaded for good


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

    def entry(self, name: str) -> ModelEntry:
        """The servable model `name` names, its `:latest` tag optional (Ollama's names carry one),
        or `NAME:ADAPTER` for an adapter on model NAME. Unlike OpenAI's clients, Ollama's name a
        model they listed, so any other name is a 404, as Ollama answers it, even when the server
        has one model."""
        entries = {e.name: e for e in self.ctx.models.listing()}
        base = name.removesuffix(":latest")
        found = entries.get(base) or entries.get(base.partition(":")[0])
        if found is None:
            raise RequestError(f'model "{name[:200]}" not found; this server serves '
                               f'{", ".join(entries)[:1000] or "none"} (GET /api/tags lists them; `mlxinfer pull` '
                               "adds one)", "model", status=404)
        return found

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, Chat)

    async def generate(self, request: Request) -> Response:
        return await self.complete(request, Generate)

    async def complete(self, request: Request, kind: type[Chat] | type[Generate]) -> Response:
        """A chat or generation: its chunks as NDJSON lines, or one object, the model held until
        the last; no messages (or no prompt) only loads the model, or with keep_alive 0 unloads it."""
        arrived = time.perf_counter_ns()
        body = await parsed(request, self.ctx.config.max_body, parse, kind)
        keep_alive = body.keep_alive_seconds
        name = body.model.removesuffix(":latest")
        entry = self.entry(name)
        if body.loads_only:
            return JSONResponse(await self.load(entry, kind is Chat, keep_alive))
        return await self.ctx.models.held_for(
            entry.name, lambda served: self.answer(request, body, name, served, arrived), keep_alive)

    async def load(self, entry: ModelEntry, chat: bool, keep_alive: float | None) -> dict[str, Any]:
        """Load the model, or with keep_alive 0 unload it, as Ollama's clients ask with an empty request."""
        if keep_alive == 0:
            await self.ctx.models.unload(entry.name)
        else:
            async with self.ctx.models.use(entry.name, keep_alive):
                pass
        body: dict[str, Any] = {"model": entry.name, "created_at": now()}
        body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return {**body, "done": True, "done_reason": "unload" if keep_alive == 0 else "load"}

    async def answer(self, request: Request, body: Chat | Generate, name: str, served: Served,
                     arrived: int) -> Response:
        """The reply to `body` from the model it names, loaded (`name` may name an adapter on it)."""
        loaded = time.perf_counter_ns()
        if body.think and tags_for(served.tokenizer) is None:
            raise RequestError(f'"{served.name}" does not support thinking: its chat template has no thinking '
                               "part; leave think out", "think")
        options = served.options(body.request_options(served.max_tokens), name)
        prompt = body.prompt() if isinstance(body, Chat) else body.engine_prompt()
        typed = await served.engine.request(prompt, options)
        o = typed.options
        chat = isinstance(body, Chat)
        calls = chat and o.tools and o.tool_choice != "none"
        reply = Reply(model=name if options.adapter else served.name, chat=chat, arrived=arrived, loaded=loaded,
                      opener=call_opener(served.tokenizer) if calls else None, top=body.top,
                      tokenizer=served.tokenizer)
        return await respond(request, reply.timed(served.engine.chunks(typed)), body.streamed, reply.whole,
                             reply.lines, NDJSON)

    async def embed(self, request: Request) -> Response:
        arrived = time.perf_counter_ns()
        body = await parsed(request, self.ctx.config.max_body, parse, Embed)
        async with self.ctx.models.use(self.entry(body.model).name, body.keep_alive_seconds) as served:
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
        async with self.ctx.models.use(self.entry(body.model).name, body.keep_alive_seconds) as served:
            try:
                vectors, _ = await embedded(request, served.engine, served.model, served.tokenizer, [body.prompt],
                                            None)
            except ClientGone:
                return Response(status_code=499)
        return await json_reply(lambda: {"embedding": vectors[0].tolist()})

    async def tags(self) -> dict[str, Any]:
        """Every servable model, loaded or not."""
        return {"models": [{**listed(e), "modified_at": rfc3339(e.modified_at)} for e in self.ctx.models.listing()]}

    async def ps(self) -> dict[str, Any]:
        """The loaded models: the memory each is counted at, when it unloads if unused, its context."""
        return {"models": [{**listed(e), "size": e.served.memory, "size_vram": e.served.memory,
                            "expires_at": rfc3339(e.served.expires_at) if e.served.expires_at is not None
                            else FOREVER, "context_length": e.served.max_tokens}
                           for e in self.ctx.models.listing() if e.served is not None]}

    async def show(self, request: Request) -> dict[str, Any]:
        """What a model is, read from its files (it is not loaded for this)."""
        body = await parsed(request, self.ctx.config.max_body, parse, Show)
        entry = self.entry(body.target)
        try:
            config, tokenizer = await asyncio.to_thread(read_model, Path(entry.path))
        except (MlxinferError, OSError) as e:
            raise RequestError(f"cannot read the model '{entry.name}': {e}", "model", status=500) from None
        return {"details": details(entry), "model_info": model_info(config, entry.parameters),
                "template": tokenizer.chat_template or "", "parameters": f"num_ctx {config.max_position_embeddings}",
                "capabilities": capabilities(config, tokenizer, Path(entry.path)),
                "modified_at": rfc3339(entry.modified_at), "license": ""}

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def pull(self, request: Request) -> Response:
        """Pull a model into mlxinfer's cache (`convert.pull.pull`: a hub id, a model folder, a GGUF
        file or URL, converted on the way) on a worker thread; its steps as NDJSON status lines,
        or `{"status": "success"}` alone with stream false. A source refused before any step is a
        4xx; a failure later, an `{"error"}` line. A client that leaves does not stop the pull: it
        runs to its end (a half-made model is never listed), as Ollama's does. The server serves
        the model once it is in."""
        body = await parsed(request, self.ctx.config.max_body, parse, Pull)
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[PullProgress] = asyncio.Queue()
        work = asyncio.ensure_future(self.stored(functools.partial(
            pulled, progress=lambda step: loop.call_soon_threadsafe(steps.put_nowait, step)), body.target))
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
        """Delete a model from mlxinfer's cache (only there: `store.remove`); a loaded one is
        unloaded once its requests end."""
        body = await parsed(request, self.ctx.config.max_body, parse, Named)
        await self.stored(store.remove, body.target)
        if any(e.name == body.target for e in self.ctx.models.listing()):  # still loaded: let it go
            await self.ctx.models.unload(body.target)
        return Response(status_code=200)

    async def copy(self, request: Request) -> Response:
        """Copy a model into mlxinfer's cache under a new name (`store.copy`)."""
        body = await parsed(request, self.ctx.config.max_body, parse, Copy)
        await self.stored(store.copy, body.source, body.destination)
        return Response(status_code=200)

    async def stored(self, change: Callable[..., LocalModel], *names: str) -> LocalModel:
        """A change to the model store, made on a worker thread (it moves and writes files), then
        the models rescanned; a model it does not find is a 404, as Ollama answers, any other
        refusal a 400."""
        try:
            return await asyncio.to_thread(change, *names)
        except ModelNotFoundError as e:
            raise RequestError(str(e), "model", status=404) from None
        except MlxinferError as e:
            raise RequestError.of(e, "model") from None
        finally:
            self.ctx.models.refresh()


def pulled(source: str, progress: Callable[[PullProgress], None]) -> LocalModel:
    """`source` pulled into the cache; one pulled before is there already, which is success, as
    Ollama's pull of a model it has."""
    try:
        return pull(source, progress=progress)
    except ModelExistsError as e:
        progress(PullProgress("success"))
        return store.find(e.name)


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


def rfc3339(when: float) -> str:
    """Epoch seconds as Ollama writes times (RFC 3339, UTC)."""
    return datetime.fromtimestamp(when, timezone.utc).isoformat().replace("+00:00", "Z")


def now() -> str:
    return rfc3339(time.time())


def digest(entry: ModelEntry) -> str:
    """An identifier for a model, in the shape of Ollama's digests (64 hex digits)."""
    return hashlib.sha256(f"{entry.name}\0{entry.path}".encode()).hexdigest()


def human(n: int) -> str:
    """A parameter count as Ollama writes it ("135.27M", "8B")."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + unit
    return str(n)


# Ollama's names for how weights are stored, where one fits ("4-bit g64" and the like stay ours).
LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def details(entry: ModelEntry) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": entry.family, "families": [entry.family],
            "parameter_size": human(entry.parameters),
            "quantization_level": LEVELS.get(entry.quantization, entry.quantization)}


def listed(entry: ModelEntry) -> dict[str, Any]:
    """What /api/tags and /api/ps say of every model."""
    return {"name": entry.name, "model": entry.name, "size": entry.size, "digest": digest(entry),
            "details": details(entry)}


def read_model(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """A model folder's config and tokenizer, without its weights."""
    return model_config(read_config(path)), load_tokenizer_from_dir(path)


def model_info(c: ModelConfig, parameters: int) -> dict[str, Any]:
    """The architecture's numbers under Ollama's (GGUF's) keys."""
    arch = c.model_type
    info: dict[str, Any] = {
        "general.architecture": arch, "general.parameter_count": parameters,
        f"{arch}.context_length": c.max_position_embeddings, f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers, f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads, f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.key_length": c.head_dim, f"{arch}.attention.value_length": c.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps, f"{arch}.rope.freq_base": c.rope.theta,
        f"{arch}.vocab_size": c.vocab_size}
    if c.sliding_window:
        info[f"{arch}.attention.sliding_window"] = c.sliding_window
    if c.moe is not None:
        info[f"{arch}.expert_count"] = c.moe.num_experts
        info[f"{arch}.expert_used_count"] = c.moe.experts_per_token
    return info


# Files a sentence-transformers checkpoint has: a model made to embed (Ollama's "embedding" capability).
SENTENCE_TRANSFORMERS = ("modules.json", "config_sentence_transformers.json")


def capabilities(c: ModelConfig, tokenizer: Tokenizer, path: Path) -> list[str]:
    """What the model can be asked for, in Ollama's words."""
    found = ["completion"]
    if "tools" in tokenizer.template_variables:
        found.append("tools")
    if "vision_config" in c.raw:
        found.append("vision")
    if tags_for(tokenizer) is not None:
        found.append("thinking")
    if any((path / f).is_file() for f in SENTENCE_TRANSFORMERS):
        found.append("embedding")
    return found


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


async def _chained(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


def _line(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()
