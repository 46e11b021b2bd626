"""LoRA adapters at the edges: `generate --adapter`, and `serve --adapter NAME=DIR` with
`BASE:NAME` models chosen by the official `openai` client, two adapters at once equal to
their solo runs (and to the library's generation with each adapter), and adapters loaded
and unloaded at run time through `POST /v1/adapters`."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serving import KEY, Server
from test_lora import ATTN_MLP, peft_adapter

import mlxinfer
from mlxinfer.cli import main

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox"
OPTS = dict(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def adapted(tiny, tmp_path_factory):
    """The tiny Llama and two random PEFT adapters for it."""
    root = tmp_path_factory.mktemp("served-adapters")
    a = peft_adapter(tiny, root / "a", seed=1, r=4, lora_alpha=8, target_modules=ATTN_MLP)[0]
    b = peft_adapter(tiny, root / "b", seed=2, r=2, lora_alpha=8, use_dora=True, target_modules=["v_proj", "up_proj"])[0]
    return tiny, a, b


def library_text(folder: Path, adapter: Path | None, prompt=PROMPT) -> str:
    model, tok = mlxinfer.load(folder, adapter_path=adapter)
    return mlxinfer.generate(model, tok, prompt, **OPTS)


def test_generate_command_runs_the_adapter(adapted, tmp_path, monkeypatch):
    from click.testing import CliRunner

    folder, a, _ = adapted
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(main, ["generate", "-m", str(folder), "--adapter", str(a), "-p", PROMPT, "--raw",
                                       "--temp", "0", "--max-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == library_text(folder, a) != library_text(folder, None)


def post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture(scope="module")
def server(adapted):
    folder, a, b = adapted
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    s = Server(["-m", str(folder), "--adapter", f"a={a}", "--adapter", f"b={b}", "--api-key", KEY,
                "--max-adapters", "3"], env=env)
    yield s
    s.stop()


def test_base_a_and_b_at_once_equal_their_solo_runs(server, adapted):
    folder, a, b = adapted
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    base = folder.name
    assert [m.id for m in client.models.list()] == [base, f"{base}:a", f"{base}:b"]

    def complete(model: str) -> str:
        r = client.completions.create(model=model, prompt=PROMPT, **OPTS)
        assert r.model == model
        return r.choices[0].text

    names = [base, f"{base}:a", f"{base}:b"]
    solo = [complete(n) for n in names]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(complete, names * 2))
    assert together == solo * 2
    assert solo == [library_text(folder, None), library_text(folder, a), library_text(folder, b)]
    assert len(set(solo)) == 3


def test_adapters_load_and_unload_at_run_time(server, adapted):
    folder, _, b = adapted
    base, url = folder.name, f"{server.url}/v1/adapters"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert post(url, {"action": "load", "name": "c", "path": str(b)}, key=None)[0] == 401
    status, listing = post(url, {"action": "load", "name": "c", "path": str(b)})
    assert status == 200 and [d["id"] for d in listing["data"]] == [f"{base}:a", f"{base}:b", f"{base}:c"]
    r = client.completions.create(model=f"{base}:c", prompt=PROMPT, **OPTS)
    assert r.choices[0].text == library_text(folder, b)
    status, error = post(url, {"action": "load", "name": "d", "path": str(b)})
    assert status == 409 and "--max-adapters" in error["error"]["message"] and error["error"]["param"] == "name"
    status, error = post(url, {"action": "load", "name": "e", "path": str(folder / "nowhere")})
    assert status in (400, 409) and "error" in error
    assert post(url, {"action": "unload", "name": "c"})[0] == 200
    assert f"{base}:c" not in [m.id for m in client.models.list()]
    with pytest.raises(openai.BadRequestError, match="no adapter named 'c'"):
        client.completions.create(model=f"{base}:c", prompt=PROMPT, **OPTS)
    status, error = post(url, {"action": "unload", "name": "c"})
    assert status == 404 and error["error"]["type"] == "not_found_error"
    status, error = post(url, {"action": "reload", "name": "c"})
    assert status == 400 and error["error"]["param"] == "action"


def test_responses_and_messages_choose_the_adapter_by_model(server, adapted):
    """The Responses and Anthropic Messages APIs take `BASE:NAME` as chat completions does."""
    folder, _, _ = adapted
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    base, messages = folder.name, [{"role": "user", "content": PROMPT}]

    def chat(model: str) -> str:
        return client.chat.completions.create(model=model, messages=messages, **OPTS).choices[0].message.content

    for model in (base, f"{base}:a"):
        r = client.responses.create(model=model, input=PROMPT, max_output_tokens=8, temperature=0.0)
        assert r.output_text == chat(model)
        status, body = post(f"{server.url}/v1/messages", {"model": model, "messages": messages, "max_tokens": 8,
                                                           "temperature": 0.0})
        assert status == 200 and body["content"][0]["text"] == chat(model)
    assert chat(base) != chat(f"{base}:a")
