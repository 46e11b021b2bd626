"""OpenAI's embeddings (`POST /v1/embeddings`): `input` as a string, a list of strings,
token ids or a list of token-id lists; `dimensions`; `encoding_format` float or base64
(little-endian float32, as the openai client decodes it, and asks for by default).

Texts are tokenized and checked off the event loop; the model runs on the engine thread one
forward pass of at most a prefill chunk at a time (`EngineThread.run_slices`), so the streams
being decoded keep stepping between them.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from ..base.checks import is_integer
from ..engine.embed import check_dimensions, embed_slices, encode_texts
from ..base.errors import MlxinferError
from ..models.layers import CausalLM
from ..text.tokenizer import Tokenizer
from .api import Api, Route
from .engine_thread import EngineThread
from .bodies import parsed
from .errors import RequestError
from .models import Served
from .replies import ClientGone, hung_up, json_reply, unless_gone
from .openai_schema import Strict, parse

MAX_INPUTS = 2048  # texts per request, as OpenAI allows
SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


class Embeddings(Strict):
    """OpenAI's request body; `user` is accepted and has no effect here."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def one_shape(cls, value: Any) -> Any:
        """A body of none of the four shapes is refused in one sentence, not one per shape."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and (all(isinstance(v, str) for v in value) or all(is_integer(v) for v in value)
                                        or all(isinstance(v, list) and all(is_integer(i) for i in v) for v in value)):
            return value
        raise PydanticCustomError("input_shape", f"input must be {SHAPES}", {})

    def texts(self) -> str | list:
        """The input as `encode_texts` takes it, at most MAX_INPUTS texts."""
        several = isinstance(self.input, list) and self.input and not is_integer(self.input[0])
        if several and len(self.input) > MAX_INPUTS:
            raise RequestError(f"input has {len(self.input)} texts; at most {MAX_INPUTS} go in one request", "input")
        return self.input


class EmbeddingsApi(Api):
    """OpenAI's embeddings, under /v1."""

    def routes(self) -> tuple[Route, ...]:
        return (Route("/embeddings", self.embeddings),)

    async def embeddings(self, request: Request) -> Response:
        body = await parsed(request, self.ctx.config.max_body, parse, Embeddings)
        async with self.ctx.models.use(body.model) as served:
            return await self.embedded(request, body, served)

    async def embedded(self, request: Request, body: Embeddings, served: Served) -> Response:
        model, tokenizer, engine = served.model, served.tokenizer, served.engine
        try:
            result, tokens = await embedded(request, engine, model, tokenizer, body.texts(), body.dimensions)
        except ClientGone:
            return Response(status_code=499)
        return await json_reply(lambda: {
            "object": "list", "data": [item(i, v, body.encoding_format) for i, v in enumerate(result)],
            "model": served.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def embedded(request: Request, engine: EngineThread, model: CausalLM, tokenizer: Tokenizer,
                   texts: str | list, dimensions: int | None) -> tuple[list[np.ndarray], int]:
    """Each text's vector (cut to `dimensions`) and the tokens read, for every API that embeds:
    texts tokenized and checked off the event loop, the model run on the engine thread a slice
    at a time; ClientGone (the work cancelled) when the client hangs up first."""
    try:
        check_dimensions(model, dimensions)
    except MlxinferError as e:
        raise RequestError.of(e, "dimensions") from None
    try:
        ids = await asyncio.to_thread(encode_texts, model, tokenizer, texts, "input")
    except MlxinferError as e:
        raise RequestError.of(e, "input") from None
    gone = asyncio.ensure_future(hung_up(request))
    try:
        result = await unless_gone(engine.run_slices(embed_slices(model, ids, dimensions=dimensions,
                                                                  chunk=engine.prefill_step)), gone)
    finally:
        gone.cancel()
    return list(result), sum(map(len, ids))


def item(index: int, vector: np.ndarray, encoding: str) -> dict[str, Any]:
    """One embedding object: the numbers, or their little-endian float32 bytes in base64."""
    data = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()
    return {"object": "embedding", "index": index, "embedding": data}
