"""`mlxinfer serve` against hostile and careless clients: one request must never take the
server down or freeze it for others, client errors are 4xx in OpenAI's shape with nothing
coerced, output is always valid JSON, and only local pages may drive it. The real server
runs in a subprocess (tests/fault_server.py when a request must be held in one stage); every
wait is on an event (a health field, a line, a token), bounded only as a hang guard. All
traffic goes to 127.0.0.1 and is bounded in count."""

from __future__ import annotations

import json
import math
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serving import Server, marker, post, tokens_while

openai = pytest.importorskip("openai")
HERE = Path(__file__).parent
HANG_GUARD = 120  # seconds: a bound no healthy run comes near, even on a busy machine


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def strict_json(text: str):
    """JSON as the spec has it: NaN and Infinity are not numbers."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the server's JSON: {text[:200]}"))


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(["-m", str(tiny), "--dtype", "float32", "--allowed-host", "models.internal"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD)


GATED_PREPARE, GATED_PREFILL, FAULTY_PREPARE = "zebragateprepare", "zebragateprefill", "zebrafaultprepare"


@pytest.fixture(scope="module")
def gated(tiny, tokenizer, tmp_path_factory):
    """One slot, 50 ms per engine step, and requests whose prompt holds a marker held in
    preparation or prefill until the gate file exists (opened again by each test)."""
    gate = tmp_path_factory.mktemp("gate") / "open"
    env = {"MLXINFER_TEST_STEP_DELAY": "0.05", "MLXINFER_TEST_GATE": str(gate),
           "MLXINFER_TEST_GATE_PREPARE": ",".join(map(str, marker(tokenizer, GATED_PREPARE))),
           "MLXINFER_TEST_GATE_PREFILL": ",".join(map(str, marker(tokenizer, GATED_PREFILL))),
           "MLXINFER_TEST_PREPARE_FAULT": ",".join(map(str, marker(tokenizer, FAULTY_PREPARE)))}
    s = Server(["-m", str(tiny), "--dtype", "float32", "--max-concurrency", "1", "--max-queue", "4"],
               env=env, script=[sys.executable, str(HERE / "fault_server.py")])
    s.gate = gate
    yield s
    gate.touch()
    s.stop()


def raw_stream(port: int, body: dict) -> socket.socket:
    """A streaming chat request sent by hand; the connection, to read from or drop."""
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def events(sock: socket.socket, count: int) -> int:
    """Read until at least `count` SSE events arrived; returns how many were read."""
    buffer = b""
    while buffer.count(b"data: ") < count:
        part = sock.recv(65536)
        assert part, "the stream ended"
        buffer += part
    return buffer.count(b"data: ")


# --- 1. one request never freezes the others ---

def test_a_request_being_prepared_does_not_stall_other_streams(gated):
    """A request held in preparation (rendering, tokenizing, grammar compilation) must not
    stop the engine: another stream keeps receiving tokens meanwhile."""
    gated.gate.unlink(missing_ok=True)
    running = raw_stream(gated.port, {"messages": user("tell a long story"), "max_tokens": 150, "temperature": 0})
    held = raw_stream(gated.port, {"messages": user(f"hello {GATED_PREPARE} there"), "max_tokens": 2})
    try:
        assert gated.wait_for(lambda h: h.get("preparing") == 1, HANG_GUARD).get("preparing") == 1
        assert events(running, 5) >= 5  # on the engine thread, preparing would freeze this stream
        assert gated.health()["preparing"] == 1
    finally:
        gated.gate.touch()
        running.close()
        held.close()
    assert gated.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0 and h["preparing"] == 0,
                          HANG_GUARD)["active"] == 0



def longest_health_wait(url: str, work):
    """`work()`'s result, and the longest a /health call took while it ran (/health polled from
    another thread, one call after another): an event loop busy with one request's body would
    hold some call for as long as it is busy."""
    done, waits = threading.Event(), []

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            urllib.request.urlopen(f"{url}/health", timeout=HANG_GUARD).read()
            waits.append(time.monotonic() - start)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join(HANG_GUARD)
    return result, max(waits, default=0.0)


STALL_GUARD = 10  # seconds a /health call may wait on a busy machine; a body parsed on the event loop took 40-80


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{}] * 1_300_000}]}),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": [{}] * 1_300_000}, *user("hi")]}),
], ids=["chat content", "responses reasoning"])
def test_a_body_of_a_million_objects_is_refused_by_name_while_others_are_answered(server, path, body):
    """4 MiB of `{}`: 1.3 million objects, each failing validation in every way a content part
    can (a minute of pydantic errors), or stored as 93 MB of Python objects. Past 100,000 objects
    and arrays a body is refused, and it is read off the event loop meanwhile."""
    (status, reply, _), waited = longest_health_wait(
        server.url, lambda: post(server.url, json.dumps(body, separators=(",", ":")).encode(), key=None, path=path))
    assert status == 400 and "100,000 JSON objects and arrays" in reply["error"]["message"], reply
    assert waited < STALL_GUARD


def test_item_references_are_found_without_stalling_the_server(server):
    """20,000 item_references to the last of 20,000 stored items: a scan of every stored item per
    reference on the event loop froze /health for minutes; looked up by id, on a worker, it is
    answered at once."""
    items = [{"type": "reasoning", "id": f"rs_{i}", "summary": []} for i in range(20_000)]
    status, stored, _ = post(server.url, {"input": [*items, *user("hi")], "max_output_tokens": 1}, key=None,
                             path="/v1/responses")
    assert status == 200, stored
    refs = [{"type": "item_reference", "id": "rs_19999"}] * 20_000
    (status, reply, _), waited = longest_health_wait(server.url, lambda: post(
        server.url, {"input": [*refs, *user("hi")], "max_output_tokens": 1}, key=None, path="/v1/responses"))
    assert status == 200, reply
    assert waited < STALL_GUARD


def test_health_counts_a_request_in_prefill(gated):
    gated.gate.unlink(missing_ok=True)
    sock = raw_stream(gated.port, {"messages": user(f"hello {GATED_PREFILL} there friend"), "max_tokens": 3})
    try:
        health = gated.wait_for(lambda h: h["active"] == 1, HANG_GUARD)
        assert health["active"] == 1 and health["queued"] == 0
    finally:
        gated.gate.touch()
        sock.close()
    assert gated.wait_for(lambda h: h["active"] == 0, HANG_GUARD)["active"] == 0


def test_a_streamed_client_that_leaves_before_its_first_token_is_cancelled(gated):
    """Queued behind another request (one slot), the client hangs up before any token: its
    place is given back while the other request still runs, not when it would have ended."""
    gated.gate.touch()
    running = raw_stream(gated.port, {"messages": user("a very long story"), "max_tokens": 200, "temperature": 0})
    events(running, 1)
    waiting = raw_stream(gated.port, {"messages": user("and another one"), "max_tokens": 50})
    try:
        assert gated.wait_for(lambda h: h["queued"] == 1, HANG_GUARD)["queued"] == 1
        waiting.close()
        health = gated.wait_for(lambda h: h["queued"] == 0, HANG_GUARD)
        assert health["queued"] == 0 and health["active"] == 1, "cancelled only after the running request ended"
    finally:
        running.close()
    assert gated.wait_for(lambda h: h["active"] == 0, HANG_GUARD)["active"] == 0


def test_a_client_that_leaves_during_preparation_frees_its_place(gated):
    """Its place comes back while its preparation is still held, not when it would have ended."""
    gated.gate.unlink(missing_ok=True)
    sock = raw_stream(gated.port, {"messages": user(f"hello {GATED_PREPARE} there"), "max_tokens": 50})
    try:
        assert gated.wait_for(lambda h: h["preparing"] == 1, HANG_GUARD)["preparing"] == 1
        sock.close()
        assert gated.wait_for(lambda h: h["preparing"] == 0, HANG_GUARD)["preparing"] == 0
    finally:
        gated.gate.touch()
    health = gated.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0, HANG_GUARD)
    assert (health["active"], health["queued"]) == (0, 0)


def test_a_fault_while_preparing_is_a_500_in_openais_shape_and_frees_its_place(gated):
    gated.gate.touch()
    for _ in range(6):  # more than the server's places (1 running + 4 queued): each one was given back
        status, reply, _ = post(gated.url, {"messages": user(f"hello {FAULTY_PREPARE} there"), "max_tokens": 2},
                                key=None)
        assert status == 500 and reply["error"]["type"] == "server_error", reply
        assert "planted prepare fault" in reply["error"]["message"]
    status, reply, _ = post(gated.url, {"messages": user("hello there"), "max_tokens": 2}, key=None)
    assert status == 200, reply


def test_idle_and_slow_connections_do_not_starve_the_server(tiny):
    """Under a 128-descriptor limit (macOS's default is 256), twice that many connections, 195
    silent and 65 that send half a header: a real request still gets its answer (the header
    deadline, here 2 s instead of 10, frees the descriptors, a wave at a time)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1024), hard))
    s = Server(["-m", str(tiny), "--dtype", "float32"], descriptors=128, env={"MLXINFER_TEST_HEADER_SECONDS": "2"},
               script=[sys.executable, str(HERE / "fault_server.py")])
    idle: list[socket.socket] = []
    try:
        for i in range(260):
            try:
                sock = socket.create_connection(("127.0.0.1", s.port), timeout=HANG_GUARD)
            except OSError:  # the server's backlog is full: that is its business, not a failure here
                continue
            if i % 4 == 0:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            idle.append(sock)
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD)
        r = c.chat.completions.create(model="tiny", messages=user("hello"), max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert s.health()["status"] == "ok"
    finally:
        for sock in idle:
            sock.close()
        rc, _ = s.stop()
    assert rc == 0


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    """The header deadline: the server closes it (recv sees the end) instead of holding it forever."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert sock.recv(1024) == b""


@pytest.fixture(scope="module")
def sliced(tiny):
    """Prefill chunks of 8 tokens and 20 ms per engine step (tests/fault_server.py): model work
    over a context (a look inside, embeddings) takes many chunks, each a step apart."""
    s = Server(["-m", str(tiny), "--dtype", "float32", "--prefill-step", "8"], env={"MLXINFER_TEST_STEP_DELAY": "0.02"},
               script=[sys.executable, str(HERE / "fault_server.py")])
    yield s
    s.stop()


LONG_CHAT = user(" ".join(["the quick brown fox"] * 45))  # ~190 tokens: 24 chunks of 8
NO_END = range(3)  # the tiny tokenizer's special tokens: another client's stream outlasts the work


@pytest.mark.parametrize("path, body", [
    ("/v1/inspect", {"messages": LONG_CHAT}),
    ("/v1/attention", {"messages": LONG_CHAT, "layer": 1, "head": 0}),
    ("/v1/embeddings", {"input": " ".join(["the quick brown fox"] * 50)}),
    ("/v1/embeddings", {"input": [f"{i} the quick brown fox jumps over the lazy dog" * 3 for i in range(12)]}),
], ids=["inspect", "attention", "embed-one-long", "embed-many"])
def test_model_work_runs_between_another_clients_tokens(sliced, path, body):
    """A look inside reruns a whole context and embeddings run texts through the model: the server
    runs them a prefill chunk at a time between decode steps, so a stream being decoded keeps
    getting tokens while they run (run in one piece, it gets none)."""
    seen = tokens_while(sliced.url, lambda: post(sliced.url, body, key=None, path=path), NO_END, key=None)
    status, reply, _ = seen.result
    assert status == 200, reply
    assert seen.tokens >= 10, f"the stream got {seen.tokens} tokens while {path} ran"


def raw_post(url: str, path: str, body: dict) -> tuple[int, int]:
    """(status, bytes) of a POST whose answer is not parsed here: parsing megabytes of JSON would
    hold this process's GIL and delay the other client's reader."""
    data = json.dumps(body, separators=(",", ":")).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG_GUARD) as r:
        return r.status, len(r.read())


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"content": "the quick brown fox jumps over the lazy dog " * 60_000, "with_pieces": True}),
    ("/tokenize", {"content": "the quick brown fox jumps over the lazy dog " * 80_000}),
    ("/detokenize", {"tokens": list(range(3, 380)) * 2_600}),  # ~980,000 ids: a 3.9 MB body
], ids=["pieces", "ids", "detokenize"])
def test_megabytes_of_tokens_hold_neither_the_event_loop_nor_the_engine(sliced, path, body):
    """The tokenizer's own calls let go of the GIL, the ids are checked and the answer encoded off
    the event loop (a piece at a time), so another client's stream keeps flowing: its longest wait
    is a small part of the work's time (held in one piece, it waits for all of it)."""
    seen = tokens_while(sliced.url, lambda: raw_post(sliced.url, path, body), NO_END, key=None, max_tokens=240)
    assert seen.result[0] == 200
    assert seen.longest_gap < seen.seconds / 2, \
        f"the stream waited {seen.longest_gap:.2f} s of the {seen.seconds:.2f} s {path} took"


# --- 2. client errors are 400s in OpenAI's shape, nothing coerced ---

MALFORMED = [
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 300 + b"]" * 300 + b"}", "nested"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', "out of range"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', "Infinity"),
    (b'{"messages": [{"role": "user", "content": "\\ud800 lone"}]}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "\\udfff": 1}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe bad"}]}', "not valid JSON"),
    (json.dumps({"messages": user("x"), "temperature": True}).encode(), "temperature"),
    (json.dumps({"messages": user("x"), "max_tokens": "4"}).encode(), "max_tokens"),
    (json.dumps({"messages": user("x"), "max_tokens": 4.0}).encode(), "max_tokens"),
    (json.dumps({"messages": user("x"), "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": user("x"), "seed": "7"}).encode(), "seed"),
    (json.dumps({"messages": user("x"), "top_logprobs": 3}).encode(), "top_logprobs"),
    (json.dumps({"messages": user("x"), "logit_bias": {"abc": 1}}).encode(), "logit_bias"),
    (json.dumps({"messages": user("x"), "logit_bias": {"5": True}}).encode(), "logit_bias"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "messages.0.content"),
]


@pytest.mark.parametrize("body,fact", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_are_400_in_openais_shape(server, body, fact):
    status, reply, _ = post(server.url, body, key=None)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert fact in error["message"] or fact == error["param"], error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]


def test_the_official_client_sees_a_400_for_a_coerced_type(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user("x"), max_tokens=2, extra_body={"top_k": "3"})
    assert "top_k" in str(e.value)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) |
                           st.text(max_size=20), lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", "n", "stream", "logprobs",
          "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "response_format", "tools", "tool_choice", "messages", "stream_options", "user", "model"]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_no_body_makes_the_server_fail(server, field, value):
    """Any value in any field: a 200 or a 4xx in OpenAI's shape, never a 5xx, never invalid JSON."""
    assume(not (field == "stream" and value is True))  # a stream is not one JSON body
    body = {"messages": user("hi"), "max_tokens": 2, field: value}
    if field == "max_tokens" and isinstance(value, int) and not isinstance(value, bool):
        body[field] = min(value, 2)
    status, reply, _ = post(server.url, json.dumps(body).encode(), key=None)
    assert status == 200 or (400 <= status < 500 and set(reply["error"]) >= {"message", "type"}), (status, reply)


def ref_chain(n: int) -> dict:
    """A JSON Schema whose $refs run n deep before reaching a string (3,000 crashed llguidance's compiler)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


LARK_CHAIN = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(5000)) + 'r5000: "x"\n'
HOSTILE_GRAMMARS = [
    ({"response_format": json_schema(ref_chain(3000))}, "limit"),
    ({"tools": tool(ref_chain(3000)), "tool_choice": "required"}, "limit"),
    ({"response_format": {"type": "grammar", "lark": LARK_CHAIN}}, "limit"),
    ({"response_format": json_schema({"$ref": "#"})}, "never complete"),
    ({"response_format": json_schema({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
     "never complete"),
    ({"response_format": {"type": "grammar", "lark": 'start: a\na: a "x"\n'}}, "never complete"),
    ({"tools": tool({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
      "tool_choice": "required"}, "never complete"),
]


@pytest.mark.parametrize("fields,fact", HOSTILE_GRAMMARS, ids=range(len(HOSTILE_GRAMMARS)))
def test_hostile_grammars_are_400_and_the_server_lives(server, fields, fact):
    """Grammars that crashed the native compiler (taking every client with it) or could
    never complete (a 200 with nothing in it): a 400 naming why, and the server answers on."""
    status, reply, _ = post(server.url, {"messages": user("hi"), "max_tokens": 4, **fields}, key=None)
    assert status == 400, reply
    assert fact in reply["error"]["message"], reply
    assert server.health()["status"] == "ok"


EXTREME = [({"logit_bias": {"5": 1e30}}, "logit_bias"), ({"presence_penalty": 3e38}, "presence_penalty"),
           ({"frequency_penalty": -3e38}, "frequency_penalty"), ({"repetition_penalty": 1e-30}, "repetition_penalty"),
           ({"temperature": 1e30}, "temperature"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
           ({"stop": ["x" * 1_000_000]}, "stop"), ({"stop": [f"s{i}" for i in range(17)]}, "stop")]


@pytest.mark.parametrize("fields,name", EXTREME, ids=[name for _, name in EXTREME])
def test_values_that_overflow_or_grow_without_bound_are_400(server, fields, name):
    """Finite values that overflowed float32 in the sampler (token 0 over and over), and
    stop strings whose matching cost grew with their length on the engine thread."""
    status, reply, _ = post(server.url, {"messages": user("hi"), "max_tokens": 4, **fields}, key=None)
    assert status == 400 and name in reply["error"]["message"], reply


def test_a_long_stop_string_under_the_limit_costs_other_streams_nothing(client):
    """Stops at the limit (16 of 1,000 characters) are matched in time linear in the text."""
    stops = [f"{i:02d}" + "z" * 998 for i in range(16)]
    r = client.chat.completions.create(model="tiny", messages=user("hello"), max_tokens=40, temperature=0, stop=stops)
    assert r.choices[0].finish_reason in ("stop", "length")


# --- 3. output is always valid ---

def test_logprobs_with_a_format_are_finite_streamed_and_not(client, server):
    fmt = {"type": "regex", "pattern": "(yes|no)"}
    r = client.chat.completions.create(model="tiny", messages=user("yes or no?"), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=5, extra_body={"response_format": fmt})
    for item in r.choices[0].logprobs.content:
        assert math.isfinite(item.logprob)
        assert all(math.isfinite(t.logprob) for t in item.top_logprobs)
    body = {"messages": user("yes or no?"), "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "response_format": fmt, "stream": True}
    sock = raw_stream(server.port, body)
    text = b""
    while b"data: [DONE]" not in text:
        part = sock.recv(65536)
        assert part, "the stream ended without [DONE]"
        text += part
    sock.close()
    for line in text.split(b"\r\n\r\n", 1)[1].decode().splitlines():
        if line.startswith("data: {"):
            strict_json(line.removeprefix("data: "))


# --- 4. only local pages drive it ---

def raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD) as sock:
        sock.sendall(head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        reply = b""
        while part := sock.recv(65536):
            reply += part
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1] or b"{}")


CHAT = json.dumps({"messages": user("hi"), "max_tokens": 2}).encode()


@pytest.mark.parametrize("host,allowed", [("127.0.0.1", True), ("localhost", True), ("[::1]", True),
                                          ("models.internal", True), ("evil.example", False),
                                          ("127.0.0.1.evil.example", False), ("localhost.evil.example", False)])
def test_only_known_host_names_are_answered(server, host, allowed):
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 still sends its own Host."""
    for port_part in ("", f":{server.port}"):
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}{port_part}\r\n"
                "Content-Type: application/json\r\n").encode()
        status, reply = raw(server.port, head, CHAT)
        if allowed:
            assert status == 200, reply
        else:
            assert status == 403 and "host" in reply["error"]["message"], reply
    status, _ = raw(server.port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n".encode())
    assert (status == 200) == allowed


@pytest.mark.parametrize("origin", ["http://evil.example", "null"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_pages_body_that_is_not_declared_json_is_refused(server, kind, origin):
    """A page may POST text/plain to any address without a CORS preflight, and its browser sends
    the page's Origin with it ("null" where it hides it): such a request runs nothing."""
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: {origin}\r\n".encode()
    if kind:
        head += f"Content-Type: {kind}\r\n".encode()
    served = server.health()["served"]
    status, reply = raw(server.port, head, CHAT)
    assert status == 415 and "application/json" in reply["error"]["message"]
    assert server.health()["served"] == served  # nothing ran


def test_curls_form_body_without_an_origin_is_read_as_json(server, tmp_path):
    """`curl URL -d '{...}'`, as Ollama's and OpenAI's documentation write it, declares a form
    (application/x-www-form-urlencoded) and sends no Origin: not a page, so it is answered. The
    same with a page's Origin is refused."""
    import shutil
    import subprocess

    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    url = f"{server.url}/v1/chat/completions"
    for extra, status in (([], 200), (["-H", "Origin: http://evil.example"], 415)):
        out = subprocess.run([curl, "-sS", "-w", "\n%{http_code}", url, "-d", CHAT.decode(), *extra],
                             capture_output=True, text=True, timeout=HANG_GUARD, check=True).stdout
        body, _, code = out.rpartition("\n")
        assert int(code) == status, body
        reply = json.loads(body)
        if status == 200:
            assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
        else:
            assert reply["error"]["type"] == "invalid_request_error" and "application/json" in reply["error"]["message"]


def test_json_with_a_charset_is_json(server):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: Application/JSON; charset=utf-8\r\n"
    assert raw(server.port, head, CHAT)[0] == 200


def test_no_cors_headers_and_unknown_paths_in_openais_shape(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD) as sock:
        sock.sendall(b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
                     b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
        reply = b""
        while part := sock.recv(65536):
            reply += part
    assert b"access-control-allow-origin" not in reply.lower()
    status, reply = raw(server.port, b"GET /v1/nothing-here HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert status == 404 and reply["error"]["type"] == "invalid_request_error"
