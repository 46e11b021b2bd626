"""OpenAI's chat and text completions (`/v1/chat/completions`, `/v1/completions`) and
models list (in Anthropic's shape to Anthropic's clients, which share its path), translated to
the typed `Request` and back; the wire shapes live in `openai_schema`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..decode.sources import Stats
from ..engine.text_stream import Chunk
from ..models.lora import adapters_of
from ..text.tools import call_opener, may_open_call
from .anthropic import asks_anthropic, model_info, models_page
from .api import Api, Context, Route
from .bodies import parsed
from .errors import RequestError
from .models import Served
from .replies import merged, respond_each, sse
from .openai_schema import ChatCompletion, Completion, Logprobs, TextCompletion, choice, parse, timings, usage


class OpenAIApi(Api):
    """OpenAI's chat and text completions and its models list, under /v1."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.ids = itertools.count()  # of the completions, for their ids

    def routes(self) -> tuple[Route, ...]:
        return (Route("/models", self.models, ("GET",)), Route("/models/{name:path}", self.model, ("GET",)),
                Route("/chat/completions", self.chat_completions), Route("/completions", self.completions))

    def served(self) -> list[tuple[str, bool, float]]:
        """(name, loaded, created) of every model and each adapter loaded on one (as
        `NAME:ADAPTER`); created: the model's files' time."""
        out = []
        for entry in self.ctx.models.listing():
            found = adapters_of(entry.served.model) if entry.served is not None else None
            out += [(entry.name, entry.served is not None, entry.modified_at),
                    *((f"{entry.name}:{n}", True, entry.modified_at) for n in sorted(found.slots if found else ()))]
        return out

    async def models(self, request: Request) -> dict[str, Any]:
        """The models list: Anthropic's shape to an Anthropic client, OpenAI's to every other."""
        if asks_anthropic(request.headers):
            return models_page([(n, created, up) for n, up, created in self.served()], request.query_params)
        return {"object": "list", "data": [model_object(n, up) for n, up, _ in self.served()]}

    async def model(self, name: str, request: Request) -> dict[str, Any]:
        served = {n: (up, created) for n, up, created in self.served()}
        if name not in served:
            raise RequestError(f"the model '{name[:200]}' does not exist; this server serves "
                               f"{', '.join(served)[:1000]}", "model", status=404, kind="not_found_error")
        up, created = served[name]
        return model_info(name, created, up) if asks_anthropic(request.headers) else model_object(name, up)

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, ChatCompletion)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, TextCompletion)

    async def complete(self, request: Request, kind: type[Completion]) -> Response:
        """A chat or text completion, on the model the body names (held until its reply ends)."""
        body = await parsed(request, self.ctx.config.max_body, parse, kind)
        return await self.ctx.models.held_for(body.model, lambda served: self.answer(request, body, kind, served))

    async def answer(self, request: Request, body: Completion, kind: type[Completion], served: Served) -> Response:
        """Each prompt its own request of n sequences (its choices), all decoded together, as one group."""
        tokenizer, engine = served.tokenizer, served.engine
        options = served.options(body.request_options(), body.model)
        chat = kind is ChatCompletion
        n = body.n or 1
        typed = [await engine.request(p, options) for p in body.engine_prompts(max(engine.places // n, 1))]
        o = typed[0].options
        calls = chat and o.tools and o.tool_choice != "none"
        rows, as_ids = body.logprob_rows(), bool(body.return_tokens_as_token_ids)
        served_as = body.model if options.adapter else served.name
        logprobs = [Logprobs(tokenizer, chat, rows, as_ids) for _ in range(len(typed) * n)] if rows else None
        reply = Reply(rid=f"{'chatcmpl' if chat else 'cmpl'}-{next(self.ids)}", chat=chat, model=served_as, n=n,
                      logprobs=logprobs,
                      opener=call_opener(tokenizer) if calls else None, legacy=chat and body.legacy,
                      predicted=o.prediction is not None, details=bool(body.return_token_details))
        group = engine.new_group()
        streams = [engine.chunks(t, group) for t in typed]
        return await respond_each(request, streams, bool(body.stream), reply.whole,
                                  lambda firsts, rest: reply.events(firsts, rest, body.include_usage))


def model_object(name: str, loaded: bool) -> dict[str, Any]:
    """OpenAI's model object, and whether the model is loaded now (`loaded`, ours: the next
    request to a model that is not waits for its load)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "mlxinfer", "loaded": loaded}


@dataclass(kw_only=True)
class Reply:
    """One request's response, `n` choices per prompt (choice j of prompt i is choice i*n + j,
    as OpenAI numbers them): the whole object, or its Server-Sent Events."""

    rid: str
    chat: bool
    model: str
    logprobs: list[Logprobs] | None = None  # one per choice, when the request asks for them
    opener: str | None = None  # with tools: the text a call starts with
    legacy: bool = False  # called with the legacy `functions`: a call goes out as `function_call`
    n: int = 1
    predicted: bool = False  # the request sent a prediction: usage reports its accepted and rejected tokens
    details: bool = False  # return_token_details: each choice carries its tokens' ids and drafted flags

    def _object(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind = f"{kind}.chunk" if chunk and self.chat else kind
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model,
                "choices": choices, **extra}

    def _choice(self, index: int, chunks: list[Chunk], delta: bool, first: bool = False,
                streamed: bool = False) -> dict[str, Any]:
        """Choice `index` from its `chunks` (all of them, or a delta's: what was held back and
        the newest; `streamed`: the text before them already went out, so a call's content,
        which is the whole reply's text, is not theirs to send)."""
        last = chunks[-1]
        text = last.content if last.tool_calls and not streamed else "".join(c.text for c in chunks)
        lp = self.logprobs[index].of(chunks) if self.logprobs else None
        details = [{"id": c.token, "drafted": c.drafted} for c in chunks if c.token is not None] \
            if self.details else None
        return choice(self.chat, text=text, reason=last.finish_reason, logprobs=lp, delta=delta, first=first,
                      calls=last.tool_calls, legacy=self.legacy, index=index,
                      reasoning="".join(c.reasoning for c in chunks), details=details)

    def _accounting(self, lasts: dict[int, Chunk]) -> dict[str, Any]:
        """Usage from each choice's last chunk (by choice index), its prompt counted once; a
        single sequence's timings beside it (llama.cpp's `timings`: what a chat page shows)."""
        per_prompt: dict[int, list[Stats]] = {}
        for index in sorted(lasts):
            per_prompt.setdefault(index // self.n, []).append(lasts[index].stats)
        one = {"timings": timings(lasts[0].stats)} if list(lasts) == [0] else {}
        return {"usage": usage(list(per_prompt.values()), self.predicted), **one}

    def whole(self, streams: list[list[Chunk]]) -> dict[str, Any]:
        """The response from every chunk of each prompt's stream (its choices' chunks interleaved)."""
        choices: dict[int, list[Chunk]] = {}
        for i, chunks in enumerate(streams):
            for c in chunks:
                choices.setdefault(i * self.n + c.index, []).append(c)
        return self._object([self._choice(k, choices[k], delta=False) for k in sorted(choices)], chunk=False,
                            **self._accounting({k: cs[-1] for k, cs in choices.items()}))

    async def events(self, firsts: list[Chunk | None], streams: list[AsyncIterator[Chunk]],
                     include_usage: bool) -> AsyncIterator[bytes]:
        """The stream, each event one choice's chunk (its `index` says whose); with tools,
        answer text that may be the start of a call is held back until it is known: a call
        goes out as one `tool_calls` delta, anything else as text. Thinking before the answer
        is never held."""
        last: dict[int, Chunk] = {}
        held: dict[int, list[Chunk]] = {}
        sent: set[int] = set()  # choices whose answer is known not to be held
        started: set[int] = set()  # choices whose first delta (with the role) went out
        chunks = merged(firsts, streams)
        try:
            async for stream, chunk in chunks:
                i = stream * self.n + chunk.index
                last[i] = chunk
                pending, streamed = [*held.pop(i, ()), chunk], i in sent
                text = "".join(c.text for c in pending)
                if i not in sent and may_open_call(text, self.opener) and not chunk.finish_reason:
                    if not chunk.reasoning or any(c.text for c in pending):
                        held[i] = pending
                        continue
                else:
                    sent.add(i)
                delta = self._choice(i, pending, delta=True, first=i not in started, streamed=streamed)
                yield sse(self._object([delta], chunk=True))
                started.add(i)
            if include_usage and last:
                yield sse(self._object([], chunk=True, **self._accounting(last)))
        except RequestError as e:
            yield sse(e.body())
        finally:
            await chunks.aclose()
        yield sse("[DONE]")
