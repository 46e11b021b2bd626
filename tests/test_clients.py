"""The client libraries apps are built on, on their default settings, against the real
server in a subprocess: the official `openai` client's `chat.completions.parse`,
LangChain's `ChatOpenAI`, litellm and pydantic-ai's `OpenAIChatModel`.

Oracles: for text, the same prompt's greedy reply from the raw /v1/chat/completions;
for structured output and tool calls, pydantic and jsonschema (the random weights are
held to the schema by the server's grammar; the schemas are bounded so a reply is short).
The libraries make no network call but to 127.0.0.1: every other address is refused
at the socket, and their cost maps and telemetry stay local."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from serving import KEY, post

os.environ.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LANGSMITH_TRACING": "false",
                   "LANGCHAIN_TRACING_V2": "false", "DO_NOT_TRACK": "1"})
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")

PROMPT = "tell me about the sea"
TEXT_TOKENS = 12
STRUCTURED_TOKENS = 80


class Digit(BaseModel):
    """A digit."""

    model_config = ConfigDict(extra="forbid")  # no other keys: a short reply, even from random weights
    n: int = Field(ge=0, le=9)


class Forecast(BaseModel):
    """Weather forecast for the next days."""

    model_config = ConfigDict(extra="forbid")
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class AnyObject(BaseModel):
    """JSON mode promises a JSON object, not a schema: any object is one of these."""

    model_config = ConfigDict(extra="allow")


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Refuse any connection or name lookup that is not for this machine's loopback."""
    def local(host) -> bool:
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host == "localhost"

    real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not local(address[0]):
            raise OSError(f"the test tried to reach {address}")
        return real_connect(sock, address)

    def lookup(host, *args, **kwargs):
        if host is not None and not local(host.decode() if isinstance(host, bytes) else host):
            raise OSError(f"the test tried to look up {host}")
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", lookup)


@pytest.fixture(scope="module")
def server(roomy_server):
    return roomy_server


@pytest.fixture(scope="module")
def v1(server) -> str:
    return f"{server.url}/v1"


def raw_reply(server, max_tokens: int = TEXT_TOKENS, **body) -> dict:
    """The server's greedy reply to PROMPT (with `body`'s extra fields) through raw HTTP."""
    status, reply, _ = post(server.url, {"model": "m", "messages": [{"role": "user", "content": PROMPT}],
                                         "temperature": 0, "max_tokens": max_tokens, **body})
    assert status == 200, reply
    return reply["choices"][0]


def valid(model: type[BaseModel], text: str) -> BaseModel:
    """`text` checked against `model`'s JSON Schema (jsonschema), then read by pydantic."""
    jsonschema.validate(json.loads(text), model.model_json_schema())
    return model.model_validate_json(text)


# --- the official openai client ---

def test_openai_parse_returns_the_pydantic_model(v1):
    client = openai.OpenAI(base_url=v1, api_key=KEY, max_retries=0)
    r = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": PROMPT}],
                                      response_format=Digit, temperature=0, max_tokens=STRUCTURED_TOKENS)
    message = r.choices[0].message
    assert isinstance(message.parsed, Digit) and message.parsed == valid(Digit, message.content)


# --- LangChain ---

@pytest.fixture(scope="module")
def chat_openai(v1):
    langchain_openai = pytest.importorskip("langchain_openai")
    return lambda max_tokens: langchain_openai.ChatOpenAI(model="m", base_url=v1, api_key=KEY, temperature=0,
                                                         max_tokens=max_tokens)


def test_langchain_invoke_and_stream_equal_the_raw_reply(server, chat_openai):
    want = raw_reply(server)["message"]["content"]
    llm = chat_openai(TEXT_TOKENS)
    assert llm.invoke(PROMPT).content == want
    assert "".join(chunk.content for chunk in llm.stream(PROMPT)) == want


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output_by_each_method(chat_openai, method):
    """`with_structured_output` on its default method (json_schema) and the other two."""
    model = AnyObject if method == "json_mode" else Digit
    llm = chat_openai(STRUCTURED_TOKENS)
    runnable = llm.with_structured_output(model, include_raw=True, **({"method": method} if method else {}))
    out = runnable.invoke(PROMPT)
    assert out["parsing_error"] is None and isinstance(out["parsed"], model), out
    raw = out["raw"]
    if method == "function_calling":
        (call,) = raw.tool_calls
        assert call["name"] == "Digit" and out["parsed"] == valid(Digit, json.dumps(call["args"]))
    else:
        assert raw.response_metadata["finish_reason"] == "stop"
        assert out["parsed"] == valid(model, raw.content)


def test_langchain_bind_tools_one_call_each_tool_choice(server, chat_openai):
    """`bind_tools([tool], parallel_tool_calls=False)` with a named tool and with "any"
    (LangChain's "required"): one call, its arguments the ones the raw API returns; the
    call and its tool result sent back make the next turn."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    llm = chat_openai(STRUCTURED_TOKENS)
    tool = convert_to_openai_tool(Forecast)
    for choice, sent in (("Forecast", {"type": "function", "function": {"name": "Forecast"}}), ("any", "required")):
        message = llm.bind_tools([Forecast], parallel_tool_calls=False, tool_choice=choice).invoke(PROMPT)
        (call,) = message.tool_calls
        want = raw_reply(server, STRUCTURED_TOKENS, tools=[tool], tool_choice=sent,
                         parallel_tool_calls=False)["message"]["tool_calls"]
        assert call["name"] == "Forecast" and call["args"] == json.loads(want[0]["function"]["arguments"])
        valid(Forecast, json.dumps(call["args"]))
    history = [HumanMessage(PROMPT), message, ToolMessage("sunny", tool_call_id=call["id"])]
    after = llm.bind_tools([Forecast], tool_choice="none").invoke(history)
    assert isinstance(after.content, str) and not after.tool_calls


# --- litellm ---

def test_litellm_text_and_stream_equal_the_raw_reply(server, v1):
    litellm = pytest.importorskip("litellm")
    want = raw_reply(server)["message"]["content"]
    ask = dict(model="openai/m", api_base=v1, api_key=KEY, messages=[{"role": "user", "content": PROMPT}],
               temperature=0, max_tokens=TEXT_TOKENS)
    assert litellm.completion(**ask).choices[0].message.content == want
    assert "".join(c.choices[0].delta.content or "" for c in litellm.completion(**ask, stream=True)) == want


# --- pydantic-ai ---

def test_pydantic_ai_text_and_structured_output(server, v1):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=v1, api_key=KEY))
    want = raw_reply(server)["message"]["content"]
    text = Agent(model).run_sync(PROMPT, model_settings={"temperature": 0, "max_tokens": TEXT_TOKENS})
    assert text.output == want
    result = Agent(model, output_type=Digit).run_sync(PROMPT, model_settings={"temperature": 0,
                                                                             "max_tokens": STRUCTURED_TOKENS})
    assert isinstance(result.output, Digit)
    call = next(part for m in result.all_messages() for part in getattr(m, "parts", [])
                if type(part).__name__ == "ToolCallPart")
    assert result.output == valid(Digit, call.args_as_json_str())
