"""OpenAI's HTTP shapes for chat and text completions: request bodies in, JSON out.

Request bodies are pydantic models that forbid unknown fields, so a parameter this
server cannot honour is refused by name (a 400) instead of silently changing nothing;
`RequestError` carries the status and OpenAI's error body. The response helpers turn
the engine's `Chunk`s into OpenAI's objects, streamed or whole.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..decode.sources import Stats
from ..engine.text_stream import Chunk
from ..engine.options import RequestOptions
from ..text.reasoning import EFFORTS
from ..text.tools import ToolCall
from .bodies import json_object
from .content import image_part, template_content
from .errors import RequestError, refusal

# Fields of OpenAI's API that change the output and that this server does not implement
# (yet); each is refused by name. A null is the same as leaving the field out (`parse`).
NOT_YET = {"suffix": "suffix", "audio": "audio output",
           "web_search_options": "web search", "moderation": "moderation"}
REFUSED = {name: f"'{name}' ({what}) is not supported by this server" for name, what in NOT_YET.items()}


S = TypeVar("S", bound="Strict")


class Strict(BaseModel):
    """Unknown fields refused, and no coercion: `temperature: true` or `max_tokens: "4"` is
    a 400 naming the field, as OpenAI's own API answers, not a guess at what was meant."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI's padding against size side channels: a no-op on loopback


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a caching hint: every prefix is cached here


class RefusalPart(Strict):
    """An earlier assistant refusal, as a content part: its text stands for the content."""

    type: Literal["refusal"]
    refusal: str


class Prediction(Strict):
    """Predicted Outputs: text the reply is expected to repeat (a file being edited). It is the
    speculative draft, so it changes the speed, never the output."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCall(Strict):
    name: str
    arguments: str


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class LegacyFunction(Strict):
    """An entry of the legacy `functions` list: the `function` of a tool."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionName(Strict):
    name: str


# Content parts OpenAI defines that no model here can read (images go to a vision-language model).
MEDIA_PARTS = ("input_audio", "file")


class ImageURL(Strict):
    url: str  # a data: URL (an http(s) one only where the server allows it: `images.image_bytes`)
    detail: Literal["auto", "low", "high"] | None = None  # the processor's own resolution applies either way


class ImagePart(Strict):
    """An image for a vision-language model (a text-only one refuses it when the request is prepared)."""

    type: Literal["image_url"]
    image_url: ImageURL

    def for_template(self) -> dict[str, Any]:
        return image_part(self.image_url.url)


class Message(Strict):
    """A message as a client sends it back, including what the SDK's own message objects
    carry (`refusal`, `annotations`, and `audio` / `function_call` when null), and the
    legacy `function` role and assistant `function_call` (read as a tool reply and call)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | RefusalPart | ImagePart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a participant's name, or a tool / function message's function
    refusal: str | None = None  # an assistant's earlier refusal: its text stands for the content
    annotations: list[dict[str, Any]] | None = None  # citations on an earlier reply: nothing to render
    audio: dict[str, Any] | None = None  # an earlier audio reply: refused unless null (`no_audio`)
    function_call: FunctionCall | None = None  # an assistant's earlier legacy call
    id: str | None = None  # an id some clients keep on earlier replies: nothing to render
    reasoning_content: str | None = None  # an assistant's earlier thinking, under either name our replies give it:
    reasoning: str | None = None  # the template decides whether to show it again (Qwen3's drops old turns')

    @field_validator("audio")
    @classmethod
    def no_audio(cls, audio: dict[str, Any] | None) -> None:
        """An audio reply is only an id of OpenAI's: there is no text here to render for it."""
        if audio is not None:
            raise PydanticCustomError("text_only", "this model takes text only: an earlier audio reply cannot be "
                                      "read; send its transcript as the message's content and audio: null", {})
        return None

    @model_validator(mode="after")
    def function_has_name(self) -> Message:
        if self.role == "function" and not self.name:
            raise PydanticCustomError("missing", "a function message needs the name of the function it answers", {})
        return self

    @field_validator("content", mode="before")
    @classmethod
    def text_only(cls, content: Any) -> Any:
        """An audio or file part is refused by name, not as a shape mismatch."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in MEDIA_PARTS:
                    raise PydanticCustomError("text_only", f"this server takes text and images only: remove the "
                                              f"{kind} part (content.{i}) or send its text", {})
        return content

    @field_validator("content")
    @classmethod
    def images_from_the_user(cls, content: Any, info: ValidationInfo) -> Any:
        """OpenAI takes image parts in user messages only; a template would place one anywhere."""
        role = info.data.get("role")  # absent when the role itself was refused
        if isinstance(content, list) and role not in (None, "user"):
            for i, part in enumerate(content):
                if isinstance(part, ImagePart):
                    raise PydanticCustomError("role_part", f"image parts are taken in user messages only, not in a "
                                              f"{role} message (content.{i})", {})
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it ("developer" is OpenAI's new name for "system")."""
        text: str | list[dict[str, Any]] = self.content if isinstance(self.content, str) else self.refusal or ""
        if isinstance(self.content, list):
            text = template_content([p.for_template() if isinstance(p, ImagePart) else
                                     p.text if isinstance(p, TextPart) else p.refusal for p in self.content])
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            out["reasoning_content"] = thinking
        return out


class Completion(Strict):
    """What chat and text completions share; sampling values are checked by the engine."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    response_format: dict[str, Any] | None = None  # checked by the engine (`constrain.response_format`)
    n: int | None = Field(None, ge=1)
    prediction: Prediction | None = None
    stream: bool | None = False  # null: not streamed
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: logprobs name each token "token_id:N" (a token that is not valid UTF-8 alone stays
    # identifiable); the text of the reply is unchanged
    return_tokens_as_token_ids: bool | None = None
    # ours (off by default, so OpenAI's shape is unchanged): each choice carries `token_details`, one
    # {"id", "drafted"} per token it adds; drafted: the drafter proposed it and the model accepted it
    return_token_details: bool | None = None

    def limit(self) -> int | None:
        return self.max_tokens

    def logprob_rows(self) -> int:
        return 0

    def request_options(self) -> RequestOptions:
        """The engine options this request asks for."""
        return RequestOptions(
            max_tokens=self.limit(), temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=token_keys(self.logit_bias) if self.logit_bias is not None else None, stop=self.stop,
            logprobs=self.logprob_rows() or None, response_format=self.response_format, n=self.n,
            prediction=self.prediction.text() if self.prediction is not None else None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletion(Completion):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None  # checked by the engine (`tools.check_tools`)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[LegacyFunction] | None = Field(None, min_length=1)  # legacy tools, answered in the legacy shape
    function_call: Literal["none", "auto"] | FunctionName | None = None  # the legacy tool_choice
    modalities: list[Literal["text", "audio"]] | None = None  # ["text"] is what every reply is
    verbosity: Literal["low", "medium", "high"] | None = None  # "medium" (the default) is what every reply is
    # OpenAI's bookkeeping, routing and caching hints; no effect on a local model (documented no-ops)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # thinking: reasoning_effort switches it where the template can (`reasoning.effort_kwargs`), and
    # chat_template_kwargs reach the template as given (vLLM's and llama.cpp's extension; they win)
    reasoning_effort: Literal[EFFORTS] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("modalities")
    @classmethod
    def text_out(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities and "audio" in modalities:
            raise PydanticCustomError("text_only", 'this model writes text only: send modalities ["text"] or leave '
                                      "it out", {})
        return modalities

    @field_validator("verbosity")
    @classmethod
    def default_verbosity(cls, verbosity: str | None) -> str | None:
        if verbosity not in (None, "medium"):
            raise PydanticCustomError("verbosity", f"'{verbosity}' cannot be honoured here (a local model has no "
                                      'verbosity control); send "medium" or leave it out', {})
        return verbosity

    @property
    def legacy(self) -> bool:
        """Called with the legacy `functions`: the reply's call goes out as `function_call`."""
        return self.functions is not None

    def request_options(self) -> RequestOptions:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        tools, choice, parallel = self.tools or None, self.tool_choice, self.parallel_tool_calls
        if self.functions is not None:
            if tools:
                raise RequestError("send tools or the legacy functions, not both", "functions")
            # the legacy API makes at most one call a reply
            tools, parallel = [{"type": "function", "function": f.model_dump(exclude_none=True)}
                               for f in self.functions], False
            choice = self.function_call if not isinstance(self.function_call, FunctionName) else \
                {"type": "function", "function": {"name": self.function_call.name}}
        elif self.function_call not in (None, "none"):
            raise RequestError("function_call needs functions", "function_call")
        return replace(super().request_options(), tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                       reasoning_effort=self.reasoning_effort, chat_template_kwargs=self.chat_template_kwargs)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_rows(self) -> int:
        # the chosen token's logprob needs at least one row (and asks for nothing more)
        return max(self.top_logprobs or 0, 1) if self.logprobs else 0

    def engine_prompts(self, most: int) -> list[list[dict[str, Any]]]:
        """A chat completion has one prompt."""
        return [self.engine_prompt()]

    def engine_prompt(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them; a legacy assistant `function_call` and
        the `function` message answering it become the tool call and tool reply they stand
        for, paired by an id made up here (9 letters and digits: Mistral's templates take no other)."""
        out: list[dict[str, Any]] = []
        call_id = None
        for i, m in enumerate(self.messages):
            message = m.for_template()
            if m.function_call is not None:
                call_id = f"fn{i:07d}"
                call = {"id": call_id, "type": "function", "function": m.function_call.model_dump()}
                message["tool_calls"] = [*message.get("tool_calls", []), call]
            if m.role == "function":
                message = {"role": "tool", "content": message["content"], "name": m.name,
                           **({"tool_call_id": call_id} if call_id else {})}
            out.append(message)
        return out


class TextCompletion(Completion):
    """A text completion; `prompt` may hold several prompts (texts or token-id lists), each
    completed as its own choice, as evaluators send them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None  # the prompt comes back before the completion; with logprobs, scored
    best_of: int | None = Field(None, ge=1)  # only as many as n: every completion made is returned

    def logprob_rows(self) -> int:
        return self.logprobs or 0

    def request_options(self) -> RequestOptions:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError(f"best_of must equal n ({self.n or 1}): this server returns every completion it "
                               "makes, it does not pick the best of more", "best_of")
        rows = self.logprob_rows() if self.echo else 0
        # a text completion is raw text (no chat template): a thinking model's tags stay in it, as with OpenAI
        return replace(super().request_options(), split_reasoning=False, echo=self.echo or None,
                       prompt_logprobs=rows or None)

    def engine_prompts(self, most: int) -> list[str | list[int]]:
        """Each prompt of the request (at most `most`), as text or token ids."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
        if len(prompts) > most:
            raise RequestError(f"prompt holds {len(prompts)} prompts; this server takes at most {most} in one request "
                               "(its --max-concurrency plus --max-queue): send the rest in another request", "prompt")
        for i, one in enumerate(prompts):
            if not one:
                raise RequestError("the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty", "prompt")
        return prompts


def token_keys(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias's keys (JSON strings) as token ids."""
    for key in bias:
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got {key[:40]!r}",
                               "logit_bias")
    return {int(k): v for k, v in bias.items()}


def parse(raw: bytes, kind: type[S]) -> S:
    """A request body as `kind`, or a RequestError naming the first field at fault."""
    data = {k: v for k, v in json_object(raw).items() if not (v is None and k in NOT_YET)}  # null: "not set"
    return validated(data, kind)


def validated(data: dict[str, Any], kind: type[S]) -> S:
    """`data` as `kind`, or a RequestError naming the first field at fault."""
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise refusal(e.errors(), refused=REFUSED) from None


def finish(reason: str | None) -> str | None:
    """OpenAI's finish reason: a disconnected client's "cancelled" is never seen by anyone."""
    return "stop" if reason == "cancelled" else reason


def usage(per_prompt: list[list[Stats]], predicted: bool = False) -> dict[str, Any]:
    """The usage of a response from its choices' last stats, by prompt: each prompt counted
    once (its n choices share it; the one that prefilled it ran the most of it), every
    choice's tokens; with a prediction, its drafted tokens the model accepted and rejected
    (a rejected one costs a verification, not a token of the reply)."""
    every = [s for choices in per_prompt for s in choices]
    prompt, generated = sum(c[0].prompt_tokens for c in per_prompt), sum(s.generated_tokens for s in every)
    cached = sum(max(c[0].prompt_tokens - max(s.prefill_tokens for s in c), 0) for c in per_prompt)
    accepted = sum(s.accepted for s in every) if predicted else 0
    rejected = sum(s.drafted - s.accepted for s in every) if predicted else 0
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def timings(stats: Stats) -> dict[str, Any]:
    """One sequence's timings in llama.cpp's server shape (`timings`, which its web UI and
    others read): prompt tokens taken from the prompt cache and computed, time to the first
    token, decoding speed after it, and speculative drafts accepted; and ours, `prompt_chunks`:
    each prefill chunk's tokens, start (from the request's arrival at the engine) and time, so
    a client can draw the prefill as it ran."""
    decoded = max(stats.generated_tokens - 1, 0)  # the first token came out of the prefill
    decode_ms = decoded / stats.decode_tps * 1000 if stats.decode_tps else 0.0
    chunks = [{"n": n, "start_ms": start * 1000, "ms": seconds * 1000} for n, start, seconds in stats.prefill_chunks]
    return {"cache_n": stats.prompt_tokens - stats.prefill_tokens, "prompt_n": stats.prefill_tokens,
            "prompt_ms": stats.ttft * 1000, "prompt_per_second": stats.prefill_tps,
            "predicted_n": stats.generated_tokens, "predicted_ms": decode_ms,
            "predicted_per_second": stats.decode_tps, "draft_n": stats.drafted, "draft_n_accepted": stats.accepted,
            "prompt_chunks": chunks}


class Logprobs:
    """One choice's logprobs in the shape of its endpoint: chat's `content` list, or the
    legacy completions' parallel lists (an echoed prompt's tokens first: the first has no
    logprob, as it follows nothing; `text_offset` counts characters of the choice's text)."""

    def __init__(self, tokenizer, chat: bool, top: int, as_ids: bool = False):
        self.tokenizer, self.chat, self.top, self.as_ids = tokenizer, chat, top, as_ids
        self.offset = 0

    def of(self, chunks: list[Chunk]) -> dict[str, Any]:
        tokens = [c for c in chunks if c.token is not None and c.top_logprobs is not None]
        text = (lambda ids: f"token_id:{ids[0]}") if self.as_ids else self.tokenizer.decode
        if self.chat:
            return {"content": [{"token": text([c.token]), "logprob": c.logprob, "bytes": None,
                                 "top_logprobs": [{"token": text([t]), "logprob": lp, "bytes": None}
                                                  for t, lp in c.top_logprobs[: self.top]]} for c in tokens]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

        def add(token: int, logprob: float | None, top: list[tuple[int, float]] | None, piece: str) -> None:
            out["tokens"].append(text([token]))
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None else {text([t]): lp for t, lp in top})
            out["text_offset"].append(self.offset)
            self.offset += len(piece)

        for c in chunks:
            for p in c.prompt or ():
                add(p.id, p.logprob, p.top_logprobs, p.text)
            if c.token is not None and c.top_logprobs is not None:
                add(c.token, c.logprob, c.top_logprobs, c.text)
        return out


def choice(chat: bool, *, text: str | None, reason: str | None, logprobs: dict[str, Any] | None, delta: bool,
           first: bool = False, calls: list[ToolCall] | None = None, legacy: bool = False, index: int = 0,
           reasoning: str = "", details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Choice `index` of a response (`delta`: of a streamed chunk); `calls`: the tool calls it
    made, written as the legacy `function_call` (one call at most) when `legacy`; `reasoning`:
    a thinking model's thoughts, under both names peers use (vLLM and llama.cpp's
    `reasoning_content`, the newer `reasoning`); `details`: its tokens' `token_details`
    (`return_token_details`), or None to leave the key out."""
    out: dict[str, Any] = {"index": index}
    thinking = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
    if not chat:
        out["text"] = text
    elif delta:
        content = {"content": text} if text or not reasoning else {}  # a delta of thinking alone has no content
        out["delta"] = {"role": "assistant", **content, **thinking} if first else {**content, **thinking}
    else:
        out["message"] = {"role": "assistant", "content": text, **thinking}
    if chat and calls:
        if legacy:
            out["delta" if delta else "message"]["function_call"] = calls[0].openai()["function"]
            reason = "function_call"
        elif delta:
            out["delta"]["tool_calls"] = [{"index": i, **c.openai()} for i, c in enumerate(calls)]
        else:
            out["message"]["tool_calls"] = [c.openai() for c in calls]
    out["logprobs"] = logprobs
    out["finish_reason"] = finish(reason)
    if details is not None:
        out["token_details"] = details
    return out
