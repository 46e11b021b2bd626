"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven as its users
drive it: the official `anthropic` client on its default settings, and LangChain's
`ChatAnthropic`, against the real `mlxinfer serve` in a subprocess.

Oracles: the same conversation through `/v1/chat/completions` (greedy; itself proved against
the engine in-process), the SDK's own stream accumulator, `jsonschema` for tool inputs, and
for token counts the template rendered by transformers and tokenized by the `tokenizers`
library. All traffic goes to 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import build_hf_checkpoint
from serving import KEY, Server, marker, post

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")
HERE = Path(__file__).parent
FAULTY = "zebrafaultemit"


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    """The tiny Llama behind an API key; a prompt holding FAULTY fails at its third token."""
    s = Server(["-m", str(tiny), "--dtype", "float32", "--api-key", KEY],
               env={"MLXINFER_TEST_EMIT_FAULT": ",".join(map(str, marker(tokenizer, FAULTY))),
                    "PYTHONPATH": str(HERE.parent)},  # the script imports the tree under test, not an installed one
               script=[sys.executable, str(HERE / "fault_server.py")])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY)


@pytest.fixture(scope="module")
def qwen(qwen3_tokenizer, tmp_path_factory):
    """A tiny random Qwen3 with Qwen3's real tokenizer and chat template (tools rendered by the
    template, calls in its <tool_call> syntax), served without a key."""
    folder = tmp_path_factory.mktemp("qwen3")
    build_hf_checkpoint(folder, "qwen3", dict(vocab_size=151936, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                              tie_word_embeddings=True, max_position_embeddings=4096))
    for file in qwen3_tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    s = Server(["-m", str(folder), "--dtype", "float32"])
    yield folder, s, anthropic.Anthropic(base_url=s.url, api_key="unused")
    s.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat_completion(url: str, messages: list[dict], **options) -> dict:
    """The oracle: the same conversation through OpenAI's chat completions, greedy."""
    status, body, _ = post(url, {"messages": messages, "temperature": 0, **options})
    assert status == 200, body
    return body["choices"][0]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# --- messages equal the chat completion of the same conversation ---

def test_a_message_equals_the_chat_completion(client, server):
    r = client.messages.create(model="tiny", max_tokens=12, messages=user("hello there"))
    want = chat_completion(server.url, user("hello there"), max_tokens=12)
    assert text_of(r) == want["message"]["content"]
    assert [b.type for b in r.content] == (["text"] if want["message"]["content"] else [])
    assert r.stop_reason == STOP_REASONS[want["finish_reason"]] and r.stop_sequence is None
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.usage.output_tokens <= 12 and r.usage.output_tokens > 0


def test_a_system_prompt_as_text_or_blocks_and_a_conversation(client, server):
    convo = [*user("tell me something"), {"role": "assistant", "content": [{"type": "text", "text": "a fact"}]},
             {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "then?"}]}]
    want = chat_completion(server.url, [{"role": "system", "content": "You are terse."},
                                        *user("tell me something"), {"role": "assistant", "content": "a fact"},
                                        *user("and\nthen?")], max_tokens=10)
    for system in ("You are terse.", [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]):
        r = client.messages.create(model="tiny", max_tokens=10, system=system, messages=convo)
        assert text_of(r) == want["message"]["content"]


def test_stop_sequences_name_the_stop_that_was_hit(client, server):
    full = text_of(client.messages.create(model="tiny", max_tokens=30, messages=user("the quick brown")))
    assert len(full) >= 8, full
    stop, later = full[4:7], full[-2:]
    r = client.messages.create(model="tiny", max_tokens=30, messages=user("the quick brown"),
                               stop_sequences=["never-in-this-text", later, stop])
    first = min((full.find(s), s) for s in (stop, later))  # the earliest-starting stop in the text
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == first[1]
    assert text_of(r) == full[: first[0]]


def test_max_tokens_is_the_stop_reason_when_reached(client, server):
    want = chat_completion(server.url, user("count with me"), max_tokens=3)
    r = client.messages.create(model="tiny", max_tokens=3, messages=user("count with me"))
    assert r.stop_reason == STOP_REASONS[want["finish_reason"]] == "max_tokens"
    assert r.usage.output_tokens == 3
    nothing = client.messages.create(model="tiny", max_tokens=0, messages=user("count with me"))
    assert nothing.content == [] and nothing.stop_reason == "max_tokens" and nothing.usage.output_tokens == 0


def test_the_streamed_message_equals_the_whole_one(client):
    ask = dict(model="tiny", max_tokens=20, messages=user("what is up"))
    full = text_of(client.messages.create(**ask))
    assert len(full) >= 9, full
    ask["stop_sequences"] = [full[6:9]]
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        pieces = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(pieces) == text_of(whole)
    assert streamed.stop_reason == whole.stop_reason == "stop_sequence"
    assert streamed.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    for u in (streamed.usage, whole.usage):  # the second request reads the first one's prompt from the cache
        assert (u.input_tokens + u.cache_read_input_tokens, u.output_tokens) == \
            (whole.usage.input_tokens + whole.usage.cache_read_input_tokens, whole.usage.output_tokens)


def sse_events(url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of a raw streamed request."""
    request = urllib.request.Request(f"{url}/v1/messages", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", "x-api-key": KEY, **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().split("\n\n")
    events = []
    for frame in filter(None, frames):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_the_events_on_the_wire_follow_anthropics_sequence(server):
    events = sse_events(server.url, {"model": "tiny", "max_tokens": 8, "messages": user("hello there")},
                        headers={"anthropic-version": "2023-06-01"})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2:-2] == ["content_block_start", *["content_block_delta"] * (len(names) - 6), "content_block_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[-2][1]["usage"]["output_tokens"] == 8 and events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_failure_mid_stream_is_an_error_event(client):
    with pytest.raises(anthropic.APIStatusError) as e:
        with client.messages.stream(model="tiny", max_tokens=10, messages=user(f"this {FAULTY} breaks")) as s:
            s.until_done()
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    assert "planted emit fault" in e.value.body["error"]["message"]


# --- the content blocks of chunks a tiny random model cannot be made to produce ---

def chunk(text="", finish=None, reasoning="", calls=None, content=None, stop=None):
    from mlxinfer.decode.sources import Stats
    from mlxinfer.engine.text_stream import Chunk

    return Chunk(text, 1, None, finish, Stats(prompt_tokens=9, prefill_tokens=4, generated_tokens=5),
                 reasoning=reasoning, tool_calls=calls, content=content, stop_sequence=stop)


def frames(raw: bytes) -> list[dict]:
    return [json.loads(dict(line.split(": ", 1) for line in f.splitlines())["data"])
            for f in raw.decode().split("\n\n") if f]


def call(name: str, **arguments):
    from mlxinfer.text.tools import ToolCall

    return ToolCall(name, arguments, f"call_{name}")


@pytest.mark.parametrize("chunks, blocks, reason", [
    ([chunk(reasoning="Let me "), chunk(reasoning="think."), chunk("The answer"), chunk(" is 4.", "stop")],
     ["thinking", "text"], "end_turn"),
    ([chunk('{"name": "f", '), chunk('"arguments": {}}', "tool_calls", calls=[call("f")])], ["tool_use"], "tool_use"),
    ([chunk(reasoning="hm"), chunk("{"), chunk("}", "tool_calls", calls=[call("f", x=1), call("g")], content="x")],
     ["thinking", "text", "tool_use", "tool_use"], "tool_use"),
    ([chunk("Sure. "), chunk("call", "tool_calls", calls=[call("f", y=[1, 2])], content="Sure.")],
     ["text", "tool_use"], "tool_use"),
    ([chunk("{"), chunk("", "length")], ["text"], "max_tokens"),
    ([chunk("a"), chunk("b", "stop", stop="STOP")], ["text"], "stop_sequence"),
    ([chunk("{"), chunk("}", "tool_calls", calls=[call("f")], stop="STOP")], ["tool_use"], "tool_use"),
])
def test_what_the_stream_builds_is_the_whole_message(chunks, blocks, reason):
    """The SDK's own accumulator over our events equals the non-streamed message: thinking,
    text held back while it may be a call, calls after free text, stop sequences."""
    import asyncio

    from anthropic.lib.streaming._messages import accumulate_event
    from mlxinfer.serve.anthropic import Reply

    async def rest():
        for c in chunks[1:]:
            yield c

    async def stream() -> bytes:
        reply = Reply(rid="msg_1", model="m", max_tokens=5, opener="{")
        return b"".join([e async for e in reply.events(chunks[0], rest())])

    whole = Reply(rid="msg_1", model="m", max_tokens=5, opener="{").whole(chunks)
    snapshot, buffers = None, {}
    for event in frames(asyncio.run(stream())):
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot.model_dump(exclude_none=True) == anthropic.types.Message(**whole).model_dump(exclude_none=True)
    assert [b["type"] for b in whole["content"]] == blocks and whole["stop_reason"] == reason
    assert (whole["stop_sequence"] is not None) == (reason == "stop_sequence")


# --- token counts equal the template rendered by transformers, tokenized by `tokenizers` ---

def reference_count(folder: Path, messages: list[dict], **template) -> int:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=False, **template)
    return len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def test_count_tokens_equals_the_rendered_template(client, tiny):
    convo = [*user("hello there"), {"role": "assistant", "content": "hi"}, *user("how are you?")]
    n = client.messages.count_tokens(model="tiny", system="Be brief.", messages=convo).input_tokens
    assert n == reference_count(tiny, [{"role": "system", "content": "Be brief."}, *convo])
    r = client.messages.create(model="tiny", max_tokens=1, system="Be brief.", messages=convo)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n


WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"name": "forecast", "description": "The weather for the coming days", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "The weather for the coming "
                                                  "days", "parameters": WEATHER}}]


def test_count_tokens_with_tools_and_a_tool_round_equals_the_rendered_template(qwen):
    folder, _, client = qwen
    convo = [*user("weather?"),
             {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "forecast",
                                                "input": {"unit": "celsius", "days": 2}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                          {"type": "text", "text": "and tomorrow?"}]}]
    n = client.messages.count_tokens(model="q", system="You forecast.", tools=TOOLS, messages=convo).input_tokens
    assert n == reference_count(folder, [
        {"role": "system", "content": "You forecast."}, *user("weather?"),
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "forecast", "arguments": {"unit": "celsius", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}, *user("and tomorrow?")], tools=OPENAI_TOOLS)


# --- tools ---

def test_tool_use_round_trip(qwen):
    jsonschema = pytest.importorskip("jsonschema")
    _, s, client = qwen
    ask = dict(model="q", max_tokens=80, tools=TOOLS, messages=user("weather?"))
    for choice in ({"type": "any"}, {"type": "tool", "name": "forecast", "disable_parallel_tool_use": True}):
        r = client.messages.create(**ask, tool_choice=choice)
        calls = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and calls and all(b.name == "forecast" for b in calls)
        for call in calls:
            jsonschema.validate(call.input, WEATHER)
        with client.messages.stream(**ask, tool_choice=choice) as stream:
            streamed = stream.get_final_message()
        assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [b.model_dump(exclude={"id"}) for b in
                                                                             r.content]
        assert streamed.stop_reason == "tool_use"
    assert len(calls) == 1  # disable_parallel_tool_use: exactly one call
    call = calls[0]
    result = [{"role": "assistant", "content": r.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    again = client.messages.create(**{**ask, "messages": [*user("weather?"), *result], "max_tokens": 8},
                                   tool_choice={"type": "none"})
    want = chat_completion(s.url, [*user("weather?"),
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": call.id, "type": "function",
                                        "function": {"name": "forecast", "arguments": json.dumps(call.input)}}]},
                                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
                           max_tokens=8, tools=OPENAI_TOOLS, tool_choice="none")
    assert [b.type for b in again.content] == ["text"] and text_of(again) == want["message"]["content"]
    assert again.stop_reason == STOP_REASONS[want["finish_reason"]]


def test_output_config_format_holds_the_reply_to_the_schema(qwen):
    jsonschema = pytest.importorskip("jsonschema")
    _, s, client = qwen
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.messages.create(model="q", max_tokens=30, messages=user("a number"),
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    want = chat_completion(s.url, user("a number"), max_tokens=30,
                           response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert text_of(r) == want["message"]["content"]
    if r.stop_reason == "end_turn":
        jsonschema.validate(json.loads(text_of(r)), schema)


# --- what Anthropic accepts, and what it refuses ---

def test_fields_with_no_effect_here_are_accepted_and_change_nothing(client):
    ask = dict(model="tiny", max_tokens=6, messages=user("what is up"))
    plain = client.messages.create(**ask)
    r = client.messages.create(**ask, metadata={"user_id": "u-1"}, service_tier="auto", speed="standard",
                               inference_geo="us", cache_control={"type": "ephemeral", "ttl": "5m"},
                               thinking={"type": "enabled", "budget_tokens": 1024},
                               output_config={"effort": "low"}, diagnostics={"previous_message_id": None},
                               workspace_id="wrkspc_1", user_profile_id="p-1")
    assert r.content == plain.content
    sent_back = [*user("what is up"), {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "sig"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "text", "text": "up", "citations": None}]}, *user("really?")]
    plain = client.messages.create(**{**ask, "messages": [*user("what is up"), {"role": "assistant", "content": "up"},
                                                          *user("really?")]})
    assert client.messages.create(**{**ask, "messages": sent_back}).content == plain.content


def test_sampling_fields_of_the_earlier_api_are_taken(client):
    """temperature, top_p and top_k (which older clients send) are honoured; 0 is greedy."""
    ask = dict(model="tiny", max_tokens=6, messages=user("once upon"))
    greedy = client.messages.create(**ask, extra_body={"temperature": 0.9, "top_k": 1})
    assert greedy.content == client.messages.create(**ask, extra_body={"temperature": 0}).content
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ask, extra_body={"temperature": 1.5})
    assert "temperature" in e.value.body["error"]["message"]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("change, fact", [
    (dict(extra_body={"frequency_penalty": 1}), "unknown field 'frequency_penalty'"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE]}]),
     "this model takes no images"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}]),
     "takes text here: remove the image block"),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x",
                                                                                  "media_type": "text/plain"}}]}]),
     "remove the document block"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "one of Anthropic's own tools"),
    (dict(tools=[{"name": "get weather", "input_schema": WEATHER}]), "tools.0.name"),
    (dict(extra_body={"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]}), "mcp_servers"),
    (dict(container="container_1"), "'container' is not supported"),
    (dict(messages=[*user("hi"), {"role": "assistant", "content": "The answer is"}]), "prefill"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "a user turn cannot hold a tool_use block"),
    (dict(tool_choice={"type": "any"}), "tool_choice needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "elsewhere"}), "'elsewhere' is not one of the tools"),
    (dict(thinking={"type": "enabled", "budget_tokens": 100}), "budget_tokens"),
    (dict(stop_sequences=[f"s{i}" for i in range(17)]), "stop_sequences"),
    (dict(messages=[]), "messages"),
])
def test_bad_requests_are_400_in_anthropics_shape(client, change, fact):
    ask = {"model": "tiny", "max_tokens": 5, "messages": user("hi"), **change}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ask)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert fact in e.value.body["error"]["message"], e.value.body


def test_malformed_bodies_unknown_paths_and_methods_in_anthropics_shape(server):
    headers = {"x-api-key": KEY}
    for body, fact in ((b"{nope", "not valid JSON"), ({"model": "m", "messages": user("hi")}, "max_tokens"),
                       ({"model": "m", "max_tokens": "5", "messages": user("hi")}, "max_tokens")):
        status, r, _ = post(server.url, body, key=None, path="/v1/messages", headers=headers)
        assert status == 400 and r["type"] == "error" and fact in r["error"]["message"], r
    status, r, _ = post(server.url, {}, key=None, path="/v1/messages/nowhere", headers=headers)
    assert status == 404 and r["error"]["type"] == "not_found_error"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/messages", headers=headers))
    assert e.value.code == 405 and json.loads(e.value.read())["type"] == "error"
    for extra, code in (({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 415),  # the guard's refusals
                        ({"Host": "evil.example"}, 403)):
        request = urllib.request.Request(f"{server.url}/v1/messages", data=b"{}", headers={**headers, **extra})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request)
        body = json.loads(e.value.read())
        assert e.value.code == code and body["type"] == "error" and body["error"]["type"] in (
            "invalid_request_error", "permission_error"), body


def test_a_missing_or_wrong_key_is_an_authentication_error(server):
    c = anthropic.Anthropic(base_url=server.url, api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.create(model="tiny", max_tokens=2, messages=user("hi"))
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    status, body, _ = post(server.url, {"model": "tiny", "max_tokens": 2, "messages": user("hi")}, key=None,
                           path="/v1/messages", headers={"anthropic-version": "2023-06-01"})
    assert status == 401 and body["error"]["type"] == "authentication_error" and "x-api-key" in body["error"]["message"]


# --- LangChain ---

def test_langchain_chat_anthropic(server):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    model = langchain_anthropic.ChatAnthropic(base_url=server.url, api_key=KEY, model="tiny", max_tokens=10)
    want = chat_completion(server.url, user("hello there"), max_tokens=10)["message"]["content"]
    assert model.invoke("hello there").content == want
    assert "".join(chunk.text for chunk in model.stream("hello there")) == want
