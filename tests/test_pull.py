"""`mlxinfer.convert.pull`: models pulled into our cache from a local Hugging Face folder, a GGUF
file and a GGUF URL (a local HTTP server on 127.0.0.1; nothing leaves the machine), then loaded
and run. Oracles: mlx-lm's converter (a pulled float model is what `mlx_lm.convert -q` makes), the
float weights transformers wrote (parameter counts), the served file's own SHA-256 (a resumed
download), and the HTTP Range rules of RFC 9110 (what a resume asks for)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.base.errors import DownloadError, MlxinferError, ModelExistsError, ModelNotFoundError
from mlxinfer.convert.pull import PullProgress, download, pull
from mlxinfer.loading import store
import test_cli
from test_cli import float_parameters

tiny_gguf = test_cli.tiny_gguf  # the fixture: the tiny llama as a Q4_1 GGUF, written with the gguf package
IDS = np.random.default_rng(0).integers(0, 500, size=(2, 16))
TOL = 1e-5


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def logits(model) -> np.ndarray:
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def generates(path: Path, n: int = 4) -> None:
    model, tokenizer = mlxinfer.load(path)
    chunks = list(mlxinfer.stream_generate(model, tokenizer, "Hello", max_tokens=n, temperature=0.0, ignore_eos=True))
    assert len(chunks) == n


def test_pull_a_float_folder_makes_what_mlx_lm_makes(hf_checkpoint, mlx_lm_quantized, isolated_home, tmp_path):
    import mlx_lm

    src = tmp_path / "SmolLM2-Tiny-Instruct"
    shutil.copytree(hf_checkpoint("llama"), src)
    events: list[PullProgress] = []
    model = pull(str(src), progress=events.append)
    # the naming: the repo name in lowercase and how it is stored (4-bit by default)
    assert (model.name, model.where) == ("smollm2-tiny-instruct-4bit", "mlxinfer")
    assert model.path == isolated_home / "models" / model.name
    assert events[0].status.startswith("converting") and events[-1] == PullProgress("success")
    ref = mlx_lm_quantized(hf_checkpoint("llama"), bits=4, group_size=64)  # mlx-lm's defaults for -q
    ours = mlxinfer.load(model.path)[0]
    np.testing.assert_allclose(logits(ours), logits(mlx_lm.load(str(ref))[0]), atol=TOL, rtol=0)
    generates(model.path)
    listed = {m.name: m for m in store.local_models()}
    assert listed[model.name].parameters == float_parameters(src)
    # a second pull is refused before any work, saying how to replace it; after rm, the same name
    with pytest.raises(ModelExistsError, match="already in mlxinfer's cache.*mlxinfer rm smollm2-tiny-instruct-4bit") as e:
        pull(str(src))
    assert e.value.name == model.name  # what a caller for whom "already there" is success looks up
    store.remove(model.name)
    assert pull(str(src), bits=8).name == "smollm2-tiny-instruct-8bit"
    assert pull(str(src)).name == model.name
    assert pull(str(src), name="mine").name == "mine"


def test_pull_a_gguf_file_keeps_its_precision_and_runs(tiny_gguf, hf_checkpoint, isolated_home):
    model = pull(str(tiny_gguf))
    assert model.name == "tiny-q4_1" and model.family == "llama"
    assert model.parameters == float_parameters(hf_checkpoint("llama"))
    assert model.quantization == "4-bit g32"  # Q4_1: 32 weights a block, a scale and a minimum each
    generates(model.path)
    assert tiny_gguf.is_file()  # a local source is never moved or deleted


def test_pull_refuses_what_it_cannot_use(tmp_path, isolated_home):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        pull(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        pull(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="not a hub id"):
        pull(str(tmp_path / "missing.gguf"))
    with pytest.raises(Exception, match="--bits and --recipe"):
        pull("org/model", bits=4, recipe="mixed-4-6")
    with pytest.raises(ModelNotFoundError, match="does not name a .gguf file"):
        pull("http://127.0.0.1:9/model.bin")
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE is set; unset it"):
        pull("org/model")
    # a caller that lets its clients name hub ids only (a server): no path is looked at, no URL fetched
    hub_only = frozenset({"hub"})
    for source, kind in ((str(tmp_path / "empty"), "not a hub id"), ("http://127.0.0.1:9/m.gguf", "is a GGUF URL")):
        with pytest.raises(MlxinferError, match=kind):
            pull(source, kinds=hub_only)
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE"):
        pull("org/model", kinds=hub_only)
    assert not (isolated_home / "models").exists()


# downloading a GGUF URL, with resume


class LocalServer:
    """`handler` serving on 127.0.0.1 on a free port, in a thread, until `close`."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


class FileServer(LocalServer):
    """Serves `data` at /<name> on 127.0.0.1 with an ETag and byte ranges (RFC 9110: `Range` is
    honoured only while `If-Range` matches the current ETag). `cut` makes the next full response
    stop after that many bytes and drop the connection, as a network failure does."""

    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data, self.cut, self.requests = name, data, None, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append(dict(self.headers))
                if self.path != f"/{outer.name}":
                    self.send_error(404)
                    return
                etag = f'"{hashlib.sha256(outer.data).hexdigest()[:16]}"'
                start = 0
                ranged = self.headers.get("Range")
                if ranged and self.headers.get("If-Range", etag) == etag:
                    start = int(ranged.removeprefix("bytes=").rstrip("-"))
                    if start >= len(outer.data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(outer.data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(outer.data) - 1}/{len(outer.data)}")
                else:
                    self.send_response(200)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(outer.data) - start))
                self.end_headers()
                body = outer.data[start:]
                if outer.cut is not None:
                    body, outer.cut = body[: outer.cut], None
                    self.wfile.write(body)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler)
        self.url += f"/{name}"


@pytest.fixture
def serve():
    servers: list[FileServer] = []

    def start(name: str, data: bytes) -> FileServer:
        servers.append(FileServer(name, data))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_an_interrupted_download_resumes_where_it_stopped(serve, tmp_path):
    data = np.random.default_rng(1).integers(0, 256, size=(3 << 20) + 12345, dtype=np.uint8).tobytes()
    server = serve("model.gguf", data)
    dest = tmp_path / "downloads" / "model.gguf"
    server.cut = len(data) // 2
    events: list[PullProgress] = []
    with pytest.raises(DownloadError, match="run the same pull again"):
        download(server.url, dest, events.append)
    part = dest.with_name("model.gguf.part")
    assert not dest.exists() and part.stat().st_size == len(data) // 2
    assert all(e.total == len(data) for e in events) and events[-1].completed == len(data) // 2
    events.clear()
    assert download(server.url, dest, events.append) == dest
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    resumed = server.requests[-1]
    assert resumed["Range"] == f"bytes={len(data) // 2}-" and resumed["If-Range"].startswith('"')
    assert events[0].completed == len(data) // 2 and events[-1] == PullProgress(
        "downloading model.gguf", len(data), len(data))
    assert not part.exists() and sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]


def test_a_changed_file_is_downloaded_again_not_spliced(serve, tmp_path):
    old = bytes(range(256)) * 4096
    server = serve("model.gguf", old)
    dest = tmp_path / "model.gguf"
    server.cut = 1000
    with pytest.raises(DownloadError):
        download(server.url, dest)
    server.data = bytes(reversed(range(256))) * 5000  # a new version: its ETag differs, If-Range fails
    download(server.url, dest)
    assert dest.read_bytes() == server.data


def test_pull_a_gguf_url_then_nothing_is_left_but_the_model(serve, tiny_gguf, hf_checkpoint, isolated_home):
    server = serve("tiny.Q4_1.gguf", tiny_gguf.read_bytes())
    server.cut = 4096
    with pytest.raises(DownloadError):
        pull(server.url)
    assert store.local_models() == []  # an interrupted pull: a resumable part file, no model
    events: list[PullProgress] = []
    model = pull(server.url, progress=events.append)
    assert model.name == "tiny-q4_1" and model.parameters == float_parameters(hf_checkpoint("llama"))
    downloads = [e for e in events if e.status.startswith("downloading")]
    assert downloads[0].completed == 4096 and downloads[-1].completed == tiny_gguf.stat().st_size
    assert list((isolated_home / "downloads").iterdir()) == []
    generates(model.path)
    assert json.loads((model.path / "config.json").read_text())["model_type"] == "llama"
    assert os.listdir(isolated_home / "models") == [model.name]


def test_the_pull_bar_shows_bytes_and_rate_on_a_terminal_and_few_lines_elsewhere():
    import io

    from mlxinfer.cli.terminal import PullBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    total = 10 << 20
    events = [PullProgress("pulling manifest of org/model")]
    events += [PullProgress("downloading org/model", total, n) for n in range(0, total + 1, 1 << 18)]
    events += [PullProgress("converting model into model-4bit"), PullProgress("success")]
    log = io.StringIO()
    ticks = iter(range(10**6))
    bar = PullBar(log, clock=lambda: next(ticks) / 4)  # a quarter second an event: 1 MiB a second
    for e in events:
        bar(e)
    bar.close()
    lines = log.getvalue().splitlines()
    downloads = [line for line in lines if line.startswith("downloading")]
    assert len(downloads) == 11 and "100%" in downloads[-1] and "10.5 MB / 10.5 MB" in downloads[-1]
    assert downloads[-1].endswith("1.0 MB/s") and downloads[5].startswith("downloading org/model  50%")
    assert lines[0] == "pulling manifest of org/model" and lines[-2:] == ["converting model into model-4bit", "success"]
    tty = Terminal()
    bar = PullBar(tty, interval=0)
    for e in events:
        bar(e)
    bar.close()
    drawn = tty.getvalue()
    assert drawn.count("\r\x1b[K") == sum(1 for e in events if e.completed is not None) and "\x1b" not in log.getvalue()


# a hub id, against a stand-in for the hub on 127.0.0.1 (HF_ENDPOINT), through the real huggingface_hub


class FakeHub(LocalServer):
    """The two hub routes huggingface_hub uses to download a repo: the model's info with its files
    and sizes (`/api/models/ORG/NAME`), and each file (`/ORG/NAME/resolve/REV/FILE`, HEAD and GET,
    with the commit and ETag headers the hub sends). Records the files asked for."""

    SHA = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, repo: str, files: dict[str, bytes]) -> None:
        self.repo, self.files, self.fetched = repo, files, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self.answer(body=False)

            def do_GET(self) -> None:
                self.answer(body=True)

            def answer(self, body: bool) -> None:
                path = self.path.split("?")[0]
                if path in (f"/api/models/{outer.repo}", f"/api/models/{outer.repo}/revision/main"):
                    siblings = [{"rfilename": f, "size": len(d), "blobId": hashlib.sha1(d).hexdigest()}
                                for f, d in outer.files.items()]
                    data = json.dumps({"id": outer.repo, "modelId": outer.repo, "sha": outer.SHA,
                                       "private": False, "siblings": siblings}).encode()
                    self.send(data, {"Content-Type": "application/json"}, body)
                    return
                prefix = f"/{outer.repo}/resolve/{outer.SHA}/"
                name = path.removeprefix(prefix)
                if not path.startswith(prefix) or name not in outer.files:
                    self.send(b"{}", {"X-Error-Code": "EntryNotFound"}, body, 404)
                    return
                if body:
                    outer.fetched.append(name)
                data = outer.files[name]
                self.send(data, {"X-Repo-Commit": outer.SHA, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)

            def send(self, data: bytes, headers: dict, body: bool, code: int = 200) -> None:
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler)


def test_pull_a_hub_id_downloads_what_loading_needs_and_converts_it(hf_checkpoint, tmp_path):
    import subprocess
    import sys

    src = hf_checkpoint("llama")
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    files["pytorch_model.bin"] = b"pickled weights are never fetched"
    hub = FakeHub("org/Tiny-Hub", files)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf"),
            "MLXINFER_HOME": str(tmp_path / "home"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    try:
        done = subprocess.run([sys.executable, "-m", "mlxinfer", "pull", "org/Tiny-Hub"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    finally:
        hub.close()
    assert done.returncode == 0, done.stderr
    assert "pulled tiny-hub-4bit" in done.stdout
    assert sorted(hub.fetched) == sorted(f for f in files if f != "pytorch_model.bin")
    downloads = [line for line in done.stderr.splitlines() if line.startswith("downloading org/Tiny-Hub")]
    assert downloads and "100%" in downloads[-1], done.stderr
    folder = tmp_path / "home" / "models" / "tiny-hub-4bit"
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    listed = subprocess.run([sys.executable, "-m", "mlxinfer", "models", "--json"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    names = {m["name"]: m for m in json.loads(listed.stdout)}
    assert names["tiny-hub-4bit"]["where"] == "mlxinfer" and names["org/Tiny-Hub"]["where"] == "huggingface"
    assert names["tiny-hub-4bit"]["parameters"] == float_parameters(src)


def test_model_gguf_reuses_a_pull_and_an_older_conversion_and_keeps_two_files_apart(tiny_gguf, isolated_home,
                                                                                    tmp_path):
    """`--model FILE.gguf` names its conversion as pull does, so each finds the other's; a folder made
    under the older content-keyed name is reused as it is; another file with the same name gets
    its own folder rather than the first file's weights."""
    from mlxinfer.cli.store import gguf_in_cache
    from mlxinfer.convert.pull import gguf_key

    said: list[str] = []
    pulled = pull(str(tiny_gguf))
    assert gguf_in_cache(tiny_gguf, said.append) == pulled.path and said == []  # reused: nothing converted
    other = tmp_path / "elsewhere" / tiny_gguf.name
    other.parent.mkdir()
    other.write_bytes(tiny_gguf.read_bytes()[:-8] + bytes(8))  # the same name, other bytes
    second = gguf_in_cache(other, said.append)
    assert second == pulled.path.with_name(f"tiny-q4_1-{gguf_key(other)}") and len(said) == 1
    assert gguf_in_cache(other, said.append) == second and len(said) == 1
    # a folder made before under the older name (its files are what the conversion writes)
    older = isolated_home / "models" / f"tiny.Q4_1-{gguf_key(tiny_gguf)}"
    os.rename(pulled.path, older)
    assert gguf_in_cache(tiny_gguf, said.append) == older and len(said) == 1
