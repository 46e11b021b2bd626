"""OpenAI's Responses API request shapes: a body in, chat messages and engine options out.

Bodies are strict pydantic models (`openai_schema.Strict`): every field of OpenAI's
request schema is accepted, so what a client library sends by default never fails; a
field with no effect on a local model is a documented no-op, and one that would change
the output in a way this server cannot honour (a stored prompt, a conversation object,
hosted tools, images) is refused by name. Items are the Responses API's conversation:
messages, function calls and their outputs, reasoning; they become the chat messages a
template renders, so a Responses request and the same chat completion are one prompt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ..engine.options import RequestOptions
from .content import image_part, template_content
from .errors import RequestError
from .openai_schema import Strict

Status = Literal["in_progress", "completed", "incomplete"]
# Part and item types OpenAI defines that no model here can take (images go to a vision-language model).
MEDIA_PARTS = ("input_file", "input_audio")
# What `include` may name (OpenAI's list); only the logprobs have an effect here.
INCLUDABLE = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
LOGPROBS = "message.output_text.logprobs"


class InputText(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a hint for OpenAI's cache: no effect here


class OutputText(Strict):
    """An earlier reply's text, as the SDK's own objects carry it back."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(Strict):
    """An image in a message, for a vision-language model: a data: URL (an http(s) one only where
    the server allows it); a `file_id` needs OpenAI's file store, which this server does not have."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None  # the processor's own resolution applies


Part = Annotated[Union[InputText, OutputText, Refusal, InputImage], Field(discriminator="type")]


def _joined(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


def _content(content: str | list) -> str | list[dict[str, Any]]:
    """A message's content as a template takes it: one string, or with images the parts in order."""
    if isinstance(content, str):
        return content
    return template_content([image_part(p.image_url) if isinstance(p, InputImage) else _joined([p]) for p in content])


class MessageItem(Strict):
    """A message: the easy form (`{"role", "content"}`) or the full item the SDK returns."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(None, alias="async")


class FunctionCallOutputItem(Strict):
    """What the app's function returned for a call."""

    type: Literal["function_call_output"]
    output: str | list[Part]
    call_id: str | None = None
    id: str | None = None
    status: Status | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class ReasoningItem(Strict):
    """An earlier reply's thinking: accepted, and left out of the prompt (chat templates
    drop the thinking of earlier turns themselves)."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    id: str | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


class ItemReference(Strict):
    """An item of a stored response, named by its id."""

    type: Literal["item_reference"] | None = "item_reference"
    id: str


ITEMS = ("message", "function_call", "function_call_output", "reasoning", "item_reference")


def _item_kind(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    if item.get("type") is not None:
        return item["type"]
    return "message" if "role" in item else "item_reference"


Item = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                       Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                       Annotated[ReasoningItem, Tag("reasoning")], Annotated[ItemReference, Tag("item_reference")]],
                 Discriminator(_item_kind)]
ITEM = TypeAdapter(Item)


class FunctionTool(Strict):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow `parameters` here (a grammar holds them)
    description: str | None = None
    defer_loading: Literal[False] | None = None  # True: loaded by OpenAI's hosted tool search
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    output_schema: dict[str, Any] | None = None

    def chat(self) -> dict[str, Any]:
        """The tool in chat's shape, as the engine takes it."""
        function = {"name": self.name, **({"description": self.description} if self.description else {}),
                    **({"parameters": self.parameters} if self.parameters is not None else {})}
        return {"type": "function", "function": function}


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class AllowedTools(Strict):
    """Only some of the tools may be called (all are shown)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction]


class FormatText(Strict):
    type: Literal["text"]


class FormatJSONObject(Strict):
    type: Literal["json_object"]


class FormatJSONSchema(Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # held to the schema either way
    description: str | None = None


class TextConfig(Strict):
    format: Annotated[Union[FormatText, FormatJSONObject, FormatJSONSchema], Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models: no effect here

    def response_format(self) -> dict[str, Any] | None:
        """The format in chat's `response_format` shape, as the engine takes it."""
        f = self.format
        if isinstance(f, FormatJSONSchema):
            inner = {"name": f.name, "schema": f.schema_, **({"strict": f.strict} if f.strict is not None else {})}
            return {"type": "json_schema", "json_schema": inner}
        return {"type": "json_object"} if isinstance(f, FormatJSONObject) else None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad on loopback


# OpenAI's hosted features that change the output, refused unless null: what each is.
HOSTED = {"background": "background responses", "conversation": "conversation objects (use previous_response_id)",
          "prompt": "stored prompt templates", "context_management": "context compaction settings",
          "moderation": "moderation settings"}


def _function_only(tool: Any, what: str, kinds: tuple[str, ...]) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(kind, str) and kind not in kinds:
        raise PydanticCustomError("functions_only", f"{what} a '{kind[:40]}' tool; this server runs function tools "
                                  "only", {})


class CreateResponse(Strict):
    """`POST /v1/responses`."""

    model: str | None = None
    input: list[Item] | None = None  # a string is one user message
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[INCLUDABLE] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    reasoning: ReasoningConfig | None = None  # accepted; thinking is the template's to switch
    # OpenAI's bookkeeping, routing and caching: no effect on a local model (documented no-ops)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    # OpenAI's hosted features, which change the output: refused unless null
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None

    @field_validator(*HOSTED)
    @classmethod
    def not_hosted(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, [], {}):
            raise PydanticCustomError("not_supported", f"{HOSTED[info.field_name]} are not supported by this server; "
                                      "remove it", {})
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def functions_only(cls, tools: Any) -> Any:
        """A hosted tool (web search, file search, computer use, MCP, ...) is refused by name."""
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            _function_only(tool, f"tools.{i} is", ("function",))
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def function_choice(cls, choice: Any) -> Any:
        _function_only(choice, "tool_choice names", ("function", "allowed_tools"))
        return choice

    @field_validator("input", mode="before")
    @classmethod
    def known_items(cls, items: Any) -> Any:
        """A string is one user message. An item of a hosted tool (a web search call, a
        computer call, ...) or an image, file or audio part is refused by name."""
        if isinstance(items, str):
            return [{"role": "user", "content": items}]
        for i, item in enumerate(items if isinstance(items, list) else []):
            kind = _item_kind(item)
            if kind is not None and kind not in ITEMS:
                raise PydanticCustomError("item_type", f"input.{i} is a '{str(kind)[:40]}' item; this server takes "
                                          f"{', '.join(ITEMS)} items", {})
            output = isinstance(item, dict) and "content" not in item  # a tool's output: text only
            parts = item.get("content", item.get("output")) if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                media = part.get("type") if isinstance(part, dict) else None
                if media in MEDIA_PARTS or (output and media == "input_image"):
                    raise PydanticCustomError("text_only", f"this server takes text{'' if output else ' and images'} "
                                              f"here: remove the {media} part (input.{i}, part {j}) or send its "
                                              "text", {})
                if media == "input_image" and (part.get("file_id") is not None or not part.get("image_url")):
                    raise PydanticCustomError("file_id", f"input.{i}, part {j}: an input_image needs image_url (a "
                                              "data: URL); this server has no file store for file_id", {})
        return items

    def logprob_rows(self) -> int:
        # the chosen token's logprob needs one row (and asks for nothing more)
        return max(self.top_logprobs or 0, 1) if LOGPROBS in (self.include or []) else 0

    def request_options(self) -> RequestOptions:
        """The engine options this request asks for."""
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        elif isinstance(choice, AllowedTools):  # chat's shape nests what the Responses API writes flat
            choice = {"type": "allowed_tools", "allowed_tools": choice.model_dump(exclude={"type"})}
        one_call = self.parallel_tool_calls is False or self.max_tool_calls == 1
        if self.tools and not one_call and self.max_tool_calls is not None:
            raise RequestError("max_tool_calls can only be 1 here (one call, as parallel_tool_calls: false) or "
                               "left out", "max_tool_calls")
        return RequestOptions(
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            response_format=self.text.response_format() if self.text is not None else None,
            logprobs=self.logprob_rows() or None, tools=[t.chat() for t in self.tools] if self.tools else None,
            tool_choice=choice, parallel_tool_calls=False if one_call else None,
            reasoning_effort=self.reasoning.effort if self.reasoning is not None else None)


class CountInputTokens(CreateResponse):
    """`POST /v1/responses/input_tokens`: the request's input as `create` would render it, counted."""

    personality: str | None = None  # a hosted assistant's manner: no effect here (accepted as a no-op)


# Item types `messages` leaves out of the prompt (chat templates drop earlier thinking themselves).
UNRENDERED = ("reasoning",)


def messages(items: list, instructions: str | None) -> list[dict[str, Any]]:
    """Items as chat messages, as a chat template takes them: `instructions` as the system
    message, a function call joined to the assistant message before it, its output as a
    tool message, earlier thinking left out."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "content": _joined(item.output)}
            if item.call_id is not None:
                message["tool_call_id"] = item.call_id
            name = item.name or names.get(item.call_id or "")
            if name:
                message["name"] = name
            out.append(message)
    return out


def listed(item: Any) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it: a message's content
    as parts, each item with its status."""
    out = {"status": "completed", **item.model_dump(by_alias=True, exclude_none=True)}
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": item.content, **({"annotations": []} if kind == "output_text" else {})}]
    return out
