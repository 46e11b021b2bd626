"""OpenAI's chat and completions request schemas in full, the endpoints beside them
(/tokenize, /detokenize, /metrics) and errors in OpenAI's shape: the real server in a
subprocess, driven with raw HTTP and the official `openai` client.

Oracles: the SDK's own type definitions (every field its request schemas define, null
wherever they allow null), transformers' tokenizer for /tokenize and /detokenize,
`prometheus_client`'s parser for /metrics, jsonschema for tool-call arguments, and
`mlxinfer.stream_generate` in-process (itself proved against transformers) for outputs.
All traffic goes to 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import typing
import urllib.error
import urllib.request

import pytest

import mlxinfer
from serving import KEY, Server, post
from test_server import alone, text_of

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
from openai.types import completion_create_params as text_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402
from openai.types.chat import (  # noqa: E402
    chat_completion_assistant_message_param,
    chat_completion_function_message_param,
)

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
         "required": ["hour"], "additionalProperties": False}
FORECAST = {"name": "forecast", "description": "Weather", "parameters": WEATHER}
TOOLS = [{"type": "function", "function": FORECAST},
         {"type": "function", "function": {"name": "alarm", "description": "Set an alarm", "parameters": ALARM}}]
BASE = {"model": "m", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 4,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(roomy_server):
    return roomy_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def loaded_roomy(roomy):
    return mlxinfer.load(roomy, dtype="float32")


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def fields(typed_dict) -> dict[str, typing.Any]:
    return typing.get_type_hints(typed_dict)


def nullable(typed_dict) -> list[str]:
    """The fields of an SDK request type that may be null."""
    return [k for k, v in fields(typed_dict).items() if type(None) in typing.get_args(v)]


def http(url: str, path: str, method: str = "GET", body: dict | None = None, key: str | None = KEY):
    """(status, headers, raw body) of any request."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --- every field of the SDK's request schemas ---

# A value for every field of the chat request (`messages` and `model` aside): what an app sends.
SAMPLES = {
    "audio": {"audio": {"voice": "alloy", "format": "mp3"}},
    "frequency_penalty": {"frequency_penalty": 0.0},
    "function_call": {"function_call": "none"},
    "functions": {"functions": [FORECAST]},
    "logit_bias": {"logit_bias": {}},
    "logprobs": {"logprobs": False},
    "max_completion_tokens": {"max_completion_tokens": 4},
    "max_tokens": {"max_tokens": 4},
    "metadata": {"metadata": {"app": "test"}},
    "modalities": {"modalities": ["text"]},
    "moderation": {"moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}}},
    "n": {"n": 1},
    "parallel_tool_calls": {"parallel_tool_calls": True},
    "prediction": {"prediction": {"type": "content", "content": "once upon a time"}},
    "presence_penalty": {"presence_penalty": 0.0},
    "prompt_cache_key": {"prompt_cache_key": "user-7"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "text"}},
    "safety_identifier": {"safety_identifier": "hash-of-user"},
    "seed": {"seed": 1},
    "service_tier": {"service_tier": "auto"},
    "stop": {"stop": ["zzzz"]},
    "store": {"store": False},
    "stream_options": {"stream_options": {"include_usage": True, "include_obfuscation": False}},
    "temperature": {"temperature": 0},
    "tool_choice": {"tool_choice": "none"},
    "tools": {"tools": TOOLS, "tool_choice": "none"},
    "top_logprobs": {"top_logprobs": 2, "logprobs": True},
    "top_p": {"top_p": 1.0},
    "user": {"user": "user-7"},
    "verbosity": {"verbosity": "medium"},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
}
# Accepted and without effect on a greedy reply (OpenAI's bookkeeping, the default value, or a prediction:
# only the speed changes).
NO_OPS = {"frequency_penalty", "function_call", "logit_bias", "logprobs", "metadata", "modalities", "n",
          "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
          "prompt_cache_retention", "response_format", "safety_identifier", "service_tier", "store",
          "stream_options", "top_p", "user", "verbosity"}
# They change the output and cannot be honoured here: refused by name.
REFUSED = {"audio", "moderation", "web_search_options"}


def test_every_field_of_the_sdks_chat_request_is_accepted_or_refused_by_name(server):
    known = set(fields(chat_params.CompletionCreateParamsBase)) - {"messages", "model"}
    assert known <= set(SAMPLES), f"fields the SDK defines that this test does not try: {known - set(SAMPLES)}"
    status, plain, _ = post(server.url, BASE)
    assert status == 200, plain
    for name in sorted(known):
        status, body, _ = post(server.url, {**BASE, **SAMPLES[name]})
        if name in REFUSED or status != 200:
            assert status == 400 and body["error"]["param"] == name, (name, body)
            assert "unknown parameter" not in body["error"]["message"], (name, body)
            assert name not in NO_OPS, (name, body)
        elif name in NO_OPS:
            assert content(body) == content(plain), name


def test_null_wherever_the_sdk_allows_it(server):
    """Every field the SDK types as Optional, sent as null, is the same as leaving it out;
    so are the Optional fields of its assistant and function messages."""
    chat_nulls = {k: None for k in nullable(chat_params.CompletionCreateParamsBase)}
    chat_nulls["stream"] = None  # Optional[Literal[False]] in the non-streaming request
    status, plain, _ = post(server.url, BASE)
    status, body, _ = post(server.url, {**BASE, **{k: v for k, v in chat_nulls.items() if k not in BASE}})
    assert status == 200 and content(body) == content(plain), body

    text = {"model": "m", "prompt": "once upon a time", "max_tokens": 4, "temperature": 0}
    text_nulls = {k: None for k in nullable(text_params.CompletionCreateParamsBase) if k not in text}
    assert {"best_of", "echo", "suffix"} <= set(text_nulls)
    _, plain, _ = post(server.url, text, path="/v1/completions")
    status, body, _ = post(server.url, {**text, **text_nulls, "stream": None}, path="/v1/completions")
    assert status == 200 and body["choices"][0]["text"] == plain["choices"][0]["text"], body

    assistant = {k: None for k in nullable(chat_completion_assistant_message_param.ChatCompletionAssistantMessageParam)}
    function = {k: None for k in nullable(chat_completion_function_message_param.ChatCompletionFunctionMessageParam)}
    assert {"audio", "content", "function_call", "refusal"} <= set(assistant) and "content" in function
    history = [*BASE["messages"], {"role": "assistant", **assistant}, {"role": "function", "name": "f", **function},
               {"role": "user", "content": "and then?"}]
    status, body, _ = post(server.url, {**BASE, "messages": history})
    assert status == 200, body


def test_the_sdks_message_shapes_read_as_their_text(server, loaded_roomy):
    """Text parts (with cache breakpoints), a developer message, names, an earlier reply's
    refusal part, id, annotations and null audio: the reply is the one to the plain text."""
    shaped = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}], "name": "ops"},
        {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "hello ", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}},
            {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}], "refusal": None,
         "id": "msg_1", "annotations": [], "audio": None, "function_call": None, "name": "bot"},
        {"role": "user", "content": "go on"},
    ]
    plain = [{"role": "system", "content": "Be brief.", "name": "ops"},
             {"role": "user", "content": "hello there", "name": "ann"},
             {"role": "assistant", "content": "I can't.", "name": "bot"},
             {"role": "user", "content": "go on"}]
    status, body, _ = post(server.url, {**BASE, "messages": shaped, "max_tokens": 8})
    assert status == 200, body
    assert content(body) == text_of(alone(loaded_roomy, plain, max_tokens=8))


@pytest.mark.parametrize("change, param, fact", [
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]},
     "messages.0.content", "input_audio"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]},
     "messages.0.content", "file part"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
                   {"role": "user", "content": "hi"}]}, "messages.0.audio", "transcript"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output"),
    ({"verbosity": "low"}, "verbosity", "medium"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages.0.colour", "unknown parameter"),
    ({"tools": [{"type": "custom", "custom": {"name": "sql"}}]}, None, "custom tool"),
    ({"messages": [{"role": "function", "content": "42"}]}, "messages.0", "name of the function"),
    ({"function_call": {"name": "forecast"}}, "function_call", "needs functions"),
    ({"functions": [FORECAST], "tools": TOOLS}, "functions", "not both"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client, change, param, fact):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**BASE, **change})
    assert fact in e.value.message and e.value.param == param and e.value.status_code == 400


# --- legacy functions and allowed tools ---

def test_legacy_functions_are_called_and_answered_in_the_legacy_shape(client, loaded_roomy):
    """`functions` + `function_call` (the API before tools): the call comes back as
    `message.function_call` (finish_reason "function_call"), the same call a named tool
    choice makes, streamed as `delta.function_call`; sent back with a `function` message,
    the history reads as the tool call and tool reply it stands for."""
    ask = dict(BASE, messages=[{"role": "user", "content": "weather?"}], max_tokens=60,
               functions=[FORECAST], function_call={"name": "forecast"})
    r = client.chat.completions.create(**ask)
    want = alone(loaded_roomy, ask["messages"], max_tokens=60, tools=[TOOLS[0]], parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "forecast"}})[-1]
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "forecast"
    arguments = json.loads(choice.message.function_call.arguments)
    assert arguments == want.tool_calls[0].arguments
    jsonschema.validate(arguments, WEATHER)

    events = list(client.chat.completions.create(**ask, stream=True))
    calls = [e.choices[0].delta.function_call for e in events if e.choices and e.choices[0].delta.function_call]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("forecast", arguments)]
    assert events[-1].choices[0].finish_reason == "function_call"

    history = [*ask["messages"], choice.message.model_dump(),
               {"role": "function", "name": "forecast", "content": "sunny"}]
    again = client.chat.completions.create(**{**ask, "messages": history, "function_call": "none", "max_tokens": 6})
    modern = [*ask["messages"],
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "fn0000001", "type": "function",
                   "function": {"name": "forecast", "arguments": choice.message.function_call.arguments}}]},
              {"role": "tool", "content": "sunny", "name": "forecast", "tool_call_id": "fn0000001"}]
    assert again.choices[0].message.content == text_of(alone(loaded_roomy, modern, max_tokens=6, tools=[TOOLS[0]],
                                                             tool_choice="none", parallel_tool_calls=False))


def test_allowed_tools_limit_the_call_to_the_tools_named(client, loaded_roomy):
    """tool_choice {"type": "allowed_tools"}: every tool is shown, the call names one of
    those allowed ("required": as a named choice of that one would)."""
    messages = [{"role": "user", "content": "wake me"}]
    allowed = {"type": "allowed_tools",
               "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "alarm"}}]}}
    r = client.chat.completions.create(**{**BASE, "messages": messages, "max_tokens": 40, "tools": TOOLS,
                                          "tool_choice": allowed})
    want = alone(loaded_roomy, messages, max_tokens=40, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "alarm"}})[-1]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "alarm" and json.loads(call.function.arguments) == want.tool_calls[0].arguments
    jsonschema.validate(json.loads(call.function.arguments), ALARM)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**BASE, "tools": TOOLS, "tool_choice": {
            "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function",
                                                                                      "function": {"name": "nope"}}]}}})
    assert "'nope'" in e.value.message


# --- errors in OpenAI's shape ---

def test_404_405_and_route_errors_are_in_openais_shape(server, client):
    status, headers, raw = http(server.url, "/v1/chat/completions", "GET")
    error = json.loads(raw)["error"]
    assert status == 405 and {k.lower(): v for k, v in headers.items()}["allow"] == "POST"
    assert error["type"] == "invalid_request_error" and "use POST" in error["message"]
    for path, method in (("/v1/nothing", "POST"), ("/v2/chat/completions", "GET"), ("/tokenize", "GET")):
        status, _, raw = http(server.url, path, method, {} if method == "POST" else None)
        assert status in (404, 405) and set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}, raw
    with pytest.raises(openai.NotFoundError) as e:
        client.post("/nothing/here", cast_to=object, body={})
    assert e.value.body["type"] == "invalid_request_error" and "/v1/nothing/here" in e.value.message  # as OpenAI answers


def test_a_typed_route_parameter_error_is_a_400_in_openais_shape(loaded):
    """A FastAPI validation error (a route with typed parameters) answers as OpenAI's
    errors do, naming the parameter."""
    from fastapi.testclient import TestClient

    from mlxinfer.serve.engine_thread import EngineThread
    from mlxinfer.engine.batch import BatchGenerator
    from mlxinfer.serve.app import ServerConfig, create_app
    from mlxinfer.serve.models import Models, Served

    engine = EngineThread(BatchGenerator(*loaded))
    try:
        app = create_app(Models.of(Served("tiny", engine, *loaded, 64, "tiny", 0, 0.0)), ServerConfig())

        @app.get("/v1/typed")
        async def typed(count: int):
            return {"count": count}

        with TestClient(app, base_url="http://127.0.0.1") as c:
            r = c.get("/v1/typed", params={"count": "many"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "count"
            assert "integer" in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
            assert c.get("/v1/typed", params={"count": "3"}).json() == {"count": 3}
    finally:
        engine.stop()


# --- /tokenize and /detokenize ---

@pytest.fixture(scope="module")
def llama31(hf_checkpoint, llama31_tokenizer, tmp_path_factory):
    """The tiny Llama with Llama 3.1's real tokenizer (a BOS, byte-level BPE, a chat template)."""
    folder = tmp_path_factory.mktemp("llama31") / "model"
    shutil.copytree(hf_checkpoint("llama", head_dim=32, vocab_size=128256, max_position_embeddings=2048), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama31_tokenizer / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tokenizing(llama31):
    s = Server(["-m", str(llama31), "--dtype", "float32", "--api-key", KEY])
    yield s
    s.stop()


def test_tokenize_as_llama_cpp_and_vllm_clients_call_it(tokenizing, llama31):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama31)
    text = "Hello world, naïve café 東京!"
    tokenize = lambda body: post(tokenizing.url, body, path="/tokenize")  # noqa: E731

    status, r, _ = tokenize({"content": text})  # llama.cpp: no BOS unless asked
    assert status == 200 and r["tokens"] == hf.encode(text, add_special_tokens=False)
    assert tokenize({"content": text, "add_special": True})[1]["tokens"] == hf.encode(text)
    status, r, _ = tokenize({"prompt": text, "model": "any"})  # vLLM: BOS unless told not to
    assert r["tokens"] == hf.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    assert tokenize({"prompt": text, "add_special_tokens": False})[1]["tokens"] == hf.encode(text,
                                                                                            add_special_tokens=False)
    r = tokenize({"prompt": text, "return_token_strs": True})[1]
    assert r["token_strs"] == hf.convert_ids_to_tokens(hf.encode(text))
    pieces = tokenize({"content": "Hello world", "with_pieces": True})[1]["tokens"]
    ids = hf.encode("Hello world", add_special_tokens=False)
    assert pieces == [{"id": i, "piece": hf.decode([i])} for i in ids]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    status, r, _ = tokenize({"messages": messages})
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert status == 200 and r["tokens"] == hf.encode(rendered, add_special_tokens=False)
    chat = post(tokenizing.url, {"messages": messages, "max_tokens": 1})[1]
    assert chat["usage"]["prompt_tokens"] == r["count"]

    for ids in (hf.encode(text), hf.encode(text, add_special_tokens=False)):
        status, r, _ = post(tokenizing.url, {"tokens": ids}, path="/detokenize")
        assert status == 200 and r["content"] == r["prompt"] == hf.decode(ids)


@pytest.mark.parametrize("path, body, fact", [
    ("/tokenize", {"content": "a", "prompt": "b"}, "send one of"),
    ("/tokenize", {}, "send one of"),
    ("/tokenize", {"content": "a", "tools": TOOLS}, "send messages"),
    ("/tokenize", {"content": "a", "parse_special": False}, "parse_special"),
    ("/tokenize", {"content": "a", "colour": 1}, "unknown parameter 'colour'"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "not a token id"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
])
def test_tokenize_refusals_name_the_problem(server, path, body, fact):
    status, r, _ = post(server.url, body, path=path)
    assert status == 400 and fact in r["error"]["message"], r


def test_tokenize_counts_a_chat_with_tools_as_the_completion_prefills_it(server):
    messages = [{"role": "user", "content": "weather?"}]
    status, r, _ = post(server.url, {"messages": messages, "tools": TOOLS}, path="/tokenize")
    chat = post(server.url, {**BASE, "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})[1]
    assert status == 200 and r["count"] == chat["usage"]["prompt_tokens"]
    assert r["count"] > post(server.url, {"messages": messages}, path="/tokenize")[1]["count"]


def test_the_extra_endpoints_need_the_key(server):
    for path, method, body in (("/tokenize", "POST", {"content": "a"}), ("/detokenize", "POST", {"tokens": [1]}),
                               ("/metrics", "GET", None)):
        status, _, raw = http(server.url, path, method, body, key=None)
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"


# --- /metrics ---

def scrape(server) -> dict:
    """{(sample name, frozenset of labels): value}, read by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, raw = http(server.url, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    families = list(text_string_to_metric_families(raw.decode()))
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def test_metrics_count_requests_tokens_and_latencies(server, client):
    before = scrape(server)
    messages = [{"role": "user", "content": "count these tokens"}]
    one = client.chat.completions.create(**{**BASE, "messages": messages, "max_tokens": 5})
    streamed = list(client.chat.completions.create(**{**BASE, "messages": messages, "max_tokens": 7}, stream=True,
                                                   stream_options={"include_usage": True}))
    two = streamed[-1].usage
    follow = [*messages, {"role": "assistant", "content": one.choices[0].message.content},
              {"role": "user", "content": "more"}]
    three = client.chat.completions.create(**{**BASE, "messages": follow, "max_tokens": 3})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**BASE, "temperature": -1})
    after = scrape(server)
    health = server.health()

    def delta(name: str, **labels) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0) - before.get(key, 0)

    route = dict(route="/v1/chat/completions", method="POST")
    assert delta("mlxinfer_http_requests_total", **route, status="200") == 3
    assert delta("mlxinfer_http_requests_total", **route, status="400") == 1
    usages = [one.usage, two, three.usage]
    assert delta("mlxinfer_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("mlxinfer_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("mlxinfer_prefill_tokens_total") == \
        sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("mlxinfer_prompt_cache_hits_total") >= 1 and three.usage.prompt_tokens_details.cached_tokens > 0
    observed = {"mlxinfer_time_to_first_token_seconds": 3,  # a time per token needs a second token
                "mlxinfer_time_per_output_token_seconds": sum(u.completion_tokens > 1 for u in usages)}
    for histogram, count in observed.items():
        assert delta(f"{histogram}_count") == count and delta(f"{histogram}_sum") > 0
        buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in after.items()
                         if name == f"{histogram}_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"),
                                                                                             after[(f"{histogram}_count",
                                                                                                    frozenset())])
    assert after[("mlxinfer_requests_running", frozenset())] == 0
    assert after[("mlxinfer_requests_waiting", frozenset())] == 0
    assert after[("mlxinfer_kv_cache_bytes", frozenset())] == health["cache_bytes"]
    assert after[("mlxinfer_prompt_cache_bytes", frozenset())] == health["prompt_cache"]["nbytes"] > 0
    assert delta("mlxinfer_http_requests_total", route="/v1/models/{name}", method="GET", status="404") == 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert scrape(server)[("mlxinfer_http_requests_total", frozenset(
        dict(route="/v1/models/{name}", method="GET", status="404").items()))] >= 1
    # n choices share one prompt: it counts once, as in the response's usage
    four = client.chat.completions.create(**{**BASE, "messages": messages, "max_tokens": 2, "n": 2})
    last = scrape(server)
    assert last[("mlxinfer_prompt_tokens_total", frozenset())] - after[("mlxinfer_prompt_tokens_total", frozenset())] \
        == four.usage.prompt_tokens
    assert last[("mlxinfer_generation_tokens_total", frozenset())] \
        - after[("mlxinfer_generation_tokens_total", frozenset())] == four.usage.completion_tokens
