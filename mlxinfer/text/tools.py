"""Tool calling: an app's functions shown to the model, and its calls to them read back.

Tools reach the model through its own chat template (the `tools` variable) when the
template uses them, and otherwise through a documented fallback: a system message that
lists the functions as JSON and asks for a call as one JSON object,
`{"name": ..., "arguments": {...}}`. A call is written in the model's own syntax, read
from its template: Hermes / Qwen (`<tool_call>{json}</tool_call>`), Mistral
(`[TOOL_CALLS] [{json}, ...]`), bare JSON (Llama 3.1 style, and the fallback), or
harmony's (gpt-oss): a message of its own addressed to the function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>`,
which the reasoning split (`reasoning.ChannelSplitter`) keeps out of the thinking and the
answer and hands here with its recipient.

`tool_choice` "required" or a named function holds the whole reply to a call grammar
whose arguments follow the function's `parameters` schema; "auto" lets the model choose,
and once its first token opens a call, holds the rest of it to that grammar; "none"
shows the tools and reads no calls. A harmony reply is a run of messages whose first
token says nothing about a call, so its grammar covers the whole reply: free-text
messages to think or talk in, then the call (or under "auto", the final answer instead).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np

from .constrain import JSON_LAYOUT, Constraint, Format, compiled_lark
from ..base.errors import InvalidOptionError
from .grammar_checks import MAX_TOOLS_BYTES, check_schema
from .reasoning import HARMONY as CHANNELS
from .tokenizer import Tokenizer

FALLBACK_PROMPT = ("You can call these functions:\n{tools}\nTo call one, reply with only a JSON object "
                   '{{"name": <function name>, "arguments": <an object of its arguments>}} and nothing else.')
_call_ids = itertools.count()
# JSON in a reply nested deeper than this is left as text: reading it (and writing its
# arguments back out) would recurse that deep, and a RecursionError would lose the reply.
CALL_DEPTH = 128
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments (parsed JSON)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class Syntax:
    """How a model family writes its calls: `open` / `close` around them (special-token
    names or text), and the key that holds the arguments."""

    name: str
    open: str = ""
    close: str = ""
    key: str = "arguments"
    listed: bool = False  # calls as one JSON list (Mistral) rather than one block each
    addressed: bool = False  # calls as messages addressed to `functions.NAME` (harmony), never in the answer


HERMES = Syntax("hermes", "<tool_call>", "</tool_call>")
MISTRAL = Syntax("mistral", "[TOOL_CALLS]", listed=True)
JSON_CALL = Syntax("json")
LLAMA = Syntax("llama", key="parameters")
HARMONY = Syntax("harmony", addressed=True)
CALL_END = "<|call|>"  # harmony's end of a call, which ends the turn
FUNCTIONS = "functions."  # harmony's namespace for the app's functions: a call's recipient is functions.NAME
# harmony writes arguments compact (OpenAI's harmony guide: `{"location":"San Francisco"}`)
HARMONY_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def syntax_for(tokenizer: Tokenizer) -> Syntax:
    """The call syntax the model's chat template teaches (bare JSON when it teaches none)."""
    template = tokenizer.chat_template or ""
    if CHANNELS.channel in template and CALL_END in template:
        return HARMONY
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "tools" in template and '"parameters"' in template:
        return LLAMA
    return JSON_CALL


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools` list, checked: every entry a function with a name, and parameters a schema."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise InvalidOptionError('tools must be a non-empty list of {"type": "function", "function": {...}}')
    names = set()
    for i, tool in enumerate(tools):
        if isinstance(tool, Mapping) and tool.get("type") == "custom":
            raise InvalidOptionError(f"tools[{i}] is a custom tool (free-text input), which this server cannot call; "
                                     'describe it as {"type": "function", "function": {...}} instead')
        function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise InvalidOptionError(f'tools[{i}] must be {{"type": "function", "function": {{"name": "a_name", ...}}}}')
        if name in names:
            raise InvalidOptionError(f"tools[{i}]: the function name '{name}' is used twice")
        if not isinstance(function.get("parameters", {}), Mapping):
            raise InvalidOptionError(f"tools[{i}].function.parameters must be a JSON Schema object")
        check_schema(dict(function.get("parameters") or {}), f"tools[{i}].function.parameters")
        names.add(name)
    size = sum(len(json.dumps(t["function"].get("parameters") or {})) for t in tools)
    if size > MAX_TOOLS_BYTES:
        raise InvalidOptionError(f"the tools' parameters take {size} bytes together; the limit is {MAX_TOOLS_BYTES} "
                                 "(256 KiB)")
    return [dict(t) for t in tools]


def chosen_functions(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[str, list[dict[str, Any]]]:
    """("none" | "auto" | "required", the functions a call may name). OpenAI's
    `allowed_tools` choice keeps every tool in the prompt and lets calls name only some."""
    functions = [t["function"] for t in tools]
    if tool_choice in (None, "auto", "none", "required"):
        return tool_choice or "auto", functions
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "allowed_tools":
        return _allowed(functions, tool_choice.get("allowed_tools"))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise InvalidOptionError(f"tool_choice {tool_choice!r} names no function in tools; use \"auto\", \"none\", "
                                 "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return "required", named


def _allowed(functions: list[dict[str, Any]], allowed: Any) -> tuple[str, list[dict[str, Any]]]:
    """tool_choice {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}: the mode
    ("auto" or "required") over the functions it lists (by Chat's or Responses' shape)."""
    form = ('{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", '
            '"tools": [{"type": "function", "function": {"name": ...}}]}}')
    if not isinstance(allowed, Mapping) or allowed.get("mode") not in ("auto", "required") \
            or not isinstance(allowed.get("tools"), list) or not allowed["tools"]:
        raise InvalidOptionError(f"tool_choice must be {form}")
    entries = allowed["tools"]
    names = [e.get("function", e).get("name") if isinstance(e, Mapping) and isinstance(e.get("function", e), Mapping)
             else None for e in entries]
    for name in names:
        if name not in {f["name"] for f in functions}:
            raise InvalidOptionError(f"tool_choice.allowed_tools names {name!r}, which is not a function in tools")
    return allowed["mode"], [f for f in functions if f["name"] in names]


def call_schema(functions: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """A JSON Schema for one call to any of `functions`, its arguments following their
    parameters (whose local `$ref`s are rebased to where the parameters now sit)."""
    def option(f: dict[str, Any], at: str) -> dict[str, Any]:
        parameters = _rebased(f.get("parameters") or {"type": "object"}, f"{at}/properties/{key}")
        return {"type": "object", "additionalProperties": False, "required": ["name", key],
                "properties": {"name": {"const": f["name"]}, key: parameters}}

    if len(functions) == 1:
        return {**option(functions[0], "#"), "x-guidance": JSON_LAYOUT}
    return {"anyOf": [option(f, f"#/anyOf/{i}") for i, f in enumerate(functions)], "x-guidance": JSON_LAYOUT}


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` ("#/$defs/x") pointing into it from `base` (a JSON
    pointer); values (const, enum, default, examples) are copied as they are."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        else:
            out[k] = v if k in ("const", "enum", "default", "examples") else _rebased(v, base)
    return out


def _token(tokenizer: Tokenizer, text: str) -> str:
    """A Lark terminal for `text`: the special token it names, or the literal text."""
    token = tokenizer.backend.token_to_id(text)
    return f"<[{token}]>" if token is not None and text.startswith(("<", "[")) else json.dumps(text)


def call_grammar(tokenizer: Tokenizer, syntax: Syntax, functions: list[dict[str, Any]], parallel: bool = True,
                 answer: dict[str, Any] | None = None) -> str:
    """Lark for one or more calls in `syntax` (exactly one unless `parallel`), or with
    `answer` (a JSON Schema) instead one JSON value that follows it."""
    schema = json.dumps(call_schema(functions, syntax.key))
    if syntax.listed:
        more = ' (", " call)*' if parallel else ""
        calls, rules = f'{_token(tokenizer, syntax.open)} " "? "[" call{more} "]"', ""
    elif syntax.open:
        block = f'{_token(tokenizer, syntax.open)} "\\n" call "\\n" {_token(tokenizer, syntax.close)}'
        calls, rules = "block" + (' ("\\n" block)*' if parallel else ""), f"\nblock: {block}"
    else:
        calls, rules = "call", ""
    if answer is not None:
        calls += " | answer"
        rules += f"\nanswer: %json {json.dumps({**answer, 'x-guidance': JSON_LAYOUT})}"
    return f"start: {calls}{rules}\ncall: %json {schema}"


def harmony_grammar(tokenizer: Tokenizer, functions: list[dict[str, Any]], choice: str,
                    answer: dict[str, Any] | None = None) -> str:
    """Lark for a harmony reply with tools: messages to think (`analysis`) or talk
    (`commentary`) in, free text up to `<|end|>`, then one call to one of `functions`, its
    arguments following its parameters and `<|call|>` ending the turn (so a reply makes one
    call, whatever parallel_tool_calls says); under "auto" the final answer may come instead
    of the call, following `answer` (a JSON Schema) when given."""
    c = CHANNELS
    channel, message = _token(tokenizer, c.channel), _token(tokenizer, c.message)
    thought = (f'{channel} ("{c.thinking}" | "commentary") {message} TEXT {_token(tokenizer, "<|end|>")} '
               f'{_token(tokenizer, c.start)} "assistant"')
    calls = [f'{channel} "commentary" " to={FUNCTIONS}{f["name"]}" " " {_token(tokenizer, "<|constrain|>")} "json" '
             f'{message} %json {json.dumps(_arguments_schema(f))} {_token(tokenizer, CALL_END)}' for f in functions]
    rules = [f"start: thought* {'(call | final)' if choice == 'auto' else 'call'}", f"thought: {thought}",
             f"call: {' | '.join(f'call_{i}' for i in range(len(calls)))}",
             *(f"call_{i}: {call}" for i, call in enumerate(calls)), "TEXT: /(?s:.*)/"]
    if choice == "auto":
        body = "TEXT" if answer is None else f"%json {json.dumps({**answer, 'x-guidance': JSON_LAYOUT})}"
        rules.append(f'final: {channel} "final" {message} {body}')
    return "\n".join(rules)


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as the schema of a harmony call's body (compact JSON)."""
    return {**(function.get("parameters") or {"type": "object"}), "x-guidance": HARMONY_LAYOUT}


@dataclass
class ToolPlan:
    """What a request with tools does: how to render them, what to hold the reply to, how to read it."""

    tools: list[dict[str, Any]]
    choice: str
    syntax: Syntax
    grammar: Format | None
    answers: bool = False  # "auto" with a JSON format: the whole reply is a call or that JSON

    def messages(self, tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
        """The messages to render and whether the template takes the tools itself."""
        messages = [_template_message(m) for m in messages]
        if "tools" in (tokenizer.chat_template or ""):
            return messages, True
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
        note = FALLBACK_PROMPT.format(tools=listing)
        first = messages[0] if messages else {}
        if first.get("role") == "system":
            return [{**first, "content": f"{first['content']}\n\n{note}"}, *messages[1:]], False
        if "system" not in (tokenizer.chat_template or "") and first.get("role") == "user":
            # a template without a system role (Mistral's [INST]): the note opens the first user message
            return [{**first, "content": f"{note}\n\n{first['content']}"}, *messages[1:]], False
        return [{"role": "system", "content": note}, *messages], False

    def constraint(self, tokenizer: Tokenizer, vocab_size: int) -> Constraint | None:
        if self.grammar is None:
            return None
        constraint = Constraint(self.grammar, tokenizer, vocab_size)
        whole = self.choice == "required" or self.answers or self.syntax.addressed
        return constraint if whole else OnceCalled(constraint)

    def parse(self, text: str, addressed: list[tuple[str, str]] | None = None) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls or None, the calls) of a finished reply; harmony's
        calls come `addressed` ((recipient, body) of each message the reasoning split kept
        out of `text`), or when the reply was not split (`text` raw, markup and all), are
        read from `text` itself, which stays as it is."""
        if self.choice == "none":
            return text, []
        names = {t["function"]["name"] for t in self.tools}
        if self.syntax.addressed:
            found, rest = _addressed_calls(_addressed_in(text) if addressed is None else addressed), text
        else:
            found, rest = _find_calls(text, self.syntax)
        calls = [ToolCall(c["name"], _arguments(c, self.syntax.key), f"call_{next(_call_ids)}") for c in found
                 if isinstance(c, Mapping) and c.get("name") in names]
        if not calls:
            return text, []
        return (rest.strip() or None), calls


def read_tools(path: str) -> list[dict[str, Any]]:
    """OpenAI's tools list from a JSON file (a list, or an object with a "tools" list), checked."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidOptionError(f"cannot read tools from {path}: {e}; pass a JSON file holding OpenAI's tools list") \
            from None
    return check_tools(data.get("tools") if isinstance(data, dict) else data)


def describe_call(call: ToolCall) -> str:
    """A call as a person reads it: name(key=value, ...)."""
    args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in call.arguments.items())
    return f"{call.name}({args})"


def call_syntax(tokenizer: Tokenizer) -> Syntax:
    """The syntax this model's calls are read in: its template's, or bare JSON for the fallback."""
    return syntax_for(tokenizer) if "tools" in (tokenizer.chat_template or "") else JSON_CALL


def call_opener(tokenizer: Tokenizer) -> str | None:
    """The text a call starts with (to hold streamed text back until it is known not to be one);
    None where calls never reach the answer's text (harmony's are messages of their own)."""
    syntax = call_syntax(tokenizer)
    return None if syntax.addressed else syntax.open or "{"


def may_open_call(text: str, opener: str | None) -> bool:
    """Whether streamed answer `text` may be the start of a call that begins with `opener`
    (`call_opener`; None: no calls in the text), so it is held back until that is known."""
    start = text.lstrip()
    return opener is not None and (start.startswith(opener) or opener.startswith(start))


def plan(tokenizer: Tokenizer, tools: Any, tool_choice: Any = None, parallel: bool = True,
         answer: dict[str, Any] | None = None) -> ToolPlan:
    """Check `tools` / `tool_choice` and work out how to render, constrain and read them; a
    reply holds at most one call unless `parallel` (OpenAI's `parallel_tool_calls`). With
    `answer` (the JSON Schema of a response format), a reply under "auto" is a call or JSON
    following it (a call made is not held to the format; under "none" the format alone holds)."""
    tools = check_tools(tools)
    choice, functions = chosen_functions(tools, tool_choice)
    syntax = call_syntax(tokenizer)
    answer = answer if choice == "auto" else None
    if choice == "none":
        grammar = None
    elif syntax.addressed:
        grammar = compiled_lark(harmony_grammar(tokenizer, functions, choice, answer), "tool call")
    else:
        grammar = compiled_lark(call_grammar(tokenizer, syntax, functions, parallel, answer), "tool call")
    return ToolPlan(tools, choice, syntax, grammar, answer is not None)


class OnceCalled:
    """tool_choice "auto": the reply is free text unless its first token opens a call
    (the call grammar accepts it); then the rest of it is held to the call grammar."""

    def __init__(self, inner: Constraint):
        self.inner, self.vocab_size = inner, inner.vocab_size
        self.state = "first"  # then "call" or "free"
        self._free = np.ones(self.vocab_size, dtype=bool)

    def allowed(self) -> np.ndarray:
        return self.inner.allowed() if self.state == "call" else self._free

    def mask(self) -> mx.array:
        return mx.array(self.allowed())[None]

    def accept(self, token: int) -> None:
        if self.state == "first":
            self.state = "call" if self.inner.valid_prefix([token]) == 1 else "free"
        if self.state == "call":
            self.inner.accept(token)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self.inner.valid_prefix(tokens) if self.state == "call" else len(tokens)

    def rollback(self, n: int) -> None:
        if self.state == "call":
            self.inner.rollback(n)

    @property
    def complete(self) -> bool:
        return self.state != "call" or self.inner.complete


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: tool-call arguments as objects, not JSON strings."""
    out = dict(message)
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            function = dict(call.get("function", call))
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = _read_json(function["arguments"])
                except ValueError:
                    pass
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


def _arguments(call: Mapping[str, Any], key: str) -> dict[str, Any]:
    args = call.get(key, call.get("arguments", call.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = _read_json(args)
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def _find_calls(text: str, syntax: Syntax) -> tuple[list[Any], str]:
    """The JSON of every call in `text`, and the text around them."""
    if syntax.open and not syntax.listed:
        pattern = re.compile(re.escape(syntax.open) + r"\s*(.*?)\s*" + re.escape(syntax.close), re.S)
        found = [_loads(m.group(1)) for m in pattern.finditer(text)]
        return [f for f in found if f is not None], pattern.sub("", text)
    if syntax.listed:
        head, marker, tail = text.partition(syntax.open)
        calls = _loads(tail) if marker else None
        return (calls if isinstance(calls, list) else []), head
    call = _loads(text.strip())
    return ([call] if isinstance(call, dict) else []), ""


def _addressed_in(raw: str) -> list[tuple[str, str]]:
    """The (recipient, body) of each addressed message in a raw harmony reply."""
    splitter = CHANNELS.splitter(False)
    splitter.push(raw)
    splitter.flush()
    return splitter.calls


def _addressed_calls(addressed: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The calls among harmony's addressed messages (recipient, body): those to `functions.NAME`
    whose body is a JSON object."""
    calls = [{"name": to.removeprefix(FUNCTIONS), "arguments": _loads(body)} for to, body in addressed
             if to.startswith(FUNCTIONS)]
    return [c for c in calls if isinstance(c["arguments"], dict)]


def _loads(text: str) -> Any:
    """The JSON in `text`, or None when there is none to read."""
    try:
        return _read_json(text)
    except ValueError:
        return None


def _read_json(text: str) -> Any:
    """json.loads for a model's (or a client's) text: ValueError when it is not JSON or nests
    deeper than CALL_DEPTH (measured first, without recursion)."""
    brackets = re.sub(r"[^\[\]{}]+", "", _STRING.sub("", text))
    depth = max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if depth > CALL_DEPTH:
        raise ValueError(f"JSON nested {depth} deep")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
