"""Anthropic's Messages API request bodies (`/v1/messages`, `/v1/messages/count_tokens`),
read strictly and turned into the engine's chat messages and options.

As Anthropic's own API does, a field it does not define is a 400 naming it. Fields it
defines that have no effect on a local model (`metadata`, `service_tier`, `cache_control`,
`speed`, `inference_geo`, `diagnostics`, citations on earlier text) are accepted and
change nothing; what would change the output and cannot be done here (images and
documents, Anthropic's own server tools, MCP servers, code-execution containers, a
prefilled assistant turn) is refused by name.

A conversation becomes the chat messages every template takes (OpenAI's shape): the
system prompt a system message, an assistant's `tool_use` blocks its `tool_calls`, each
`tool_result` a `tool` message, earlier thinking the assistant's `reasoning_content`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.options import MAX_STOPS, RequestOptions
from .bodies import json_object
from .content import image_part, template_content
from .errors import RequestError, refusal

# Block types Anthropic defines that no model here reads (images, in a message, go to a vision-language model).
MEDIA_BLOCKS = ("image", "document")
# Blocks of Anthropic's server-side features (its own tools, search results), which need its servers.
SERVER_BLOCKS = ("search_result", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                 "code_execution_tool_result", "bash_code_execution_tool_result",
                 "text_editor_code_execution_tool_result", "tool_search_tool_result", "container_upload",
                 "tool_reference", "browser_state")
REFUSED_FIELDS = {"mcp_servers": "it has no MCP connector; call the servers' tools from your client, as custom tools",
                  "container": "it has no code-execution containers",
                  "context_management": "it does not edit the context; send the messages you want read"}
REFUSED = {name: f"'{name}' is not supported by this server: {why}" for name, why in REFUSED_FIELDS.items()}
# How text blocks of one message (or one tool result) are joined into the one string a template takes.
BLOCK_SEPARATOR = "\n"


class Strict(BaseModel):
    """Unknown fields refused, and no coercion (`max_tokens: "4"` is a 400, as Anthropic answers)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(Strict):
    """A prompt-cache breakpoint: a no-op here (every prompt's prefix is cached already)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # on an earlier reply's text: nothing to render


class ToolUseBlock(Strict):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


def _refuse_blocks(blocks: Any, images: bool = False) -> Any:
    """A document or server-side block (and an image, where `images` are not taken) refused by
    name, not as a shape mismatch."""
    for i, block in enumerate(blocks if isinstance(blocks, list) else []):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in MEDIA_BLOCKS and not (images and kind == "image"):
            raise PydanticCustomError("text_only", f"this server takes text{' and images' if images else ''} here: "
                                      f"remove the {kind} block (at {i}) or send its text as a text block", {})
        if kind in SERVER_BLOCKS:
            raise PydanticCustomError("server_only", f"{kind} blocks (at {i}) belong to Anthropic's server tools, "
                                      "which this server does not have; send text blocks", {})
    return blocks


def _as_blocks(content: Any, images: bool = False) -> Any:
    """A string is shorthand for one text block."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else _refuse_blocks(content, images)


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(Strict):
    type: Literal["url"]
    url: str  # fetched only where the server allows it (`serve --allow-image-urls`)


class ImageBlock(Strict):
    """An image in a user turn, for a vision-language model (a text-only one refuses it)."""

    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def part(self) -> dict[str, Any]:
        src = self.source
        url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64Source) else src.url
        return image_part(url)


def _joined(blocks: list[TextBlock]) -> str:
    return BLOCK_SEPARATOR.join(b.text for b in blocks)


class ToolResultBlock(Strict):
    """What a tool returned, in a user turn; `is_error` marks a failure."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def blocks(cls, content: Any) -> Any:
        return _as_blocks(content)

    def text(self) -> str:
        return ("Error: " if self.is_error else "") + _joined(self.content)


class ThinkingBlock(Strict):
    """An earlier turn's thinking, sent back as received."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock, ImageBlock],
                  Field(discriminator="type")]
# Which blocks each role's turns may hold.
ROLE_BLOCKS = {"user": ("text", "tool_result", "image"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
               "system": ("text",)}


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def blocks(cls, content: Any) -> Any:
        return _as_blocks(content, images=True)

    @model_validator(mode="after")
    def blocks_fit_the_role(self) -> Message:
        for i, block in enumerate(self.content):
            if block.type not in ROLE_BLOCKS[self.role]:
                raise PydanticCustomError("role_block", f"a {self.role} turn cannot hold a {block.type} block (at "
                                          f"content.{i}); it may hold {', '.join(ROLE_BLOCKS[self.role])}", {})
        return self

    def chat(self) -> list[dict[str, Any]]:
        """This turn as template messages: a user turn's tool results each a `tool` message
        (in their place among its text), an assistant's calls its `tool_calls`."""
        if self.role != "user":
            out: dict[str, Any] = {"role": self.role, "content": _joined([b for b in self.content if b.type == "text"])}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in self.content if b.type == "tool_use"]
            thinking = "".join(b.thinking for b in self.content if b.type == "thinking")
            if calls:
                out["tool_calls"] = calls
            if thinking:
                out["reasoning_content"] = thinking
            return [out]
        turns, text = [], []
        for block in self.content:
            if block.type in ("text", "image"):
                text.append(block)
                continue
            if text:
                turns.append({"role": "user", "content": _user_content(text)})
                text = []
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        if text or not turns:
            turns.append({"role": "user", "content": _user_content(text)})
        return turns


def _user_content(blocks: list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    """A user turn's text as one string, or with images its parts in order (each image where it was)."""
    return template_content([b.part() if b.type == "image" else b.text for b in blocks], BLOCK_SEPARATOR)


def _merged(a: str | list[dict[str, Any]], b: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Two consecutive turns' contents as one (Anthropic combines them)."""
    if isinstance(a, str) and isinstance(b, str):
        return BLOCK_SEPARATOR.join(t for t in (a, b) if t)
    parts = [[{"type": "text", "text": c}] if isinstance(c, str) else c for c in (a, b)]
    return [p for part in parts for p in part if p.get("type") != "text" or p["text"]]


class Tool(Strict):
    """A custom tool (the only kind a local model can be given)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # calls always follow input_schema here (a grammar holds them to it)
    eager_input_streaming: bool | None = None  # a call is streamed as one input_json_delta either way
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None

    @model_validator(mode="after")
    def callable_directly(self) -> Tool:
        if self.defer_loading:
            raise PydanticCustomError("deferred", "defer_loading needs Anthropic's tool search, which this server "
                                      "does not have; leave it out", {})
        if self.allowed_callers is not None and "direct" not in self.allowed_callers:
            raise PydanticCustomError("callers", 'allowed_callers must include "direct": this server has no code '
                                      "execution to call tools from", {})
        return self

    def function(self) -> dict[str, Any]:
        """OpenAI's function tool, which the engine takes, its keys in OpenAI's order (templates
        write it out as JSON); examples are shown in the description."""
        description = self.description or ""
        if self.input_examples:
            examples = "\n".join(json.dumps(e, ensure_ascii=False) for e in self.input_examples)
            description = f"{description}\n\nExample inputs:\n{examples}".lstrip()
        function = {"name": self.name, **({"description": description} if description else {}),
                    "parameters": self.input_schema}
        return {"type": "function", "function": function}


def _custom_tools(tools: Any) -> Any:
    """Anthropic's own tools (web search, code execution, bash, the text editor...) by name."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise PydanticCustomError("server_tool", f"'{str(kind)[:60]}' (at {i}) is one of Anthropic's own tools, "
                                      "which this server does not have; give custom tools (name, description, "
                                      "input_schema)", {})
    return tools


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def named_when_a_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_name", 'name is given with type "tool", and only then', {})
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise PydanticCustomError("none_parallel", 'disable_parallel_tool_use does not go with type "none"', {})
        return self

    def engine(self) -> str | dict[str, Any]:
        """The engine's (OpenAI's) tool_choice."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(Strict):
    """Extended thinking: "disabled" switches a thinking template off, the other types on (where
    the template has the switch; its thoughts come back as thinking blocks); budget_tokens is a
    target, as Anthropic's is."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None

    @property
    def effort(self) -> str:
        """The reasoning effort this stands for (`reasoning.effort_kwargs`)."""
        return "none" if self.type == "disabled" else "medium"

    @model_validator(mode="after")
    def budget_when_enabled(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise PydanticCustomError("budget", 'budget_tokens is given with type "enabled", and only then', {})
        return self


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a no-op: one effort here
    format: OutputFormat | None = None


class Conversation(Strict):
    """What message creation and token counting share: the prompt, tools and format."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed here
    user_profile_id: str | None = None  # whom a request is for, and which workspace: no effect on a local model
    workspace_id: str | None = None

    @field_validator("system", mode="before")
    @classmethod
    def system_blocks(cls, system: Any) -> Any:
        return _as_blocks(system)

    @field_validator("tools", mode="before")
    @classmethod
    def custom_tools(cls, tools: Any) -> Any:
        return _custom_tools(tools)

    @model_validator(mode="after")
    def ends_with_a_user_turn(self) -> Conversation:
        if self.messages[-1].role == "assistant":
            raise PydanticCustomError("prefill", "the last message is an assistant turn (a prefill), which this "
                                      "server cannot continue; end with a user turn", {})
        return self

    def chat(self) -> list[dict[str, Any]]:
        """The conversation as template messages; consecutive turns of one role are one turn
        (as Anthropic combines them), so strictly alternating templates take it."""
        turns = [{"role": "system", "content": _joined(self.system)}] if self.system else []
        for message in self.messages:
            for turn in message.chat():
                last = turns[-1] if turns else None
                if last and last["role"] == turn["role"] and turn["role"] in ("user", "assistant"):
                    last["content"] = _merged(last["content"], turn["content"])
                    for key in ("tool_calls", "reasoning_content"):
                        if key in turn:
                            last[key] = last.get(key, [] if key == "tool_calls" else "") + turn[key]
                else:
                    turns.append(turn)
        return turns

    def request_options(self) -> RequestOptions:
        """The engine options for the tools, the output format and thinking."""
        choice = self.tool_choice
        if self.tools and choice is not None and choice.type == "tool":
            names = [t.name for t in self.tools]
            if choice.name not in names:
                raise RequestError(f"tool_choice.name '{choice.name[:100]}' is not one of the tools "
                                   f"({', '.join(names)[:300]})", "tool_choice")
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None and self.tools:
            raise RequestError("output_config.format and tools are alternatives here: a reply is either a "
                               "tool call or held to the format", "output_config")
        return RequestOptions(
            tools=[t.function() for t in self.tools] if self.tools else None,
            tool_choice=choice.engine() if choice is not None else None,
            parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None,
            response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
            if fmt is not None else None,
            reasoning_effort=self.thinking.effort if self.thinking is not None else None)


class CountTokens(Conversation):
    pass


class CreateMessage(Conversation):
    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    # Anthropic's bookkeeping and routing: no effect on a local model (accepted as no-ops)
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: None = None  # refused unless null (REFUSED_FIELDS)

    def request_options(self) -> RequestOptions:
        return replace(super().request_options(), max_tokens=self.max_tokens, temperature=self.temperature,
                       top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences)


def parse(raw: bytes, kind: type[Conversation]) -> Conversation:
    """A request body as `kind`, or a RequestError naming the first field at fault."""
    try:
        return kind.model_validate(json_object(raw))
    except ValidationError as e:
        raise refusal(e.errors(), "unknown field", REFUSED, _dotted) from None


def _dotted(loc: tuple[int | str, ...]) -> str | None:
    """A field's place as a dotted path, without the block type pydantic adds after a
    content block's index ("messages.0.content.1.input", not "...1.tool_use.input")."""
    tags = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}
    kept = [p for i, p in enumerate(loc) if not (p in tags and i >= 2 and isinstance(loc[i - 1], int)
                                                 and loc[i - 2] == "content")]
    return ".".join(map(str, kept)) or None
