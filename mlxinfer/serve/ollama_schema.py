"""Ollama's native API request bodies (`/api/chat`, `/api/generate`, `/api/embed`, ...), read
strictly and turned into the engine's prompt and `RequestOptions`.

Field names and types are those of Ollama's docs/api.md and its Go types (api/types.go), which
its clients send: the official `ollama` Python client sends `prompt`, `suffix`, `system` and
`template` as "" when not given, so an empty string means "not set". A field or option Ollama
defines that cannot change the output here (load-time tuning: num_gpu, num_thread, use_mmap...)
is accepted and does nothing; one that would change it and cannot be honoured (a `suffix` for
fill-in-the-middle, a `template` override, `context` tokens, mirostat sampling...) is refused by
name, as is a field Ollama does not define.
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.options import RequestOptions
from .bodies import json_object
from .content import image_part, template_content
from .errors import RequestError, refusal
from .openai_schema import Strict  # unknown fields refused, no coercion: `temperature: "hot"` is a 400

# Thinking levels Ollama's `think` takes besides true / false (each turns thinking on here).
THINK_LEVELS = ("low", "medium", "high", "max")


# Options whose neutral value changes nothing, and which cannot be honoured at any other value.
NEUTRAL = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "penalize_newline": True}


class Options(Strict):
    """The Modelfile parameters a request may set (`options`), in Ollama's names. Those after
    `penalize_newline` tune how the model is loaded or run, never what it writes: accepted, no
    effect here (num_keep only matters when a prompt is cut, and none is)."""

    seed: int | None = None
    num_predict: int | None = Field(None, ge=-2)  # -1: until the context is full; -2: fill the context
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = None
    min_p: float | None = None
    temperature: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = Field(None, ge=-1)  # -1: the whole context; 0: no penalty
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None
    num_ctx: int | None = Field(None, ge=1)  # the model's own context is used: a prompt beyond it is refused
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    draft_num_predict: int | None = None

    @model_validator(mode="after")
    def honourable(self) -> Options:
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise PydanticCustomError("not_honoured", f"options.{name} = {value!r} cannot be honoured here (this "
                                          f"server has no such sampler); leave it out or send {neutral!r}", {})
        return self  # mirostat_tau and _eta tune a sampler that is off: they change nothing

    def request_options(self, context: int) -> RequestOptions:
        """The engine options these stand for; `context` is the model's (repeat_last_n -1)."""
        limit = self.num_predict if self.num_predict is None or self.num_predict >= 0 else None
        window = context if self.repeat_last_n == -1 else self.repeat_last_n
        penalties = dict(repetition_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                         frequency_penalty=self.frequency_penalty, penalty_window=window)
        if window == 0:  # a window of no tokens: no penalty (as Ollama reads repeat_last_n 0)
            penalties = {}
        return RequestOptions(max_tokens=limit, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k or None, min_p=self.min_p, seed=self.seed, stop=self.stop or None,
                              **penalties)


def seconds(keep_alive: float | str | None) -> float | None:
    """`keep_alive` as seconds (None: the server's default; negative: forever): a number is
    seconds, a string a Go duration ("5m", "1h30m", "300ms", "-1") or a number of seconds."""
    if keep_alive is None or isinstance(keep_alive, (int, float)):
        return keep_alive
    text = keep_alive.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.fullmatch(r"(-?)((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)", text)
    if not parts:
        raise RequestError(f"keep_alive {keep_alive[:40]!r} is not a duration; send seconds (a number) or a "
                           'duration like "5m", "1h" or "-1" (forever)', "keep_alive")
    total = sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", parts[2]))
    return -total if parts[1] else total


class Generation(Strict):
    """What `/api/chat` and `/api/generate` share."""

    model: str = Field(min_length=1)
    stream: bool | None = True  # null: streamed, Ollama's default
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | Literal[THINK_LEVELS] | None = None
    truncate: bool | None = None  # a prompt beyond the context is refused either way (never cut)
    shift: bool | None = None  # a reply ends when the context is full (no shift)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("keep_alive")
    @classmethod
    def duration(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and not math.isfinite(value):
            raise PydanticCustomError("duration", "keep_alive must be a finite number of seconds", {})
        return value

    @property
    def streamed(self) -> bool:
        return self.stream is not False

    @property
    def top(self) -> int | None:
        """Alternatives each token's logprobs list (None: no logprobs asked for)."""
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def keep_alive_seconds(self) -> float | None:
        return seconds(self.keep_alive)

    def request_options(self, context: int) -> RequestOptions:
        """The options, the output format and thinking, in the engine's names."""
        base = self.options.request_options(context) if self.options is not None else RequestOptions()
        fmt = self.format or None
        response_format = {"type": "json_object"} if fmt == "json" else \
            {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}} if fmt is not None else None
        effort = None if self.think is None else ("none" if self.think is False else
                                                  "medium" if self.think is True else self.think)
        # the chosen token's logprob needs one row of alternatives (and asks for nothing more)
        rows = max(self.top, 1) if self.top is not None else None
        return replace(base, response_format=response_format, reasoning_effort=effort, logprobs=rows)


def data_url(image: str) -> str:
    """A base64 image (as Ollama's clients send it) as the data: URL the engine reads; the
    engine finds its format from its bytes."""
    try:
        base64.b64decode(image, validate=True)
    except ValueError:
        raise PydanticCustomError("image", "an image must be base64-encoded bytes", {}) from None
    return f"data:application/octet-stream;base64,{image}"


class Function(Strict):
    name: str = Field(min_length=1)
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(Strict):
    function: Function
    id: str | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("images")
    @classmethod
    def base64_images(cls, images: list[str] | None) -> list[str] | None:
        return [data_url(i) for i in images] if images else None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's shape, as every API here gives it):
        images as parts after the text, calls with ids (made up from the message's `index`
        where the client sent none: Ollama's calls have none)."""
        content = template_content([self.content, *map(image_part, self.images)]) if self.images else self.content
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id or f"call{index:04d}{i:02d}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for i, c in enumerate(self.tool_calls)]
        if self.thinking:
            out["reasoning_content"] = self.thinking
        if self.tool_name is not None:
            out["name"] = self.tool_name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Chat(Generation):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools, checked by the engine

    @property
    def loads_only(self) -> bool:
        """No messages: Ollama's request to load (or, with keep_alive 0, unload) the model."""
        return not self.messages

    def prompt(self) -> list[dict[str, Any]]:
        """The messages as templates take them; a tool result follows the call it answers, so
        one without a `tool_call_id` takes the id of the earlier call of its `tool_name`."""
        out, calls = [], {}
        for i, m in enumerate(self.messages):
            message = m.for_template(i)
            for call in message.get("tool_calls", ()):
                calls[call["function"]["name"]] = call["id"]
            if m.role == "tool" and m.tool_call_id is None and m.tool_name in calls:
                message["tool_call_id"] = calls[m.tool_name]
            out.append(message)
        return out

    def request_options(self, context: int) -> RequestOptions:
        options = super().request_options(context)
        return replace(options, tools=self.tools or None)


class Generate(Generation):
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    template: str = ""
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None

    @field_validator("images")
    @classmethod
    def base64_images(cls, images: list[str] | None) -> list[str] | None:
        return [data_url(i) for i in images] if images else None

    @model_validator(mode="after")
    def honourable(self) -> Generate:
        if self.suffix:
            raise PydanticCustomError("suffix", "suffix (fill-in-the-middle) is not supported by this server: its "
                                      "models are completed left to right; send the text before the gap as the "
                                      "prompt, or leave suffix out", {})
        if self.template:
            raise PydanticCustomError("template", "a template override is not supported by this server: the "
                                      "model's own chat template applies; render the prompt yourself and send it "
                                      "with raw: true", {})
        if self.context:
            raise PydanticCustomError("context", "context (deprecated token history) is not supported by this "
                                      "server; send the conversation to /api/chat as messages", {})
        if self.raw and (self.system or self.images):
            raise PydanticCustomError("raw", "a raw prompt is sent as it is: system and images go through the "
                                      "template; leave them out with raw: true", {})
        return self

    @property
    def loads_only(self) -> bool:
        """No prompt: Ollama's request to load (or, with keep_alive 0, unload) the model."""
        return not self.prompt and not self.images

    def engine_prompt(self) -> str | list[dict[str, Any]]:
        """Raw text, or the prompt as a user message (after `system`) for the chat template."""
        if self.raw:
            return self.prompt
        user = template_content([self.prompt, *map(image_part, self.images)]) if self.images else self.prompt
        return [*([{"role": "system", "content": self.system}] if self.system else []),
                {"role": "user", "content": user}]

    def request_options(self, context: int) -> RequestOptions:
        options = super().request_options(context)
        # a raw prompt is text, not a chat: a thinking model's tags stay in the reply, as with /v1/completions
        return replace(options, split_reasoning=False) if self.raw else options


class Embed(Strict):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool | None = None  # a text beyond the context is refused either way (never cut)
    dimensions: int | None = Field(None, ge=1)
    keep_alive: float | str | None = None
    options: Options | None = None  # sampling options: no effect on an embedding

    @property
    def keep_alive_seconds(self) -> float | None:
        return seconds(self.keep_alive)


class Embeddings(Strict):
    """The legacy `/api/embeddings`: one `prompt`, one `embedding`."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    keep_alive: float | str | None = None
    options: Options | None = None

    @property
    def keep_alive_seconds(self) -> float | None:
        return seconds(self.keep_alive)


class Named(Strict):
    """A body naming one model: `model`, or the older `name` Ollama still reads."""

    model: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def one_name(self) -> Named:
        if not (self.model or self.name):
            raise PydanticCustomError("missing", "model is required: the name of the model", {})
        return self

    @property
    def target(self) -> str:
        return self.model or self.name or ""


class Show(Named):
    verbose: bool | None = None  # nothing here is left out without it
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None


class Pull(Named):
    stream: bool | None = True
    insecure: bool | None = None  # deprecated and ignored by Ollama, as here
    username: str | None = None
    password: str | None = None

    @property
    def streamed(self) -> bool:
        return self.stream is not False


class Copy(Strict):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


def parse(raw: bytes, kind: type[Strict]) -> Any:
    """A request body as `kind`, or a RequestError naming the first field at fault."""
    try:
        return kind.model_validate(json_object(raw))
    except ValidationError as e:
        raise refusal(e.errors(), "unknown field") from None
