"""OpenAI's Responses API (`/v1/responses`) driven as its users drive it: the official
`openai` client (create, stream, parse, retrieve, delete), openai-agents, pydantic-ai and
LangChain on their default settings, against the real server in a subprocess.

Random weights write garbage, so a reply's text is checked against an oracle: the same
conversation through `/v1/chat/completions` (greedy, the same template), itself proved
against the engine run in-process (tests/test_server.py). Tool calls and structured
output are held to their schema by the grammar, and checked with jsonschema. The event
stream is read by the SDK's own accumulator, which refuses an event out of its place."""

from __future__ import annotations

import json
import shutil
from typing import Annotated, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from serving import KEY, Server, post

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
FORECAST = {"type": "function", "name": "forecast", "description": "Weather", "parameters": WEATHER, "strict": True}
CHAT_FORECAST = {"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": WEATHER}}


class Forecast(BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(roomy_server):
    """The tiny Llama with room for tool listings and a few turns in its context (conftest)."""
    return roomy_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def terse(roomy, tmp_path_factory):
    """A server of `roomy` whose end-of-turn token weighs more, so some greedy replies end by
    themselves: openai-agents takes a reply cut by its token limit for a failure."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path_factory.mktemp("terse")
    shutil.copytree(roomy, folder, dirs_exist_ok=True)
    weights = load_file(str(roomy / "model.safetensors"))
    head = weights["lm_head.weight"].copy()
    head[json.loads((roomy / "tokenizer.json").read_text())["added_tokens"][2]["id"]] *= 1.6  # <|im_end|>
    save_file({**weights, "lm_head.weight": head}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    s = Server(["-m", str(folder), "--dtype", "float32"])
    yield s
    s.stop()


def ending(client, system: str | None = None, limit: int = 60) -> tuple[str, str]:
    """(a prompt, its greedy reply) where the reply is a few tokens that end by themselves, as
    the chat endpoint (the oracle) answers it."""
    head = [{"role": "system", "content": system}] if system else []
    for prompt in ("once upon", "what is up", "the quick brown", "and then?", "hello there", "weather?", "hi"):
        c = client.chat.completions.create(model="m", messages=[*head, *user(prompt)], max_tokens=limit,
                                           temperature=0)
        if c.choices[0].finish_reason == "stop" and c.usage.completion_tokens > 2:
            return prompt, c.choices[0].message.content
    pytest.fail("no candidate prompt has a greedy reply that ends by itself")


def chat(client, messages: list[dict], **kwargs):
    """The oracle: the same conversation as a greedy chat completion."""
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kwargs).choices[0]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- text, instructions, usage, incomplete ---

def test_text_equals_the_chat_completion(client):
    r = client.responses.create(model="m", input="hello there", max_output_tokens=12)
    want = chat(client, user("hello there"), max_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [p.type for p in message.content] == ["output_text"]
    assert r.output_text == message.content[0].text == want.message.content
    if want.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    usage = client.chat.completions.create(model="m", messages=user("hello there"), max_tokens=12).usage
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_a_cut_reply_is_incomplete(client):
    r = client.responses.create(model="m", input="tell me a long story", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_instructions_and_message_items_are_the_chat_messages(client):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "input_text", "text": "what is "}, {"type": "input_text",
                                                                                       "text": "up"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "not much",
                                                                   "annotations": []}]},
             {"role": "user", "content": "and then?"}]
    r = client.responses.create(model="m", instructions="You are terse.", input=items, max_output_tokens=8)
    want = chat(client, [{"role": "system", "content": "You are terse."}, {"role": "system", "content":
                                                                           "Answer briefly."},
                         *user("what is up"), {"role": "assistant", "content": "not much"}, *user("and then?")],
                max_tokens=8)
    assert r.output_text == want.message.content and r.instructions == "You are terse."


def test_input_tokens_counts_what_create_reads(client):
    """`responses.input_tokens.count`, as the SDK sends it, equals the usage of the same create
    call: with instructions and tools, and continuing a stored response."""
    ask = dict(model="m", instructions="You are terse.", input="what is up", tools=[FORECAST])
    counted = client.responses.input_tokens.count(**ask)
    created = client.responses.create(**ask, tool_choice="none", max_output_tokens=1)
    assert counted.object == "response.input_tokens" and counted.input_tokens == created.usage.input_tokens
    more = client.responses.input_tokens.count(model="m", previous_response_id=created.id, input="and then?")
    again = client.responses.create(model="m", previous_response_id=created.id, input="and then?", max_output_tokens=1)
    assert more.input_tokens == again.usage.input_tokens
    plain = client.responses.input_tokens.count(model="m", input="what is up")
    assert plain.input_tokens == client.chat.completions.create(model="m", messages=user("what is up"),
                                                                max_tokens=1).usage.prompt_tokens


# --- streaming ---

def test_stream_events_in_openais_order(client):
    want = client.responses.create(model="m", input="once upon", max_output_tokens=10)
    events = list(client.responses.create(model="m", input="once upon", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{want.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == want.output_text
    final = events[-1].response
    assert final.output_text == want.output_text and final.status == want.status
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert {d.item_id for d in deltas} == {final.output[0].id}


def test_the_sdks_stream_helper_accumulates_the_same_response(client):
    want = client.responses.create(model="m", input="the quick brown", max_output_tokens=10)
    with client.responses.stream(model="m", input="the quick brown", max_output_tokens=10) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == want.output_text
    assert final.usage.output_tokens == want.usage.output_tokens


def test_streamed_events_are_named(server):
    """Each event's `event:` line names its type (as OpenAI's stream does)."""
    import urllib.request

    body = json.dumps({"input": "hi", "max_output_tokens": 3, "stream": True}).encode()
    request = urllib.request.Request(f"{server.url}/v1/responses", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event == f"event: {json.loads(data.removeprefix('data: '))['type']}"


# --- structured output ---

def test_json_schema_format_is_held_to_the_schema(client):
    fmt = {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}
    r = client.responses.create(model="m", input="the weather please", text={"format": fmt}, max_output_tokens=40)
    want = chat(client, user("the weather please"), max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER,
                                                                        "strict": True}})
    assert r.output_text == want.message.content
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema" and r.text.format.name == "forecast"
    streamed = list(client.responses.create(model="m", input="the weather please", text={"format": fmt},
                                            max_output_tokens=40, stream=True))
    assert streamed[-1].response.output_text == r.output_text


def test_json_object_format(client):
    r = client.responses.create(model="m", input="some json", text={"format": {"type": "json_object"}},
                                max_output_tokens=30)
    assert r.output_text == chat(client, user("some json"), max_tokens=30,
                                 response_format={"type": "json_object"}).message.content


def test_parse_with_a_pydantic_text_format(client):
    r = client.responses.parse(model="m", input="the weather please", text_format=Forecast, max_output_tokens=40)
    assert isinstance(r.output_parsed, Forecast)
    assert r.output_parsed == Forecast.model_validate_json(r.output_text)


# --- tools ---

def test_function_call_and_its_output_round_trip(client):
    ask = dict(model="m", input="weather?", tools=[FORECAST], tool_choice="required", max_output_tokens=60)
    r = client.responses.create(**ask)
    want = chat(client, user("weather?"), tools=[CHAT_FORECAST], tool_choice="required", max_tokens=60)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "forecast" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments == json.loads(want.message.tool_calls[0].function.arguments)
    assert r.tools[0].name == "forecast" and r.tool_choice == "required"

    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(events[-1].response.output[0].arguments) == arguments

    single = client.responses.create(**ask, parallel_tool_calls=False)
    assert [o.type for o in single.output] == ["function_call"] and single.parallel_tool_calls is False
    named = client.responses.create(**{**ask, "tool_choice": {"type": "function", "name": "forecast"}})
    assert named.output[0].name == "forecast"
    formatted = client.responses.create(**ask, text={"format": {"type": "json_object"}})  # a call is not text
    assert formatted.output[0].arguments == call.arguments

    # the call and its output sent back, as an agent loop does
    follow = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    again = client.responses.create(model="m", input=follow, tools=[FORECAST], tool_choice="none",
                                    max_output_tokens=6)
    assert [o.type for o in again.output] == ["message"]
    oracle = chat(client, [*user("weather?"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "forecast", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "forecast", "content": "sunny"}],
        tools=[CHAT_FORECAST], tool_choice="none", max_tokens=6)
    assert again.output_text == oracle.message.content


def test_with_tools_and_a_format_a_reply_is_a_call_or_the_formats_json(client):
    """An agent with tools and a structured answer (openai-agents' tools with an output_type)."""
    fmt = {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}
    r = client.responses.create(model="m", input="weather?", tools=[FORECAST], text={"format": fmt},
                                max_output_tokens=60)
    want = chat(client, user("weather?"), tools=[CHAT_FORECAST], max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER}})
    (item,) = r.output
    if item.type == "function_call":
        assert json.loads(item.arguments) == json.loads(want.message.tool_calls[0].function.arguments)
    else:
        assert r.output_text == want.message.content and r.status == "completed"
    jsonschema.validate(json.loads(item.arguments if item.type == "function_call" else r.output_text), WEATHER)


def test_with_tool_choice_auto_the_stream_says_what_the_whole_reply_says(client):
    """Text that may open a call is held back until it is known: streamed or not, the reply
    is the same items (a call, or text)."""
    ask = dict(model="m", input="weather?", tools=[FORECAST], max_output_tokens=30)

    def said(output) -> list:
        return [(o.type, o.content[0].text if o.type == "message" else (o.name, o.arguments)) for o in output]

    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    assert said(events[-1].response.output) == said(whole.output)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "".join(o.content[0].text for o in whole.output if o.type == "message")
    want = chat(client, user("weather?"), tools=[CHAT_FORECAST], max_tokens=30)
    assert [o.type for o in whole.output] == (["function_call"] if want.message.tool_calls else ["message"])


# --- the store: previous_response_id, retrieve, delete, input items ---

def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="m", input="hello there", instructions="Be kind.", max_output_tokens=6)
    second = client.responses.create(model="m", input="and then?", previous_response_id=first.id,
                                     max_output_tokens=6)
    want = chat(client, [*user("hello there"), {"role": "assistant", "content": first.output_text},
                         *user("and then?")], max_tokens=6)
    assert second.output_text == want.message.content  # instructions are not carried over (as OpenAI)
    assert second.previous_response_id == first.id
    streamed = list(client.responses.create(model="m", input="and then?", previous_response_id=first.id,
                                            max_output_tokens=6, stream=True))
    assert streamed[-1].response.output_text == want.message.content


def test_retrieve_list_input_items_and_delete(client):
    r = client.responses.create(model="m", input=[{"role": "user", "content": "hi"}], max_output_tokens=4,
                                metadata={"app": "test"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"app": "test"}
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hi")]
    more = client.responses.create(model="m", input="and?", previous_response_id=r.id, max_output_tokens=2)
    items = list(client.responses.input_items.list(more.id, order="asc", limit=1))  # the SDK pages through them
    assert [(i.role, i.content[0].text) for i in items] == [("user", "hi"), ("assistant", r.output_text),
                                                            ("user", "and?")]
    assert [i.id for i in client.responses.input_items.list(more.id).data] == [i.id for i in items][::-1]
    assert items[1].id == r.output[0].id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert r.id in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_item_reference_names_a_stored_item(client):
    first = client.responses.create(model="m", input="hello there", max_output_tokens=5)
    r = client.responses.create(model="m", input=[{"role": "user", "content": "hello there"},
                                                  {"type": "item_reference", "id": first.output[0].id},
                                                  {"role": "user", "content": "and?"}], max_output_tokens=5)
    want = chat(client, [*user("hello there"), {"role": "assistant", "content": first.output_text}, *user("and?")],
                max_tokens=5)
    assert r.output_text == want.message.content


def test_the_store_keeps_the_most_recent(roomy):
    s = Server(["-m", str(roomy), "--dtype", "float32", "--responses-store", "2"])
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ids = [c.responses.create(model="m", input=f"turn {i}", max_output_tokens=1).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    finally:
        s.stop()



def get(url: str) -> tuple[int, bytes]:
    """(status, body) of a raw GET with the API key."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("query, param", [
    ("limit=%C2%B2", "limit"),  # a Unicode digit (²): str.isdigit says yes, int() says no
    ("limit=-1", "limit"), ("limit=abc", "limit"), ("limit=0", "limit"), ("limit=101", "limit"),
    ("order=sideways", "order"), ("after=msg_nope", "after"),
])
def test_input_items_queries_out_of_openais_range_are_400_naming_the_parameter(server, client, query, param):
    """OpenAI's `limit` is 1 to 100, `order` asc or desc, `after` an item of the list."""
    r = client.responses.create(model="m", input="hi", max_output_tokens=1)
    status, body = get(f"{server.url}/v1/responses/{r.id}/input_items?{query}")
    assert status == 400, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"]


REASONING_TEXT = 20_000  # characters of thinking in each response of the bytes test: ~20 KB stored


def thinking_input(text: str, n: int = REASONING_TEXT) -> list[dict]:
    """An input whose bulk is an earlier reasoning item (kept by the store, left out of the prompt)."""
    return [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t" * n}]}, *user(text)]


def test_the_store_is_bounded_in_bytes(roomy):
    """Two responses of ~20 KB fit in 64 KiB, a third evicts the oldest; one over the bound alone is
    answered and not kept; what is kept comes back as it was sent."""
    s = Server(["-m", str(roomy), "--dtype", "float32", "--responses-store-bytes", "64KiB"])
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ids = [c.responses.create(model="m", input=thinking_input(f"turn {i}"), max_output_tokens=1).id
               for i in range(4)]
        for evicted in ids[:2]:
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(evicted)
        assert [c.responses.retrieve(i).id for i in ids[2:]] == ids[2:]
        reasoning, message = c.responses.input_items.list(ids[-1], order="asc").data
        assert reasoning.summary[0].text == "t" * REASONING_TEXT and message.content[0].text == "turn 3"
        huge = c.responses.create(model="m", input=thinking_input("hi", 70_000), max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(huge.id)
        assert c.responses.retrieve(ids[-1]).id == ids[-1]  # the huge one evicted nothing
    finally:
        s.stop()


def test_continuing_an_evicted_response_is_openais_previous_response_not_found(roomy):
    """A chain longer than the store: the oldest responses are gone, and continuing one is the
    400 OpenAI gives (code previous_response_not_found); the latest still continues."""
    s = Server(["-m", str(roomy), "--dtype", "float32", "--responses-store", "2"])
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ids: list[str] = []
        for i in range(5):
            ids.append(c.responses.create(model="m", input=thinking_input(f"turn {i}", 2_000), max_output_tokens=1,
                                          previous_response_id=ids[-1] if ids else None).id)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="m", input="and?", previous_response_id=ids[0], max_output_tokens=1)
        assert e.value.code == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
        assert ids[0] in e.value.message
        latest = c.responses.create(model="m", input="and?", previous_response_id=ids[-1], max_output_tokens=1)
        items = list(c.responses.input_items.list(latest.id, order="asc"))
        assert [i.content[0].text for i in items if i.type == "message" and i.role == "user"] == \
            [*(f"turn {i}" for i in range(5)), "and?"]
    finally:
        s.stop()


def test_item_references_stand_for_no_more_than_a_body_may_send(server, client):
    """A reference names a stored item instead of sending it: 50 references to a 100 KB item would
    be a 5 MB input from a 3 KB body. What references name together is bounded as a body is (4 MiB)."""
    stored = client.responses.create(model="m", input=[{**thinking_input("hi", 100_000)[0], "id": "rs_big"},
                                                       *user("hi")], max_output_tokens=1)
    assert stored.status in ("completed", "incomplete")
    few = client.responses.create(model="m", input=[{"type": "item_reference", "id": "rs_big"}] * 5 + user("hi"),
                                  max_output_tokens=1)
    assert few.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"type": "item_reference", "id": "rs_big"}] * 50 + user("hi"),
                                max_output_tokens=1)
    assert e.value.body["param"] == "input" and "item_references" in e.value.message

def rss(pid: int) -> int:
    """A process's resident memory in bytes (`ps`, as on Linux and macOS alike)."""
    import subprocess

    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                              check=True).stdout) * 1024


def test_stored_responses_stay_within_the_stores_bound_in_memory(roomy):
    """A reasoning item of 90,000 `{}` is 270 KB of JSON but 6.5 MB as Python objects: kept as
    objects, 24 such responses would grow the server by ~150 MB. The store keeps JSON and
    counts it: the server grows by about its 4 MiB bound (and noise)."""
    s = Server(["-m", str(roomy), "--dtype", "float32", "--responses-store-bytes", "4MiB"])
    try:
        body = {"model": "m", "input": [{"type": "reasoning", "summary": [{}] * 90_000}, *user("hi")],
                "max_output_tokens": 1}
        for _ in range(2):  # the first requests warm up (compiling, caches, the allocator's arenas)
            assert post(s.url, body, key=None, path="/v1/responses")[0] == 200
        before = rss(s.proc.pid)
        for _ in range(24):
            assert post(s.url, body, key=None, path="/v1/responses")[0] == 200
        grown = rss(s.proc.pid) - before
        assert grown < 48 << 20, f"the server grew by {grown >> 20} MiB"
    finally:
        s.stop()


def test_the_store_counts_at_least_what_it_holds():
    """The store's count of its bytes (`Store.nbytes`, what --responses-store-bytes bounds) is
    no less than the memory it holds, as tracemalloc measures it, for hostile shapes of item."""
    import gc
    import tracemalloc

    from mlxinfer.serve.openai_schema import parse
    from mlxinfer.serve.responses import Store, Stored, turn_of
    from mlxinfer.serve.responses_schema import CreateResponse

    shapes = {"many empty objects": [{"type": "reasoning", "summary": [{}] * 90_000}, *user("x")],
              "many small messages": user("hi") * 20_000, "one long text": "x " * 1_000_000}
    for shape, items in shapes.items():
        raw = json.dumps({"input": items}).encode()
        store = Store(256, 1 << 40)
        gc.collect()
        tracemalloc.start()
        try:
            for k in range(3):
                turn = turn_of(store, parse(raw, CreateResponse), 4 << 20)
                output = [{"id": f"msg_out{k}", "type": "message", "role": "assistant", "status": "completed",
                           "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}]}]
                store.put(f"resp_{k}", Stored.of({"id": f"resp_{k}", "object": "response", "output": output}, turn))
                del turn
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert held <= store.nbytes * 1.1 + (64 << 10), (shape, held, store.nbytes)


# --- what is accepted, and what is refused by name ---

def test_openais_no_op_fields_are_accepted_and_change_nothing(client):
    plain = client.responses.create(model="m", input="what is up", max_output_tokens=6).output_text
    r = client.responses.create(model="m", input="what is up", max_output_tokens=6, store=True, metadata={"a": "b"},
                                user="u", service_tier="auto", safety_identifier="s", prompt_cache_key="k",
                                truncation="disabled", include=["reasoning.encrypted_content"],
                                reasoning={"effort": "medium"}, text={"verbosity": "low"})
    assert r.output_text == plain


def test_logprobs_when_included(client):
    r = client.responses.create(model="m", input="hello", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    logprobs = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs).startswith(r.output_text)
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6 for lp in logprobs)
    want = client.chat.completions.create(model="m", messages=user("hello"), max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in want], abs=1e-5)


@pytest.mark.parametrize("body, param, fact", [
    ({"input": "x", "n": 2}, "n", "unknown parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "AA=="}]}]},
     "input", "text and images"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input", "file store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "function tools only"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input", "computer_call_output"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": []}, "input", "empty"),
    ({"input": "x", "temperature": "hot"}, "temperature", "temperature"),
    ({"input": "x", "tools": [FORECAST], "max_tool_calls": 2}, "max_tool_calls", "1"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, fact):
    status, reply, _ = post(server.url, body, path="/v1/responses")
    assert status == 400, reply
    assert reply["error"]["param"].startswith(param) and fact in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) |
                           st.text(max_size=20), lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.sampled_from(["type", "role", "content", "name", "id", "call_id",
                                                            "output", "text", "format", "schema", "mode", "tools"]) |
                                           st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "include", "reasoning", "previous_response_id",
          "temperature", "top_p", "max_output_tokens", "top_logprobs", "parallel_tool_calls", "max_tool_calls",
          "metadata", "store", "truncation", "stream_options", "conversation", "prompt", "user", "model"]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_no_body_makes_the_server_fail(server, field, value):
    """Any value in any field: a 200 or a 4xx in OpenAI's shape, never a 5xx."""
    body = {"input": "hi", "max_output_tokens": 2, field: value}
    if field == "max_output_tokens" and isinstance(value, int) and not isinstance(value, bool):
        body[field] = min(value, 2)
    status, reply, _ = post(server.url, json.dumps(body).encode(), path="/v1/responses")
    assert status == 200 or (400 <= status < 500 and set(reply["error"]) >= {"message", "type"}), (status, reply)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_an_unknown_response_is_404_in_openais_shape(server, method):
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/responses/resp_nope", method=method,
                                                      headers={"Authorization": f"Bearer {KEY}"}), timeout=60)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 404 and "resp_nope" in error["message"] and error["type"] == "invalid_request_error"


# --- frameworks on their default settings ---

def test_openai_agents_text_tool_and_output_type(terse):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    sync = openai.OpenAI(base_url=f"{terse.url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel("m", openai.AsyncOpenAI(base_url=f"{terse.url}/v1", api_key="unused",
                                                                max_retries=0))
    prompt, want = ending(sync, "Be brief.")
    result = agents.Runner.run_sync(agents.Agent(name="a", instructions="Be brief.", model=model), prompt)
    assert result.final_output == want

    calls = []

    @agents.function_tool
    def forecast(unit: Literal["celsius", "fahrenheit"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather for the next days."""
        calls.append((unit, days))
        return "sunny"

    tooled = agents.Agent(name="t", model=model, tools=[forecast], tool_use_behavior="stop_on_first_tool",
                          model_settings=agents.ModelSettings(tool_choice="required"))
    result = agents.Runner.run_sync(tooled, "weather?")
    assert result.final_output == "sunny" and len(calls) == 1 and 1 <= calls[0][1] <= 7

    typed = agents.Agent(name="o", model=model, output_type=Forecast)
    result = agents.Runner.run_sync(typed, "weather?")
    assert isinstance(result.final_output, Forecast)

    both = agents.Agent(name="b", model=model, tools=[forecast], output_type=Forecast)  # a call, or the answer
    result = agents.Runner.run_sync(both, "weather?")
    assert isinstance(result.final_output, Forecast)


def test_openai_agents_through_the_default_client(terse):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    prompt, want = ending(openai.OpenAI(base_url=f"{terse.url}/v1", api_key="unused", max_retries=0))
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{terse.url}/v1", api_key="unused",
                                                        max_retries=0), use_for_tracing=False)
    try:
        result = agents.Runner.run_sync(agents.Agent(name="a", model="m"), prompt)
        assert result.final_output == want
    finally:
        agents.set_default_openai_client(openai.AsyncOpenAI(api_key="unused"), use_for_tracing=False)


def test_pydantic_ai_responses_model(server, client):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel("m", provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key=KEY))
    result = Agent(model, model_settings={"max_tokens": 8}).run_sync("hello there")
    assert result.output == chat(client, user("hello there"), max_tokens=8).message.content
    typed = Agent(model, output_type=Forecast, model_settings={"max_tokens": 60}).run_sync("weather?")
    assert isinstance(typed.output, Forecast)


def test_langchain_chat_openai_with_the_responses_api(server, client):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=f"{server.url}/v1", api_key=KEY, use_responses_api=True,
                     max_tokens=8, max_retries=0)
    reply = llm.invoke("hello there")
    assert reply.text == chat(client, user("hello there"), max_tokens=8).message.content
    assert reply.usage_metadata["output_tokens"] <= 8


# --- reasoning items (a thinking model's chunks; the reasoning split itself is tested with its engine) ---

def test_thinking_streams_as_a_reasoning_item_before_the_message():
    """The engine's chunks of a reply that thinks and then answers, written out as events and
    read back by the SDK's own accumulator (which refuses an event out of its place)."""
    import asyncio

    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from mlxinfer.serve.openai_schema import parse
    from mlxinfer.serve.responses import Reply
    from mlxinfer.serve.responses_schema import CreateResponse
    from mlxinfer.decode.sources import Stats
    from mlxinfer.engine.text_stream import Chunk

    stats = Stats(prompt_tokens=5, prefill_tokens=5, generated_tokens=6)
    parts = [("", "Let me"), ("", " think."), ("", ""), ("Hi", ""), ("", ""), ("!", "")]
    chunks = [Chunk(text, i, -0.5, "stop" if i == len(parts) - 1 else None, stats, reasoning=thought)
              for i, (text, thought) in enumerate(parts)]
    reply = Reply(body=parse(b'{"input": "hi"}', CreateResponse), model="m", tokenizer=None, opener=None)

    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def written() -> list[bytes]:
        return [event async for event in reply.events(chunks[0], rest(), kept.append)]

    kept: list[dict] = []
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    events = []
    for block in asyncio.run(written()):
        data = json.loads(block.decode().split("data: ", 1)[1])
        events.append(data["type"])
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    assert events == ["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added",
                      "response.reasoning_text.delta", "response.reasoning_text.delta",
                      "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                      "response.output_item.added", "response.content_part.added",
                      "response.output_text.delta", "response.output_text.delta",
                      "response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.completed"]
    final = state._completed_response
    thinking, message = final.output
    assert thinking.type == "reasoning" and thinking.content[0].text == "Let me think." and thinking.summary == []
    assert message.type == "message" and final.output_text == "Hi!"
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    (stored,) = kept  # the streamed response is the one stored, and the same as the whole one
    assert stored["id"] == final.id and stored["output"] == reply.whole(chunks)["output"]
