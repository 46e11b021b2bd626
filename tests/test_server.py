"""`mlxinfer serve` driven as users drive it: the real server in a subprocess on a free
loopback port, called with the official `openai` client and raw HTTP. The oracle for
every completion is the same request run in-process with `mlxinfer.stream_generate`
(itself proved against transformers). A second server (tests/fault_server.py) slows its
steps and plants faults, to catch streams mid-way and to prove fault isolation.
All traffic goes to 127.0.0.1, bounded in count and time."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.cli.main import main
from serving import KEY, Server, answers_health, free_port, marker, post  # noqa: F401 (test_shard imports two)

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(["-m", str(tiny), "--dtype", "float32", "--api-key", KEY])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


FAULTY_PREFILL, FAULTY_EMIT = "zebrafaultprefill", "zebrafaultemit"


@pytest.fixture(scope="module")
def slow(tiny, tokenizer):
    """Two slots, one queue place, 50 ms per engine step, prompt lookup, a CORS origin, planted faults."""
    env = {"MLXINFER_TEST_STEP_DELAY": "0.05",
           "MLXINFER_TEST_PREFILL_FAULT": ",".join(map(str, marker(tokenizer, FAULTY_PREFILL))),
           "MLXINFER_TEST_EMIT_FAULT": ",".join(map(str, marker(tokenizer, FAULTY_EMIT)))}
    s = Server(["-m", str(tiny), "--dtype", "float32", "--max-concurrency", "2", "--max-queue", "1",
                "--prompt-lookup", "--cors", "http://app.example"],
               env=env, script=[sys.executable, str(HERE / "fault_server.py")])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def slow_client(slow):
    return openai.OpenAI(base_url=f"{slow.url}/v1", api_key="unused", max_retries=0, timeout=60)


def alone(loaded, prompt, **options) -> list:
    """The chunks of the same generation run in-process, greedy."""
    model, tokenizer = loaded
    return list(mlxinfer.stream_generate(model, tokenizer, prompt, **{"temperature": 0.0, **options}))


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(client, text: str, **kwargs):
    return client.chat.completions.create(model="tiny", messages=user(text), temperature=0, **kwargs)


# --- completions equal the engine run in-process ---

def test_chat_completion_equals_generate(client, loaded):
    r = chat(client, "hello there", max_tokens=12)
    want = alone(loaded, user("hello there"), max_tokens=12)
    assert r.choices[0].message.content == text_of(want)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want[-1].finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want[-1].stats.prompt_tokens,
                                                                  want[-1].stats.generated_tokens)


def test_streamed_chat_equals_generate_and_reports_usage(client, loaded):
    events = list(chat(client, "what is up", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    want = alone(loaded, user("what is up"), max_tokens=10)
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == text_of(want)
    assert events[0].choices[0].delta.role == "assistant"
    assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == \
        [want[-1].finish_reason]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == want[-1].stats.generated_tokens


def test_text_completion_streamed_and_not_equals_generate(client, loaded):
    want = text_of(alone(loaded, "the quick brown", max_tokens=8))
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=8, temperature=0)
    assert r.choices[0].text == want
    streamed = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(e.choices[0].text for e in streamed) == want


def test_token_id_prompt_and_sampling_options(client, loaded, tokenizer):
    ids = tokenizer.encode("once upon a time")
    options = dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, stop=["zz"])
    r = client.completions.create(model="tiny", prompt=ids, **options,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    want = alone(loaded, ids, **{**options, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.choices[0].text == text_of(want)


def test_chat_logprobs_equal_generate(client, loaded):
    r = chat(client, "give me numbers", max_tokens=6, logprobs=True, top_logprobs=3)
    want = [c for c in alone(loaded, user("give me numbers"), max_tokens=6, logprobs=3) if c.token is not None]
    got = r.choices[0].logprobs.content
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([lp for _, lp in w.top_logprobs], abs=1e-5)


def test_text_logprobs_in_the_legacy_shape(client, loaded, tokenizer):
    r = client.completions.create(model="tiny", prompt="red green", max_tokens=5, temperature=0, logprobs=2)
    want = [c for c in alone(loaded, "red green", max_tokens=5, logprobs=2) if c.token is not None]
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([c.token]) for c in want]
    assert lp.token_logprobs == pytest.approx([c.logprob for c in want], abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_logit_bias_forces_a_token(client, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                  logit_bias={str(token): 100})
    assert r.choices[0].text == tokenizer.decode([token] * 3)


def test_second_turn_reuses_the_first(client):
    first = user("tell me something")
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=0)
    convo = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    again = client.chat.completions.create(model="tiny", messages=convo, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_eight_streaming_clients_equal_one_at_a_time(client, server):
    prompts = [f"question {i}: the quick brown fox" for i in range(8)]

    def streamed(p: str) -> str:
        return "".join(e.choices[0].delta.content or "" for e in chat(client, p, max_tokens=16, stream=True))

    one_by_one = [streamed(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == one_by_one
    assert server.health()["active"] == 0


def test_models_and_health(client, server, tiny):
    assert [m.id for m in client.models.list().data] == [Path(tiny).name]
    health = server.health()
    assert health["status"] == "ok" and health["active"] == 0 and health["queued"] == 0
    assert health["limits"] == {"max_concurrency": 8, "max_queued": 32}
    assert health["prompt_cache"]["entries"] >= 1


def test_head_is_answered_as_get_without_a_body(server):
    """HEAD on the page, its assets and /health: GET's status and headers (its Content-Length
    too), and no body: the next response on the same connection parses (a body sent after HEAD
    would be read as its status line)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for path in ("/", "/web/app.js", "/health"):
            connection.request("GET", path)
            got = connection.getresponse()
            body = got.read()
            connection.request("HEAD", path)
            head = connection.getresponse()
            assert head.status == got.status == 200, path
            assert head.read() == b"" and int(head.headers["Content-Length"]) == len(body) > 0, path
            same = ("Content-Type", "Content-Security-Policy", "X-Content-Type-Options")
            assert [head.headers[h] for h in same] == [got.headers[h] for h in same], path
    finally:
        connection.close()


# --- limits and bad input ---

@pytest.mark.parametrize("kwargs, fact", [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(extra_body={"web_search_options": {}}), "'web_search_options' (web search) is not supported"),
    (dict(response_format={"type": "xml"}), "'xml' is not supported"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}}), "not"),
    (dict(n=17), "at most 16"),
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_logprobs=50, logprobs=True), "top_logprobs"),
    (dict(extra_body={"mirostat": 2}), "unknown parameter 'mirostat'"),
])
def test_unsupported_or_bad_parameters_are_400(client, kwargs, fact):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user("x"), **{"temperature": 0, **kwargs})
    assert fact in str(e.value)


def test_malformed_bodies_are_400_naming_the_field(server):
    status, body, _ = post(server.url, b"{nope")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = post(server.url, b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body, _ = post(server.url, {"messages": [{"role": "robot", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages.0.role"
    status, body, _ = post(server.url, {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body, _ = post(server.url, {"prompt": ""}, path="/v1/completions")
    assert status == 400 and "prompt" in body["error"]["message"]
    status, body, _ = post(server.url, {"prompt": "x", "max_tokens": "lots"}, path="/v1/completions")
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_body_size_limit(server):
    """Refused from its Content-Length, before the body is read."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {5 << 20}\r\n\r\n".encode())
        reply = b""
        while b"bytes" not in reply and (more := sock.recv(65536)):  # headers and body may come apart
            reply += more
    assert reply.startswith(b"HTTP/1.1 413") and b"bytes" in reply


def test_prompt_longer_than_the_context_names_both_numbers(server, tokenizer, loaded):
    prompt = " ".join(["word"] * 400)
    n = len(tokenizer.encode(prompt))
    context = loaded[0].config.max_position_embeddings
    status, body, _ = post(server.url, {"prompt": prompt, "max_tokens": 4}, path="/v1/completions")
    assert status == 400 and str(n) in body["error"]["message"] and str(context) in body["error"]["message"]


def test_max_tokens_is_capped_by_the_context(server, tokenizer, loaded):
    prompt = tokenizer.encode("word " * 60)[:150]
    context = loaded[0].config.max_position_embeddings
    for limit in (100000, None):  # asked for too much, or nothing: up to the end of the context
        body = {"prompt": prompt, "temperature": 0, **({"max_tokens": limit} if limit else {})}
        status, r, _ = post(server.url, body, path="/v1/completions")
        assert status == 200, r
        assert r["usage"]["total_tokens"] <= context
        assert r["choices"][0]["finish_reason"] == "stop" or r["usage"]["total_tokens"] == context


def test_api_key_is_required_on_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        request = urllib.request.Request(f"{server.url}/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request)
        assert e.value.code == 401
    assert post(server.url, {"messages": user("hi")}, key=None)[0] == 401
    assert server.health()["status"] == "ok"


def test_cors_headers_only_with_cors(server, slow):
    origin = {"Origin": "http://app.example"}
    plain = urllib.request.urlopen(urllib.request.Request(f"{server.url}/health", headers=origin))
    assert "access-control-allow-origin" not in {k.lower() for k in plain.headers}
    allowed = urllib.request.urlopen(urllib.request.Request(f"{slow.url}/health", headers=origin))
    assert allowed.headers["access-control-allow-origin"] == "http://app.example"


def test_a_non_loopback_host_without_a_key_warns(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--port", str(free_port()),
                                       "-m", str(tmp_path / "missing")])
    assert "warning: listening on 0.0.0.0 without --api-key" in result.output
    assert result.exit_code != 0 and "Traceback" not in result.output


def test_a_busy_port_is_a_one_line_error(server):
    result = CliRunner().invoke(main, ["serve", "--port", str(server.port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{server.port}" in result.output


# --- reliability ---

def open_stream(url: str, body: dict) -> socket.socket:
    """Send a streaming request by hand and return the connection once its first event arrived."""
    data = json.dumps({**body, "stream": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def first_event(sock: socket.socket) -> bytes:
    seen = b""
    while b"data: " not in seen:
        part = sock.recv(4096)
        assert part, "the server closed the stream"
        seen += part
    return seen


def pooled(server) -> int:
    """Prompt-cache entries: a finished request leaves one, a cancelled one does not (its K/V are freed)."""
    return server.health()["prompt_cache"]["entries"]


def test_a_client_that_disconnects_mid_stream_is_cancelled(slow, slow_client):
    before = pooled(slow)
    stream = chat(slow_client, "go on and on", max_tokens=200, stream=True)  # 200 steps of 50 ms: 10 s
    next(iter(stream))
    assert slow.health()["active"] == 1 and slow.health()["cache_bytes"] > 0
    stream.close()
    health = slow.wait_for(lambda h: h["active"] == 0, seconds=60)
    assert health["active"] == 0 and health["cache_bytes"] == 0
    assert pooled(slow) == before, "the request ran to its end instead of being cancelled"
    assert chat(slow_client, "still there?", max_tokens=4).choices[0].message.content is not None


def test_a_non_streaming_client_that_hangs_up_is_cancelled(slow):
    data = json.dumps({"messages": user("keep talking"), "max_tokens": 200, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", slow.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    before = pooled(slow)
    assert slow.wait_for(lambda h: h["active"] == 1, seconds=60)["active"] == 1
    sock.close()
    assert slow.wait_for(lambda h: h["active"] == 0, seconds=60)["active"] == 0
    assert pooled(slow) == before, "the request ran to its end instead of being cancelled"


def test_requests_past_the_queue_get_503_with_retry_after(slow):
    long = {"messages": user("a long story"), "max_tokens": 200, "temperature": 0}
    socks = [open_stream(slow.url, long) for _ in range(3)]  # two slots and the one queue place
    try:
        health = slow.wait_for(lambda h: h["active"] == 2 and h["queued"] == 1)
        assert (health["active"], health["queued"]) == (2, 1)
        status, body, headers = post(slow.url, long, key=None)
        assert status == 503 and "busy" in body["error"]["message"]
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
    finally:
        for s in socks:
            s.close()
    assert slow.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0)["active"] == 0


def test_a_failing_request_ends_alone_and_the_server_goes_on(slow, slow_client, loaded):
    """A request that fails in prefill gets a 500 while another streams; one that fails
    mid-stream gets an error event; the others' outputs are untouched."""
    other: dict = {}

    def bystander():
        events = chat(slow_client, "the bystander speaks", max_tokens=30, stream=True)
        other["text"] = "".join(e.choices[0].delta.content or "" for e in events)

    thread = threading.Thread(target=bystander)
    thread.start()
    slow.wait_for(lambda h: h["active"] == 1)
    with pytest.raises(openai.InternalServerError) as e:
        chat(slow_client, f"this {FAULTY_PREFILL} breaks", max_tokens=5)
    assert "planted prefill fault" in str(e.value)
    events = chat(slow_client, f"this {FAULTY_EMIT} breaks later", max_tokens=10, stream=True)
    with pytest.raises(openai.APIError) as e:
        for _ in events:
            pass
    assert "planted emit fault" in str(e.value)
    thread.join(60)
    assert other["text"] == text_of(alone(loaded, user("the bystander speaks"), max_tokens=30))
    assert chat(slow_client, "and now?", max_tokens=4).choices[0].finish_reason in ("stop", "length")


def test_prompt_lookup_server_equals_generate(slow_client, loaded):
    text = "one two three four one two three four one two"
    r = slow_client.completions.create(model="tiny", prompt=text, max_tokens=20, temperature=0)
    assert r.choices[0].text == text_of(alone(loaded, text, max_tokens=20, prompt_lookup=True))


def test_memory_stays_flat_over_200_requests(server):
    def run(n: int) -> None:
        for i in range(n):
            status, _, _ = post(server.url, {"messages": user(f"note {i % 10} about memory"), "max_tokens": 4,
                                             "temperature": 0})
            assert status == 200

    run(20)  # warm: the pool holds these conversations, buffers are allocated
    before = server.health()
    run(200)
    after = server.health()
    assert after["served"] - before["served"] >= 200  # the snapshot may lag the last reply by one
    growth = {k: after["memory"][k] - before["memory"][k] for k in after["memory"]}
    assert growth["mlx_active_bytes"] <= 1 << 20, growth
    assert growth["mlx_peak_bytes"] <= 1 << 20, growth
    assert after["peak_rss_bytes"] - before["peak_rss_bytes"] <= 32 << 20


def test_real_model_through_the_server(smollm2_gguf, tmp_path):
    """SmolLM2 (real weights, real chat template) answers through the openai client as in-process."""
    folder = tmp_path / "smollm2"
    convert(smollm2_gguf, folder)  # into the test's own folder: nothing lands in the user's model store
    s = Server(["-m", str(folder)])
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = user("What is the capital of France?")
        r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
        model, tokenizer = mlxinfer.load(folder)
        assert r.choices[0].message.content == mlxinfer.generate(model, tokenizer, messages, max_tokens=12,
                                                                 temperature=0.0)
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_mid_stream_ends_the_stream_and_exits_cleanly(tiny, sig):
    s = Server(["-m", str(tiny), "--dtype", "float32"],
               env={"MLXINFER_TEST_STEP_DELAY": "0.05"}, script=[sys.executable, str(HERE / "fault_server.py")])
    sock = open_stream(s.url, {"messages": user("a long story"), "max_tokens": 200})  # 10 s if left to run
    seen = first_event(sock)
    rc, output = s.stop(sig)
    assert rc == 0 and "Traceback" not in output, output
    while part := sock.recv(65536):
        seen += part
    sock.close()
    assert b"\"finish_reason\":\"stop\"" in seen.replace(b" ", b"") and b"data: [DONE]" in seen
    assert seen.count(b"data: ") < 100, "the stream ran to its end instead of stopping with the server"


def test_the_readme_example_runs(server):
    out = subprocess.run([sys.executable, str(HERE.parent / "examples" / "openai_client.py"), f"{server.url}/v1", KEY],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cached = [line for line in out.stdout.splitlines() if line.startswith("cached prompt tokens:")]
    assert cached and int(cached[0].split()[3]) > 0


def test_response_format_through_the_openai_client(client, loaded):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    r = chat(client, "a number please", max_tokens=30, response_format=fmt)
    want = alone(loaded, user("a number please"), max_tokens=30, response_format=fmt)
    assert r.choices[0].message.content == text_of(want)
    if r.choices[0].finish_reason == "stop":
        assert set(json.loads(r.choices[0].message.content)) == {"n"}
    events = list(chat(client, "a number please", max_tokens=30, response_format=fmt, stream=True))
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == text_of(want)
    r = client.completions.create(model="tiny", prompt="digits:", max_tokens=8, temperature=0,
                                  extra_body={"response_format": {"type": "regex", "pattern": "[0-9]{3}"}})
    assert r.choices[0].text == text_of(alone(loaded, "digits:", max_tokens=8,
                                              response_format={"type": "regex", "pattern": "[0-9]{3}"}))
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": WEATHER}}]


def test_tool_calls_through_the_openai_client(roomy):
    jsonschema = pytest.importorskip("jsonschema")
    s = Server(["-m", str(roomy), "--dtype", "float32"])
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="m", messages=user("weather?"), tools=TOOLS, tool_choice="required", max_tokens=60,
                   temperature=0)
        r = c.chat.completions.create(**ask)
        model, tok = mlxinfer.load(roomy, dtype="float32")
        want = list(mlxinfer.stream_generate(model, tok, user("weather?"), tools=TOOLS, tool_choice="required",
                                             max_tokens=60, temperature=0.0))[-1]
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "forecast"
        arguments = json.loads(call.function.arguments)
        assert arguments == want.tool_calls[0].arguments
        jsonschema.validate(arguments, WEATHER)
        events = list(c.chat.completions.create(**ask, stream=True))
        assert not "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        deltas = [tc for e in events if e.choices for tc in (e.choices[0].delta.tool_calls or [])]
        assert [json.loads(d.function.arguments) for d in deltas] == [arguments]
        assert events[-1].choices[0].finish_reason == "tool_calls"
        single = c.chat.completions.create(**ask, parallel_tool_calls=False)  # LangChain's and openai-agents' setting
        assert single.choices[0].finish_reason == "tool_calls" and len(single.choices[0].message.tool_calls) == 1
        follow = user("weather?") + [choice.message.model_dump(exclude_none=True),
                                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        again = c.chat.completions.create(model="m", messages=follow, tools=TOOLS, tool_choice="none",
                                          max_tokens=5, temperature=0)
        assert again.choices[0].finish_reason in ("stop", "length") and again.choices[0].message.tool_calls is None
    finally:
        s.stop()


# --- what apps send back: the SDK's own objects, OpenAI's no-op fields ---

def test_an_agent_loop_can_send_back_the_sdks_own_message(client, loaded):
    """`message.model_dump()` carries refusal, annotations, audio and function_call (null):
    sent back as the history of the next turn, it is the same as the plain message."""
    first = chat(client, "hello there", max_tokens=6)
    sent = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(sent)
    history = [*user("hello there"), sent, *user("and then?")]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=5, temperature=0)
    plain = [*user("hello there"), {"role": "assistant", "content": first.choices[0].message.content},
             *user("and then?")]
    assert r.choices[0].message.content == text_of(alone(loaded, plain, max_tokens=5))


def test_openais_bookkeeping_fields_are_accepted_and_change_nothing(client):
    plain = chat(client, "what is up", max_tokens=6).choices[0].message.content
    r = chat(client, "what is up", max_tokens=6, store=True, metadata={"app": "test"}, service_tier="auto",
             safety_identifier="user-1", prompt_cache_key="k", user="u", stream=None)
    assert r.choices[0].message.content == plain


def test_top_p_zero_is_greedy(client, loaded):
    r = client.chat.completions.create(model="tiny", messages=user("once upon"), max_tokens=8, temperature=0.9,
                                       top_p=0, seed=3)
    assert r.choices[0].message.content == text_of(alone(loaded, user("once upon"), max_tokens=8))


def test_a_model_is_retrieved_by_its_id(client):
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert "does not exist" in str(e.value)


def test_an_image_part_is_refused_by_a_text_model(server):
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    status, body, _ = post(server.url, {"messages": [{"role": "user", "content": parts}]})
    assert status == 400 and "this model takes no images" in body["error"]["message"]
    parts[1] = {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}
    status, body, _ = post(server.url, {"messages": [{"role": "user", "content": parts}]})
    assert status == 400 and "input_audio" in body["error"]["message"]
    assert body["error"]["param"] == "messages.0.content"


@pytest.mark.parametrize("role", ["system", "developer", "assistant", "tool"])
def test_an_image_part_is_taken_from_the_user_only(server, role):
    """OpenAI's API takes image_url parts in user messages alone: one elsewhere is a 400 naming it."""
    parts = [{"type": "text", "text": "look"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    message = {"role": role, "content": parts, **({"tool_call_id": "c1"} if role == "tool" else {})}
    status, body, _ = post(server.url, {"messages": [{"role": "user", "content": "hi"}, message]})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "messages.1.content" and "content.1" in body["error"]["message"]
    assert "user messages only" in body["error"]["message"]
