"""LoRA adapters at the edges: `generate --adapter`, and `serve --adapter NAME=DIR` with
`BASE:NAME` models chosen by the official `openai` client, two adapters at once equal to
their solo runs (and to the library's generation with each adapter), adapters loaded and
unloaded at run time through `POST /v1/adapters`, and hostile adapters and names refused
there with a 400 in OpenAI's shape while the server keeps answering everyone else."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path

import numpy as np
import pytest
from serving import KEY, Server
from test_lora import ATTN_MLP, peft_adapter

import mlxinfer
from mlxinfer.cli.main import main

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


def altered(adapter: Path, out: Path, config: dict | None = None, nan: bool = False) -> Path:
    """A copy of `adapter` with fields of its adapter_config.json replaced, or a NaN in one tensor."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(adapter, out)
    if config is not None:
        file = out / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if nan:
        tensors = load_file(out / "adapter_model.safetensors")
        first = sorted(tensors)[0]
        tensors[first][0, 0] = np.nan
        save_file(tensors, out / "adapter_model.safetensors")
    return out


def library_text(folder: Path, adapter: Path | None, prompt=PROMPT) -> str:
    model, tok = mlxinfer.load(folder, adapter_path=adapter)
    return mlxinfer.generate(model, tok, prompt, **OPTS)


def test_generate_command_refuses_a_nan_adapter_in_one_line(adapted, tmp_path, monkeypatch):
    from click.testing import CliRunner

    folder, a, _ = adapted
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    bad = altered(a, tmp_path / "nan", nan=True)
    result = CliRunner().invoke(main, ["generate", "-m", str(folder), "--adapter", str(bad), "-p", PROMPT, "--raw",
                                       "--max-tokens", "2"])
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("mlxinfer: ")]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("error: adapter tensor 'base_model.model.model.layers.0.") and "holds NaN" in lines[0]


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


def openai_error(status: int, body: dict, param: str, words: str) -> None:
    """A 400 in OpenAI's error shape, naming `param`, its message one line holding `words`."""
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"], error


# (a copy of adapter a altered, the field the 400 names, words its message holds)
HOSTILE = {
    "path-100k-characters": (None, "path", "at most 4,096 characters"),
    "rank-pattern-zero": ({"rank_pattern": {"o_proj": 0}}, "path", "rank_pattern['o_proj'] 0; expected a positive"),
    "rank-pattern-string": ({"rank_pattern": {"o_proj": "2"}}, "path", "rank_pattern['o_proj'] '2'"),
    "bad-regex": ({"rank_pattern": {"o_proj)": 2}}, "path", "rank_pattern key 'o_proj)' is not a valid regular"),
    "alpha-pattern-string": ({"alpha_pattern": {"up_proj": "x"}}, "path", "alpha_pattern['up_proj'] 'x'"),
    "nan-weights": ("nan", "path", "holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_adapters_are_a_400_naming_the_field(case, server, adapted, tmp_path):
    folder, a, _ = adapted
    change, param, words = HOSTILE[case]
    path = "x" * 100_000 if change is None else str(altered(a, tmp_path / case, nan=True) if change == "nan"
                                                     else altered(a, tmp_path / case, change))
    status, body = post(f"{server.url}/v1/adapters", {"action": "load", "name": "hostile", "path": path})
    openai_error(status, body, param, words)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert f"{folder.name}:hostile" not in [m.id for m in client.models.list()]  # nothing half-loaded
    with pytest.raises(openai.BadRequestError, match="no adapter named 'hostile'"):
        client.completions.create(model=f"{folder.name}:hostile", prompt=PROMPT, **OPTS)


@pytest.mark.parametrize("name", ["line\nfeed", "nul\0", "\x1b[2Jescape", "x" * 1_000_000])
@pytest.mark.parametrize("action", ["load", "unload"])
def test_adapter_names_outside_the_rule_are_a_400(name, action, server, adapted):
    _, a, _ = adapted
    status, body = post(f"{server.url}/v1/adapters", {"action": action, "name": name, "path": str(a)})
    openai_error(status, body, "name", "a name is 1 to 128 printable characters (no newline, NUL or other control")
    assert len(body["error"]["message"]) < 300


def test_a_catastrophic_pattern_neither_freezes_the_server_nor_changes_the_result(server, adapted, tmp_path):
    """A rank_pattern key that Python's re (PEFT's) backtracks on for ages on every name it does not
    match (3^n ways to split one) holds the GIL: the whole server, /health included, froze, and
    SIGTERM went unheard. Matched in linear time, the load answers, /health answers meanwhile, and
    the key means what it means to PEFT: its plain equivalent ("o_proj") gives the same text."""
    folder, _, _ = adapted
    plain = peft_adapter(folder, tmp_path / "plain", seed=3, r=4, lora_alpha=8, target_modules=ATTN_MLP,
                         rank_pattern={"o_proj": 2})[0]
    hostile = altered(plain, tmp_path / "hostile", {"rank_pattern": {r"(\w|\w|.)*o_proj": 2}})
    url, base = f"{server.url}/v1/adapters", folder.name
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(post, url, {"action": "load", "name": "cat", "path": str(hostile)})
        deadline = time.monotonic() + 120  # a hang guard only
        while True:
            assert server.health()["status"] == "ok"  # answers within 5 s each time
            if wait_for([load], timeout=0.2).done or time.monotonic() > deadline:
                break
        status, listing = load.result(timeout=1)
    assert server.health()["status"] == "ok"
    assert status == 200 and f"{base}:cat" in [d["id"] for d in listing["data"]], listing
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model=f"{base}:cat", prompt=PROMPT, **OPTS)
    assert r.choices[0].text == library_text(folder, plain) != library_text(folder, None)
    assert post(url, {"action": "unload", "name": "cat"})[0] == 200


def test_loading_an_adapter_does_not_stall_other_streams(adapted, tmp_path):
    """The load's reading, checking and computing run off the engine thread: held mid-read (the
    fault server's adapter gate), the load leaves other requests answered; let go, it loads an
    adapter made on another thread that serves requests exactly as the library's."""
    folder, _, b = adapted
    gate, reading = tmp_path / "gate", tmp_path / "reading"
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MLXINFER_TEST_GATE": str(gate), "MLXINFER_TEST_GATE_ADAPTER": str(reading)}
    s = Server(["-m", str(folder), "--api-key", KEY], env=env,
               script=[sys.executable, str(Path(__file__).parent / "fault_server.py")])
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(post, f"{s.url}/v1/adapters", {"action": "load", "name": "c", "path": str(b)})
            deadline = time.monotonic() + 60  # a hang guard only
            while not reading.exists() and not load.done() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert reading.exists() and not load.done()  # the load is held inside its reading
            r = client.completions.create(model=folder.name, prompt=PROMPT, **OPTS)
            assert r.choices[0].text == library_text(folder, None)
            assert not load.done()
            gate.touch()
            status, listing = load.result(timeout=120)
        assert status == 200 and [d["name"] for d in listing["data"]] == ["c"]
        r = client.completions.create(model=f"{folder.name}:c", prompt=PROMPT, **OPTS)
        assert r.choices[0].text == library_text(folder, b)
    finally:
        gate.touch()
        s.stop()
