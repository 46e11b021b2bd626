"""Many models in one server: `mlxinfer serve` with no --model serves every model in its store by
name, loads each on its first request, unloads it when idle (keep-alive) or when another needs
the room (least recently used first, never one in use), refuses a model too big for its budget,
and keeps other models streaming while one loads.

The oracles: transformers' greedy decoding of each checkpoint (each model answers as itself),
the official `openai` and `anthropic` clients, and MLX's own count of the memory it holds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from serving import Server

openai = pytest.importorskip("openai")
NAMES = ("alpha", "beta", "gamma")
LONG = 1 << 16  # context of the tiny models: room for a stream that outlasts what a test does meanwhile


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> dict[str, Path]:
    """Three tiny Llamas with different weights (a different seed each)."""
    return {name: hf_checkpoint("llama", seed=seed, head_dim=32, max_position_embeddings=LONG)
            for seed, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def home(checkpoints, tmp_path_factory) -> Path:
    """An mlxinfer home whose store holds alpha and beta (and gamma under `home / "three"`)."""
    root = tmp_path_factory.mktemp("store")
    for home, names in ((root / "two", NAMES[:2]), (root / "three", NAMES)):
        for name in names:
            shutil.copytree(checkpoints[name], home / "models" / name)
    return root


def serve(home: Path, *args: str, three: bool = False) -> Server:
    """`serve` over the store of two models (or `three`), no other model within reach (an empty
    Hugging Face cache)."""
    return Server(["--dtype", "float32", "--no-web", *args],
                  env={"MLXINFER_HOME": str(home / ("three" if three else "two")), "HF_HOME": str(home / "hf")})


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def loaded(server: Server) -> dict[str, bool]:
    return {m.id: m.model_extra["loaded"] for m in client(server).models.list().data}


def greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt` by the checkpoint in `folder`, its ends suppressed."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             suppress_tokens=no_end(folder))
    return out[0, len(prompt):].tolist()


def ids_of(completion) -> list[int]:
    return [t["id"] for t in completion.choices[0].model_extra["token_details"]]


class Stream:
    """A streamed completion on `model` that runs until closed (its ends biased away, a long
    `max_tokens`): it holds its model while the test does something else."""

    def __init__(self, url: str, model: str, no_end: list[int]):
        body = {"model": model, "prompt": "once upon a time", "max_tokens": LONG // 2, "temperature": 0,
                "stream": True, "logit_bias": {str(t): -100 for t in no_end}}
        request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        self.response = urllib.request.urlopen(request, timeout=120)
        self.count = 0
        self.counted = threading.Condition()
        self.ended = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.response:  # leaving closes the connection: the server cancels the stream
            for line in self.response:
                if self.stop.is_set():
                    break
                if line.startswith(b"data: {"):
                    with self.counted:
                        self.count += 1
                        self.counted.notify_all()
        with self.counted:
            self.ended = True
            self.counted.notify_all()

    def wait_for(self, count: int) -> int:
        """Once `count` events came (a hang guard only bounds the wait)."""
        with self.counted:
            assert self.counted.wait_for(lambda: self.count >= count or self.ended, timeout=120)
            assert not self.ended, "the stream ended early"
            return self.count

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def no_end(folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return sorted({t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None})


@pytest.fixture(scope="module")
def server(home):
    s = serve(home, "--keep-alive", "-1")
    yield s
    s.stop()


def test_each_model_answers_by_name_as_itself(server, checkpoints):
    """With no --model, every model of the store is listed and none is loaded; each answers by its
    name with its own weights (transformers' greedy continuation), and is then marked loaded."""
    assert loaded(server) == {"alpha": False, "beta": False}
    prompt = [5, 9, 23, 41, 7]
    want = {name: greedy(checkpoints[name], prompt, 6) for name in ("alpha", "beta")}
    assert want["alpha"] != want["beta"]

    def ask(name: str) -> list[int]:
        reply = client(server).completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0,
                                                  logit_bias={str(t): -100 for t in no_end(checkpoints[name])},
                                                  extra_body={"return_token_details": True})
        assert reply.model == name
        return ids_of(reply)

    for name in ("alpha", "beta"):
        assert ask(name) == want[name]
    assert loaded(server) == {"alpha": True, "beta": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # both models at once, two requests each
        names = ["alpha", "beta", "alpha", "beta"]
        assert list(pool.map(ask, names)) == [want[n] for n in names]
    health = server.health()
    assert set(health["models"]) == {"alpha", "beta"} and health["waiting"] == {}


def test_an_unknown_model_is_a_404_naming_those_served(server):
    with pytest.raises(openai.NotFoundError) as e:
        client(server).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-4o" in e.value.message and "alpha" in e.value.message and "beta" in e.value.message


def test_keep_alive_0_unloads_after_the_reply_and_frees_the_memory(home):
    """`--keep-alive 0`: the model unloads once its reply is done, and MLX's active memory returns
    to what it was before the model loaded (within a tenth of the model's weights)."""
    server = serve(home, "--keep-alive", "0")
    try:
        before = server.health()["memory"]["mlx_active_bytes"]
        weights = sum(f.stat().st_size for f in (home / "two" / "models" / "alpha").glob("*.safetensors"))
        reply = client(server).chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4)
        assert reply.model == "alpha"
        after = server.wait_for(lambda h: not h["models"] and not h["unloading"])
        assert after["models"] == {} and after["unloading"] == [], "the model stayed loaded"
        assert loaded(server) == {"alpha": False, "beta": False}
        assert after["memory"]["mlx_active_bytes"] - before < weights / 10
    finally:
        server.stop()


def test_the_least_recently_used_idle_model_goes_when_the_budget_is_full(home):
    """A budget room for two of three models: loading the third unloads the one used longest ago
    (beta: alpha was used again after it), not the first loaded."""
    from mlxinfer.serve.models import estimate_memory

    one = estimate_memory(home / "three" / "models" / "alpha", max_concurrency=8, prompt_cache_bytes=1 << 30)
    server = serve(home, "--keep-alive", "-1", "--memory-budget", str(one * 5 // 2), three=True)
    try:
        ask = client(server)
        for name in ("alpha", "beta", "alpha", "gamma"):
            assert ask.completions.create(model=name, prompt="hi", max_tokens=2).model == name
        assert loaded(server) == {"alpha": True, "beta": False, "gamma": True}
    finally:
        server.stop()


def test_a_model_too_big_for_the_budget_is_refused_naming_the_sizes(home):
    server = serve(home, "--memory-budget", "1000")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client(server).completions.create(model="beta", prompt="hi", max_tokens=2)
        message = e.value.message
        assert "beta" in message and "1000 B" in message and "--memory-budget" in message and "needs about" in message
        assert loaded(server) == {"alpha": False, "beta": False}
    finally:
        server.stop()


def test_a_streaming_model_is_never_evicted_the_other_waits(home, checkpoints):
    """--max-loaded-models 1: while alpha streams, a request for beta waits (alpha stays loaded and
    keeps streaming); once alpha's stream ends, alpha is unloaded and beta answers."""
    server = serve(home, "--keep-alive", "-1", "--max-loaded-models", "1")
    stream = None
    try:
        stream = Stream(server.url, "alpha", no_end(checkpoints["alpha"]))
        stream.wait_for(3)
        answered: dict[str, object] = {}
        asker = threading.Thread(target=lambda: answered.update(
            reply=client(server).completions.create(model="beta", prompt="hi", max_tokens=2)), daemon=True)
        asker.start()
        health = server.wait_for(lambda h: h["waiting"].get("beta"))
        assert health["waiting"] == {"beta": 1} and set(health["models"]) == {"alpha"}
        seen = stream.count
        stream.wait_for(seen + 3)  # alpha goes on streaming while beta waits
        assert "reply" not in answered and set(server.health()["models"]) == {"alpha"}
        stream.close()
        asker.join(120)
        assert answered["reply"].model == "beta"
        assert loaded(server) == {"alpha": False, "beta": True}
    finally:
        if stream is not None:
            stream.close()
        server.stop()


def test_anthropics_client_lists_and_retrieves_models_in_its_shape(server):
    """`anthropic-version` on GET /v1/models: Anthropic's ModelInfo (type, id, display_name,
    created_at as a datetime) and its page (first_id, last_id, has_more), followed by the client's
    own pagination; an unknown id is its NotFoundError."""
    anthropic = pytest.importorskip("anthropic")
    ask = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    models = list(ask.models.list(limit=1))  # one a page: the client pages through has_more and last_id
    assert [m.id for m in models] == ["alpha", "beta"]
    for m in models:
        assert m.type == "model" and m.display_name == m.id and m.created_at.tzinfo is not None
        assert m.model_extra["loaded"] is loaded(server)[m.id]
    page = ask.models.list()
    assert (page.first_id, page.last_id, page.has_more) == ("alpha", "beta", False)
    beta = ask.models.retrieve("beta")
    assert (beta.id, beta.type, beta.display_name) == ("beta", "model", "beta") and beta.created_at is not None
    with pytest.raises(anthropic.NotFoundError) as e:
        ask.models.retrieve("claude-nothing")
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nothing" in e.value.message


def test_an_endpoint_we_do_not_have_is_a_404_whatever_the_body(server, tmp_path):
    """The openai client's multipart uploads (files, audio transcriptions) to routes that do not
    exist: NotFoundError, not a refusal of the content type."""
    upload = tmp_path / "a.jsonl"
    upload.write_bytes(b"{}\n")
    with pytest.raises(openai.NotFoundError):
        client(server).files.create(file=upload.open("rb"), purpose="batch")
    with pytest.raises(openai.NotFoundError) as e:
        client(server).audio.transcriptions.create(file=("a.wav", b"RIFF0000WAVE"), model="whisper-1")
    assert "/v1/audio/transcriptions" in e.value.message


# --- in process: a load held on an event ---

class HeldLoads:
    """An opener that loads as `serve` does, but holds beta's load until `release` is set."""

    def __init__(self, opening):
        self.opening = opening
        self.entered, self.release = threading.Event(), threading.Event()
        self.opened: list[str] = []

    def __call__(self, entry, metrics):
        self.opened.append(entry.name)
        if entry.name == "beta":
            self.entered.set()
            assert self.release.wait(120)
        return self.opening(entry, metrics)


@contextlib.contextmanager
def in_process(home: Path, wrap: Callable = lambda opening: opening, **policy) -> Iterator[tuple[str, Any]]:
    """The server of the two-model store run in this process (uvicorn on a thread) under
    `policy`, its models opened by `wrap(opening)` (`opening`: as `serve` opens them); its URL
    and that opener."""
    import uvicorn

    from mlxinfer.cli.serve import Opening, listed
    from mlxinfer.serve.app import ServerConfig, create_app
    from mlxinfer.serve.models import Models, Policy
    from serving import free_port

    os.environ["MLXINFER_HOME"], old = str(home / "two"), os.environ["MLXINFER_HOME"]
    try:
        entries = [e for e in listed() if e.name in NAMES]
    finally:
        os.environ["MLXINFER_HOME"] = old
    opening = Opening(None, "float32", 8, 32, 0, {})
    opener = wrap(opening)
    models = Models(lambda: entries, opener, opening.estimate, Policy(**{"keep_alive": -1, **policy}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(models, ServerConfig(web=False)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            threading.Event().wait(0.05)
        yield f"http://127.0.0.1:{port}", opener
    finally:
        server.should_exit = True
        thread.join(30)
        models.stop()


def test_a_stream_goes_on_while_another_model_loads(home, checkpoints):
    """While beta's load is held (on the load thread), alpha's stream keeps producing; two
    requests for beta wait for the one load, then both are answered."""
    stream = None
    with in_process(home, HeldLoads) as (url, held):
        try:
            stream = Stream(url, "alpha", no_end(checkpoints["alpha"]))
            stream.wait_for(3)
            replies: list = []
            askers = [threading.Thread(target=lambda: replies.append(openai.OpenAI(
                base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120).completions.create(
                model="beta", prompt="hi", max_tokens=2)), daemon=True) for _ in range(2)]
            for asker in askers:
                asker.start()
            assert held.entered.wait(120)
            seen = stream.count
            stream.wait_for(seen + 5)  # alpha streams on while beta loads
            assert not replies
            held.release.set()
            for asker in askers:
                asker.join(120)
            assert [r.model for r in replies] == ["beta", "beta"] and held.opened == ["alpha", "beta"]
        finally:
            held.release.set()
            if stream is not None:
                stream.close()


def test_a_request_that_waits_too_long_for_room_is_a_503_naming_the_busy_model(home, checkpoints):
    """One model at most, a load wait of 0.5 s: while alpha streams, a request for beta is
    answered 503 with Retry-After, naming alpha, by the official `openai` and `ollama` clients
    (each its own error type); beta never loads, alpha streams on."""
    ollama = pytest.importorskip("ollama")
    stream = None
    with in_process(home, max_loaded=1, load_wait=0.5) as (url, _):
        try:
            stream = Stream(url, "alpha", no_end(checkpoints["alpha"]))
            stream.wait_for(3)
            ask = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            with pytest.raises(openai.InternalServerError) as e:
                ask.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) > 0
            assert "'alpha'" in e.value.message and "beta" in e.value.message and "--max-loaded-models" in e.value.message
            with pytest.raises(ollama.ResponseError) as e:
                ollama.Client(host=url, timeout=120).chat(model="beta", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 503 and "'alpha'" in e.value.error
            stream.wait_for(stream.count + 3)
            health = json.load(urllib.request.urlopen(f"{url}/health", timeout=5))
            assert set(health["models"]) == {"alpha"} and health["waiting"] == {}
        finally:
            if stream is not None:
                stream.close()


def test_a_request_waiting_for_room_stops_when_its_client_hangs_up(home, checkpoints):
    """--max-loaded-models 1: while alpha streams, two requests for beta (streamed and not) wait
    for room; their clients hang up and they stop waiting (the server's count of waiting requests
    drops to none), so once alpha's stream ends nothing unloads it to load beta."""
    server = serve(home, "--keep-alive", "-1", "--max-loaded-models", "1")
    stream = None
    try:
        stream = Stream(server.url, "alpha", no_end(checkpoints["alpha"]))
        stream.wait_for(3)
        waiting = []
        for streamed in (False, True):
            body = json.dumps({"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                               "stream": streamed}).encode()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            waiting.append(sock)
            assert server.wait_for(lambda h: h["waiting"].get("beta") == len(waiting))["waiting"] == \
                {"beta": len(waiting)}
        for sock in waiting:
            sock.close()
        assert server.wait_for(lambda h: not h["waiting"])["waiting"] == {}, "the requests still wait"
        stream.close()
        assert loaded(server) == {"alpha": True, "beta": False}
    finally:
        if stream is not None:
            stream.close()
        server.stop()


# --- mlxinfer ps ---

def ps_body(expires: str) -> dict:
    """/api/ps as a real Ollama server answered it (two models loaded), with `expires` as the
    first one's expiry; the second never unloads (Ollama writes a time centuries away)."""
    details = {"parent_model": "", "format": "gguf", "family": "qwen2", "families": ["qwen2"],
               "parameter_size": "7.6B", "quantization_level": "Q4_K_M"}
    return {"models": [
        {"name": "qwen2.5-coder:7b", "model": "qwen2.5-coder:7b", "size": 5618579456,
         "digest": "dae161e27b0e90dd1856c8bb3209201fd6736d8eb66298e75ed87571486f4364", "details": details,
         "expires_at": expires, "size_vram": 5618579456, "context_length": 4096},
        {"name": "mistral:7b-instruct", "model": "mistral:7b-instruct", "size": 5560649728,
         "digest": "3944fe81ec14610e0852c3d915768ee8d507ea541387fdfcbbf9edaa0c757734",
         "details": {**details, "family": "llama", "families": ["llama"], "parameter_size": "7.2B",
                     "quantization_level": "Q4_0"},
         "expires_at": "2318-08-27T06:42:11.123456789+02:00", "size_vram": 5560649728, "context_length": 4096}]}


def test_ps_reads_ollamas_api_ps(tmp_path):
    """`mlxinfer ps` against a stand-in for a server's GET /api/ps answering what Ollama does:
    each model's name, size and expiry as `ollama ps` prints them ("5.6 GB", "4 minutes from now")."""
    from datetime import datetime, timedelta, timezone
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    soon = (datetime.now(timezone(timedelta(hours=2))) + timedelta(minutes=4, seconds=30)).isoformat()

    class Ps(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(ps_body(soon)).encode() if self.path == "/api/ps" else b"{}"
            self.send_response(200 if self.path == "/api/ps" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    fake = ThreadingHTTPServer(("127.0.0.1", 0), Ps)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        port = str(fake.server_address[1])
        result = CliRunner().invoke(main, ["ps", "--port", port])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0].split() == ["NAME", "SIZE", "FAMILY", "PARAMETERS", "QUANTIZATION", "UNTIL"]
        assert lines[1].split()[:3] == ["qwen2.5-coder:7b", "5.6", "GB"] and lines[1].endswith("4 minutes from now")
        assert lines[2].split()[:3] == ["mistral:7b-instruct", "5.6", "GB"] and lines[2].endswith("forever")
        listed = json.loads(CliRunner().invoke(main, ["ps", "--port", port, "--json"]).output)
        assert [(m["name"], m["size"]) for m in listed] == [("qwen2.5-coder:7b", 5618579456),
                                                            ("mistral:7b-instruct", 5560649728)]
        assert listed[1]["expires_at"] is None
    finally:
        fake.shutdown()
        thread.join(10)
    from serving import free_port

    nobody = CliRunner().invoke(main, ["ps", "--port", str(free_port())])
    assert nobody.exit_code == 1 and nobody.output.count("\n") == 1 and "mlxinfer serve" in nobody.output


# --- the registry's policy, on stand-in models ---

class FakeEngine:
    """Stands in for a model's EngineThread: what the registry calls on it."""

    def __init__(self):
        self.stopped = threading.Event()
        self.health, self.preparing = {}, 0

    def stop(self):
        self.stopped.set()

    shutdown = stop


def registry(names=("a", "b"), opening=lambda name: None, **policy):
    """A registry of stand-in models of 1000 bytes each (`opening(name)` called on the load
    thread as each opens), and the engines it opened by name."""
    from types import SimpleNamespace

    from mlxinfer.serve.models import Loaded, ModelEntry, Models, Policy

    opened: dict[str, FakeEngine] = {}

    def opener(entry, metrics):
        opening(entry.name)
        opened[entry.name] = FakeEngine()
        return Loaded(opened[entry.name], SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64)), None)

    entries = [ModelEntry(n, Path(n), 1000, "llama", 1, "float32", 0.0) for n in names]
    return Models(lambda: entries, opener, lambda e: 1000, Policy(**{"memory_budget": 10_000, **policy})), opened


def test_a_requests_keep_alive_sets_its_models_expiry():
    """keep_alive per request, as Ollama's: seconds from the reply (its expiry), negative: never,
    0: unloaded once the reply is done; None: the server's --keep-alive."""
    import asyncio
    import time

    async def run():
        models, opened = registry(keep_alive=300)
        async with models.use("a", keep_alive=60):
            pass
        (a,) = [e.served for e in models.listing() if e.served]
        assert 59 < a.expires_at - time.time() <= 60
        async with models.use("a"):
            pass
        assert 299 < models.loaded()[0].expires_at - time.time() <= 300
        async with models.use("a", keep_alive=-1):
            pass
        assert models.loaded()[0].expires_at is None
        async with models.use("a", keep_alive=0):
            assert models.loaded()[0].name == "a"  # held while the block runs
        while models.loaded():
            await asyncio.sleep(0.01)  # the unload runs on a worker thread
        assert opened["a"].stopped.is_set()

    asyncio.run(run())


def test_unload_waits_for_the_request_using_the_model():
    """`unload` of a model in use: it stays loaded until its request ends, whatever keep-alive
    that request asks, then goes."""
    import asyncio

    async def run():
        models, opened = registry()
        async with models.use("b", keep_alive=-1):
            await models.unload("b")
            assert [s.name for s in models.loaded()] == ["b"] and not opened["b"].stopped.is_set()
        while models.loaded():
            await asyncio.sleep(0.01)
        assert opened["b"].stopped.is_set()
        first = opened["b"]
        async with models.use("b", keep_alive=-1):  # an idle model unloads at once; a later request loads it again
            pass
        assert opened["b"] is not first
        await models.unload("b")
        assert models.loaded() == [] and opened["b"].stopped.is_set()

    asyncio.run(run())


def test_a_model_whose_waiters_all_left_during_its_load_still_expires():
    """The only request for b is cancelled (its client left) while b loads: the load goes on, and
    b's keep-alive countdown starts as it ends (0 here: b unloads at once), so it does not stay
    loaded for ever with no request to start one."""
    import asyncio

    async def run():
        entered, release = threading.Event(), threading.Event()

        def held(name):
            entered.set()
            assert release.wait(60)

        models, opened = registry(keep_alive=0, opening=held)

        async def ask():
            async with models.use("b"):
                pass

        task = asyncio.ensure_future(ask())
        assert await asyncio.to_thread(entered.wait, 60)
        task.cancel()
        release.set()
        while "b" not in opened or not opened["b"].stopped.is_set():
            await asyncio.sleep(0.01)  # the load ends on the load thread, then the unload on a worker
        assert models.loaded() == []

    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_name_not_served_is_refused_and_one_model_answers_to_any():
    import asyncio

    from mlxinfer.serve.errors import RequestError

    async def run():
        models, _ = registry()
        with pytest.raises(RequestError) as e:
            async with models.use("c"):
                pass
        assert e.value.status == 404 and "'c'" in str(e.value) and "a, b" in str(e.value)
        one, _ = registry(names=("only",))
        async with one.use("gpt-4o") as served:  # clients send their own defaults
            assert served.name == "only"

    asyncio.run(run())


def test_named_models_with_an_alias_and_a_draft_model_for_the_default(home, checkpoints):
    """`--model NAME=PATH` serves PATH as NAME, the first `--model` is the default (a request naming
    none, and the one the `--draft-model` drafts for); speculation leaves greedy replies as they are."""
    store = home / "two" / "models"
    server = serve(home, "-m", f"first={store / 'alpha'}", "-m", str(store / "beta"), "--draft-model",
                   str(store / "beta"))
    try:
        assert loaded(server) == {"first": True, "beta": False}  # the default loads before the server listens
        prompt = [5, 9, 23, 41, 7]
        reply = client(server).completions.create(model="first", prompt=prompt, max_tokens=6, temperature=0,
                                                  logit_bias={str(t): -100 for t in no_end(checkpoints["alpha"])},
                                                  extra_body={"return_token_details": True})
        assert reply.model == "first" and ids_of(reply) == greedy(checkpoints["alpha"], prompt, 6)
        with pytest.raises(openai.NotFoundError):
            client(server).completions.create(model="alpha", prompt="hi", max_tokens=2)  # served as "first"
    finally:
        server.stop()


def test_the_preloaded_default_models_keep_alive_starts_with_the_server(home):
    """`serve -m alpha --keep-alive 8`: the default model loads before the server listens and,
    asked nothing, its countdown runs from the start, as if it had just been used: the official
    `ollama` client's `ps()` shows it expiring 8 s after the start, and it unloads then."""
    import time

    ollama = pytest.importorskip("ollama")
    started = time.time()
    server = serve(home, "-m", str(home / "two" / "models" / "alpha"), "--keep-alive", "8")
    try:
        ready = time.time()
        (running,) = ollama.Client(host=server.url).ps().models
        assert running.model == "alpha"
        assert started + 8 - 1 <= running.expires_at.timestamp() <= ready + 8 + 1
        after = server.wait_for(lambda h: not h["models"] and not h["unloading"])
        assert after["models"] == {} and loaded(server) == {"alpha": False}
    finally:
        server.stop()


def test_ps_against_a_live_server_agrees_with_its_api_ps_and_the_ollama_client(home):
    """`mlxinfer ps` (the command, in its own process) against a live `serve` of alpha and beta
    after a request to alpha with keep_alive 10m: it lists alpha alone, with the size, details and
    expiry the server's GET /api/ps gives and the official `ollama` client's `ps()` reads."""
    import subprocess
    import sys
    from datetime import datetime

    ollama = pytest.importorskip("ollama")
    server = serve(home, "--keep-alive", "-1")
    try:
        asker = ollama.Client(host=server.url)
        empty = subprocess.run([sys.executable, "-m", "mlxinfer", "ps", "--port", str(server.port)],
                               capture_output=True, text=True, timeout=120, check=True).stdout
        assert "no model is loaded" in empty
        asker.generate(model="alpha", prompt="hi", keep_alive="10m", options={"num_predict": 2})

        def ps(*args: str) -> str:
            return subprocess.run([sys.executable, "-m", "mlxinfer", "ps", "--port", str(server.port), *args],
                                  capture_output=True, text=True, timeout=120, check=True).stdout

        (listed,) = json.loads(ps("--json"))
        (raw,) = json.load(urllib.request.urlopen(f"{server.url}/api/ps", timeout=30))["models"]
        (seen,) = asker.ps().models
        assert listed["name"] == raw["name"] == seen.model == "alpha"
        assert listed["size"] == raw["size"] == seen.size > 0
        assert (listed["family"], listed["parameters"], listed["quantization"]) == \
            (seen.details.family, seen.details.parameter_size, seen.details.quantization_level)
        assert datetime.fromisoformat(listed["expires_at"]) == seen.expires_at
        header, *rows = ps().splitlines()
        assert header.split() == ["NAME", "SIZE", "FAMILY", "PARAMETERS", "QUANTIZATION", "UNTIL"]
        assert len(rows) == 1 and rows[0].split()[0] == "alpha" and seen.details.family in rows[0].split()
        assert rows[0].endswith(("9 minutes from now", "10 minutes from now"))
    finally:
        server.stop()
