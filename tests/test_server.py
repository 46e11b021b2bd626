"""`mlxinfer serve` driven as users drive it: the real server in a subprocess on a free
loopback port, called with the official `openai` client and raw HTTP. The oracle for
every completion is the same request run in-process with `mlxinfer.generate`."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import mlxinfer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxinfer.cli", "serve", "-m", str(tiny), "--dtype", "float32",
                             "--port", str(port), "--api-key", KEY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            break
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                pytest.fail(f"the server exited: {proc.stdout.read()}")
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the server did not start in 30 s")
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def alone(tiny, prompt, **options) -> str:
    model, tokenizer = mlxinfer.load(tiny, dtype="float32")
    return mlxinfer.generate(model, tokenizer, prompt, **options)


def chat(client, text: str, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          temperature=0, **kwargs)


def test_chat_completion_equals_generate(client, tiny):
    r = chat(client, "hello there", max_tokens=12)
    want = alone(tiny, [{"role": "user", "content": "hello there"}], max_tokens=12)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 12


def test_streamed_chat_equals_generate_and_reports_usage(client, tiny):
    events = list(chat(client, "what is up", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == alone(tiny, [{"role": "user", "content": "what is up"}], max_tokens=10)
    assert events[-1].usage is not None and events[-1].usage.completion_tokens <= 10


def test_text_completion_equals_generate(client, tiny):
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=8, temperature=0)
    assert r.choices[0].text == alone(tiny, "the quick brown", max_tokens=8)


def test_second_turn_reuses_the_first(client):
    first = [{"role": "user", "content": "tell me something"}]
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=0)
    convo = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    again = client.chat.completions.create(model="tiny", messages=convo, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_eight_concurrent_clients_equal_one_at_a_time(client):
    prompts = [f"question {i}: the quick brown fox" for i in range(8)]
    one_by_one = [chat(client, p, max_tokens=10).choices[0].message.content for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: chat(client, p, max_tokens=10).choices[0].message.content, prompts))
    assert together == one_by_one


@pytest.mark.parametrize("kwargs, fact", [
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(n=2), "n=1"),
    (dict(temperature=-1.0), "temperature"),
    (dict(response_format={"type": "json_object"}), "response_format"),
])
def test_unsupported_or_bad_parameters_are_400(client, kwargs, fact):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       **{"temperature": 0, **kwargs})
    assert fact in str(e.value)


def test_api_key_bad_json_and_health(server):
    request = urllib.request.Request(f"{server}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request)
    assert e.value.code == 401
    bad = urllib.request.Request(f"{server}/v1/chat/completions", data=b"{nope",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad)
    assert e.value.code == 400 and "JSON" in json.loads(e.value.read())["error"]["message"]
    health = json.load(urllib.request.urlopen(f"{server}/health"))
    assert health["status"] == "ok" and health["active"] == 0


def test_a_client_that_disconnects_is_cancelled(client, server):
    stream = chat(client, "go on and on", max_tokens=2000, stream=True)
    next(iter(stream))
    stream.close()
    for _ in range(100):
        if json.load(urllib.request.urlopen(f"{server}/health"))["active"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the abandoned sequence is still decoding")
    assert chat(client, "still there?", max_tokens=4).choices[0].message.content is not None
