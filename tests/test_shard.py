"""Tensor parallelism on one machine: `mlx.launch` runs N ranks over 127.0.0.1 (MLX's ring
backend) and each loads its part of a test checkpoint (tests/sharded_worker.py). The oracle
is the same checkpoint in one process (itself proved against transformers and mlx-lm):
logits within 1e-4, greedy tokens equal, and each rank holding about 1/N of the bytes.
Skipped where `mlx.launch` cannot start processes."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from serving import free_ports
import test_models_deepseek as deepseek_tests
import test_models_hybrid as hybrid_tests
from test_models_gemma import VARIANTS as GEMMA
from test_models_gpt_oss import CONFIG as GPT_OSS
from test_models_moe import VARIANTS as MOE
from test_models_smollm3 import VARIANTS as SMOLLM3
from test_parity import VARIANTS as PARITY

import mlxinfer
from mlxinfer.base.errors import ConfigError, InvalidOptionError
from mlxinfer.cli.inspect_report import render
from mlxinfer.models.shard import resident_bytes, shard_config

HERE = Path(__file__).parent
FAMILIES = {"llama": PARITY["llama"], "qwen3": PARITY["qwen3"], "gemma3_text": GEMMA["gemma3_text"],
            "mixtral": MOE["mixtral-k2"], "qwen3_moe": MOE["qwen3_moe"],
            "deepseek_v2": deepseek_tests.VARIANTS["v2-q-lora-null"],
            "deepseek_v3": deepseek_tests.VARIANTS["v3-grouped-k2"], "gpt_oss": ("gpt_oss", GPT_OSS),
            "smollm3": ("smollm3", SMOLLM3["sliding-bias"])}
PROMPT = list(range(3, 40))
TIMEOUT = 120


def launcher(n: int, *args: str) -> list[str]:
    found = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
    if found is None:
        pytest.skip("mlx.launch is not installed")
    # a port block of its own: two launches on one machine (two test runs) would meet on the default
    return [found, "-n", str(n), "--backend", "ring", "--starting-port", str(free_ports(n)), "--python", sys.executable,
            *args]


def launch(n: int, *args: str, timeout: int = TIMEOUT, stdin: str | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """mlx.launch with N ranks; on a timeout the launcher and every rank it started are killed
    (they share a new process group), so a hung rank never outlives its test."""
    command = launcher(n, *args)
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.fixture(scope="session")
def can_launch(tmp_path_factory):
    """Two ranks can start and talk over loopback here, or every test in this file skips."""
    script = tmp_path_factory.mktemp("launch") / "hello.py"
    script.write_text("import mlx.core as mx\ng = mx.distributed.init()\n"
                      "print(mx.distributed.all_sum(mx.array([1.0]), group=g).item())\n")
    try:
        done = launch(2, str(script), timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"mlx.launch cannot start processes here: {e}")
    if done.returncode != 0 or done.stdout.count("2.0") != 2:
        pytest.skip(f"mlx.launch cannot start processes here: {(done.stderr or done.stdout).strip()[-300:]}")


@dataclass(frozen=True)
class Job:
    """One run of tests/sharded_worker.py: `folder` loaded across `ranks` ranks, split by tensor or pipeline."""

    folder: Path
    ranks: int
    dtype: str | None = "float32"
    split: str = "tensor"
    adapter: Path | None = None


def launch_jobs(jobs: dict[str, Job], root: Path, env: dict[str, str] | None = None) -> dict[str, list[dict] | str]:
    """{key: every rank's record of its job, or what went wrong}, the jobs run one launch per
    rank count (tests/sharded_worker.py runs each as a launch of its own would)."""
    results: dict[str, list[dict] | str] = {}
    for n in sorted({job.ranks for job in jobs.values()}):
        outs = {key: root / f"{n}-ranks-job{i}" for i, (key, job) in enumerate(jobs.items()) if job.ranks == n}
        specs = [{"model": str(jobs[key].folder), "out": str(out), "dtype": jobs[key].dtype, "split": jobs[key].split,
                  **({"adapter": str(jobs[key].adapter)} if jobs[key].adapter else {})} for key, out in outs.items()]
        for out in outs.values():
            out.mkdir(parents=True)
        (root / f"{n}-ranks.json").write_text(json.dumps(specs))
        # a hang guard only: a group left hanging is killed and every job in it fails
        done = launch(n, str(HERE / "sharded_worker.py"), str(root / f"{n}-ranks.json"),
                      timeout=TIMEOUT + 30 * len(specs), env=env)
        for key, out in outs.items():
            # mlx.launch's own status does not say when a rank failed: every rank's file must be there
            files = [out / f"rank{r}.json" for r in range(n)]
            if all(f.is_file() for f in files):
                results[key] = [json.loads(f.read_text()) for f in files]
            else:
                errors = "".join(f.read_text() for f in sorted(out.glob("rank*.error")))
                results[key] = f"{key} on {n} ranks: {errors or 'no error written'}\n{done.stdout}{done.stderr[-3000:]}"
    return results


def sharded(folder: Path, out: Path, n: int, dtype: str | None = "float32", split: str = "tensor",
            adapter: Path | None = None, env: dict[str, str] | None = None) -> list[dict]:
    """Every rank's record of `folder` (with a LoRA `adapter`) loaded across `n` ranks, in a launch of its own."""
    got = launch_jobs({"job": Job(folder, n, dtype, split, adapter)}, out, env)["job"]
    assert not isinstance(got, str), got
    return got


def alone(folder: Path, dtype: str | None = "float32") -> tuple[np.ndarray, list[int], int]:
    model, tokenizer = mlxinfer.load(folder, dtype=dtype or None)
    logits = np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))
    tokens = [c.token for c in mlxinfer.stream_generate(model, tokenizer, PROMPT, max_tokens=12, temperature=0.0,
                                                        ignore_eos=True)]
    return logits, tokens, resident_bytes(model)


def checkpoint(hf_checkpoint, family: str, **more) -> Path:
    arch, overrides = FAMILIES[family]
    if arch.startswith("deepseek"):
        return deepseek_tests.checkpoint(hf_checkpoint, arch, {**overrides, **more})
    return hf_checkpoint(arch, **{**overrides, **more})


def tensor_bytes(folder: Path) -> dict[str, int]:
    """Every tensor's byte count, read straight from the safetensors headers."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        out.update({name: meta["data_offsets"][1] - meta["data_offsets"][0]
                    for name, meta in header.items() if name != "__metadata__"})
    return out


SPLIT = re.compile(r"\.(q_proj|gate_proj|up_proj)\.|\.(o_proj|down_proj)\.(weight|scales|biases)$")
KV_PROJ = re.compile(r"\.(k_proj|v_proj)\.")
VOCAB_ROWS = re.compile(r"(embed_tokens|lm_head)\.")


def kv_heads(folder: Path, ranks: int) -> dict[str, int] | None:
    """How the KV heads should sit on `ranks` ranks (the vLLM rule): split when they divide,
    else each copied to ranks / heads ranks; None for latent attention (no KV heads)."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("kv_lora_rank"):
        return None
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    return {"total": kv, "here": max(kv // ranks, 1), "replicas": max(ranks // kv, 1)}


def rank_bytes(folder: Path, ranks: int) -> int:
    """One rank's weight bytes for a dense model, from the checkpoint's shapes: 1/ranks of every
    attention and MLP matrix (and of the vocabulary when it divides), its KV heads' rows of the K/V
    projections (whole heads, so the share is over 1/ranks when they are copied), norms whole."""
    config = json.loads((folder / "config.json").read_text())
    kv = kv_heads(folder, ranks)
    total = 0
    for name, size in tensor_bytes(folder).items():
        if KV_PROJ.search(name):
            total += size * kv["here"] // kv["total"]
        elif SPLIT.search(name) or (VOCAB_ROWS.search(name) and config["vocab_size"] % ranks == 0):
            total += size // ranks
        else:
            total += size
    return total


def check(ranks: list[dict], folder: Path, dtype: str | None = "float32", exact_bytes: bool = False) -> None:
    """Logits and greedy tokens equal one process's on every rank, each rank's KV cache holds its
    KV heads only, and each rank holds its share of the weight bytes: about 1/N, or, for a dense
    model (`exact_bytes`), exactly what the checkpoint's shapes give."""
    logits, tokens, total = alone(folder, dtype)
    n = ranks[0]["size"]
    kv = kv_heads(folder, n)
    if exact_bytes:
        assert rank_bytes(folder, 1) == total  # the header's accounting covers the whole model
    for r in ranks:
        np.testing.assert_allclose(np.array(r["logits"]), logits, atol=1e-4, rtol=0, err_msg=f"rank {r['rank']}")
        assert r["tokens"] == tokens, f"rank {r['rank']}"
        if exact_bytes:
            assert r["bytes"] == rank_bytes(folder, n), f"rank {r['rank']}"
        share = r["bytes"] / total
        assert abs(share - 1 / n) < 0.05, f"rank {r['rank']} holds {share:.1%} of the weights"
        assert r["layout"]["kv_heads"] == kv, f"rank {r['rank']}"
        if kv is not None:
            assert set(r["cached_kv_heads"]) == {kv["here"]}, f"rank {r['rank']}"


DENSE = ("llama", "qwen3", "gemma3_text")


def quantized(mlx_lm_quantized, folder: Path) -> Path:
    return mlx_lm_quantized(folder, bits=4, group_size=32)


# Fewer KV heads than ranks (Gemma 3 1B has 1, Qwen2.5-0.5B 2): each rank keeps the KV head its
# query heads read, copied whole, and only that head in its cache.
REPLICATED = {
    "llama-1-kv-head-2-ranks": ("llama", {"num_key_value_heads": 1}, 2),
    "qwen2-2-kv-heads-4-ranks": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}, 4),  # q/k/v bias
    "gemma3_text-1-kv-head-2-ranks": ("gemma3_text", {**GEMMA["gemma3_text"][1], "num_key_value_heads": 1}, 2),
}
# each rank's half of an expert's 64 columns: one whole group of 32
WIDER = {"qwen3_moe": {"moe_intermediate_size": 64}, "deepseek_v3": {"moe_intermediate_size": 64}}
# test function: (hf_checkpoint, mlx_lm_quantized, its parameters) -> the tests/sharded_worker.py run it checks
JOBS: dict[str, Callable[..., Job]] = {
    "test_two_ranks_equal_one_process": lambda hf, q, family: Job(checkpoint(hf, family), 2),
    "test_two_ranks_equal_one_process_4bit": lambda hf, q, family: Job(
        quantized(q, checkpoint(hf, family, **WIDER.get(family, {}))), 2, None),
    "test_two_ranks_split_the_recurrent_state": lambda hf, q, family, split: Job(
        hf(hybrid_tests.VARIANTS[family][0], **hybrid_tests.VARIANTS[family][1]), 2, "float32", split),
    "test_four_ranks_where_the_heads_divide": lambda hf, q: Job(
        hf(PARITY["llama-gqa4"][0], **{**PARITY["llama-gqa4"][1], "num_key_value_heads": 4}), 4),
    "test_fewer_kv_heads_than_ranks_are_replicated": lambda hf, q, case: Job(
        hf(REPLICATED[case][0], **REPLICATED[case][1]), REPLICATED[case][2]),
    "test_fewer_kv_heads_than_ranks_4bit": lambda hf, q: Job(quantized(q, hf("llama", num_key_value_heads=1)), 2, None),
    "test_pipeline_ranks_equal_one_process": lambda hf, q, family, ranks: Job(
        checkpoint(hf, family, num_hidden_layers=3), ranks, split="pipeline"),
    "test_pipeline_4bit": lambda hf, q: Job(quantized(q, hf("llama", num_hidden_layers=3)), 2, None, "pipeline"),
}


@pytest.fixture(scope="module")
def launched(request, can_launch, hf_checkpoint, mlx_lm_quantized, tmp_path_factory) -> dict[str, tuple]:
    """{test name: (its checkpoint, every rank's record or what went wrong)} for this module's
    selected tests in JOBS, run together: one launch per rank count instead of one per test."""
    jobs = {}
    for item in request.session.items:
        build = JOBS.get(getattr(item, "originalname", ""))
        if build is not None and item.module is request.module:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            jobs[item.name] = build(hf_checkpoint, mlx_lm_quantized, **params)
    results = launch_jobs(jobs, tmp_path_factory.mktemp("sharded"))
    return {name: (job.folder, results[name]) for name, job in jobs.items()}


@pytest.fixture
def ran(launched, request) -> tuple[Path, list[dict]]:
    """(checkpoint, every rank's record) of this test's job in JOBS."""
    folder, ranks = launched[request.node.name]
    assert not isinstance(ranks, str), ranks
    return folder, ranks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_equal_one_process(ran, family):
    folder, ranks = ran
    check(ranks, folder, exact_bytes=family in DENSE)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_two_ranks_equal_one_process_4bit(ran, family):
    folder, ranks = ran
    check(ranks, folder, None, exact_bytes=family in DENSE)


@pytest.mark.parametrize("family, split", [("qwen3_next", "tensor"), ("lfm2", "tensor"), ("qwen3_5_text", "pipeline")])
def test_two_ranks_split_the_recurrent_state(ran, family, split):
    """Hybrid models: by tensor, each rank holds half the linear-attention heads (half of each
    Gated DeltaNet's state) or half the short-convolution channels; by pipeline, its layers."""
    folder, ranks = ran
    config = json.loads((folder / "config.json").read_text())
    kinds = [t for t in config["layer_types"] if t != "full_attention"]
    if split == "pipeline":  # every rank keeps the embedding and head: no 1/N share of the bytes
        logits, tokens, _ = alone(folder)
        for r in ranks:
            np.testing.assert_allclose(np.array(r["logits"]), logits, atol=1e-4, rtol=0)
            assert r["tokens"] == tokens
        assert sum(len(r["state_shapes"]) for r in ranks) == len(kinds)
        return
    check(ranks, folder)
    if family == "lfm2":  # [1, K-1, channels]
        want = [[[1, config["conv_L_cache"] - 1, config["hidden_size"] // 2]]] * len(kinds)
    else:  # [1, K-1, q+k+v channels] and [1, value heads, key dim, value dim]
        lin = {k.removeprefix("linear_"): v for k, v in config.items() if k.startswith("linear_")}
        channels = 2 * lin["num_key_heads"] * lin["key_head_dim"] + lin["num_value_heads"] * lin["value_head_dim"]
        want = [[[1, lin["conv_kernel_dim"] - 1, channels // 2],
                 [1, lin["num_value_heads"] // 2, lin["key_head_dim"], lin["value_head_dim"]]]] * len(kinds)
    assert all(r["state_shapes"] == want for r in ranks), [r["state_shapes"] for r in ranks]


def test_four_ranks_where_the_heads_divide(ran):
    folder, ranks = ran
    check(ranks, folder, exact_bytes=True)


@pytest.mark.parametrize("case", sorted(REPLICATED))
def test_fewer_kv_heads_than_ranks_are_replicated(ran, case):
    folder, ranks = ran
    check(ranks, folder, exact_bytes=True)


def test_fewer_kv_heads_than_ranks_4bit(ran):
    folder, ranks = ran
    check(ranks, folder, None, exact_bytes=True)


def launch_worker(tmp_path: Path, job: dict) -> subprocess.CompletedProcess:
    """tests/sharded_worker.py on 2 ranks with the one `job`, its output in `tmp_path`."""
    (tmp_path / "jobs.json").write_text(json.dumps([{"out": str(tmp_path), "split": "tensor", **job}]))
    return launch(2, str(HERE / "sharded_worker.py"), str(tmp_path / "jobs.json"))


def test_quantization_groups_that_do_not_split_are_refused(can_launch, hf_checkpoint, mlx_lm_quantized, tmp_path):
    arch, overrides = FAMILIES["qwen3_moe"]  # experts 32 columns wide: one group of 32 cannot be halved
    folder = mlx_lm_quantized(hf_checkpoint(arch, **overrides), bits=4, group_size=32)
    done = launch_worker(tmp_path, {"model": str(folder), "dtype": None})
    assert "along whole quantization groups of 32" in done.stdout + done.stderr
    assert not (tmp_path / "rank0.json").exists()


def test_ranks_with_different_model_files_refuse(can_launch, hf_checkpoint, tmp_path):
    a = hf_checkpoint("llama")
    b = hf_checkpoint("llama", seed=7, num_hidden_layers=1)
    done = launch_worker(tmp_path, {"model": str(a), "dtype": "float32", "model_for_rank_1": str(b)})
    assert "the ranks load different model files" in done.stdout + done.stderr
    assert not list(tmp_path.glob("rank*.json"))


def test_sizes_that_do_not_divide_are_refused_naming_what_works():
    # Qwen2.5-1.5B's sizes: on 3 ranks the 12 query heads divide, but 3 ranks can neither split its
    # 2 KV heads nor hold whole copies of them (rank 1's query heads 4-7 read both)
    config = {"num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536, "intermediate_size": 8960}
    with pytest.raises(ConfigError) as e:
        shard_config(config, 3)
    assert "2 KV heads" in str(e.value) and "3 ranks" in str(e.value) and "use 1, 2, 4 ranks" in str(e.value)
    with pytest.raises(ConfigError, match="12 attention heads .* use 1, 2, 4 ranks"):
        shard_config(config, 8)
    with pytest.raises(ConfigError, match="intermediate_size 8960 .* use 1, 2, 4 ranks"):
        shard_config(config, 6)
    with pytest.raises(ConfigError, match="6 attention heads"):  # latent attention: the heads are what split
        shard_config({**config, "num_attention_heads": 6, "kv_lora_rank": 16}, 4)
    assert shard_config(config, 2)["num_key_value_heads"] == 1 and shard_config(config, 2)["head_dim"] == 128


def test_one_process_and_bad_modes(loaded, tiny):
    model, _ = mlxinfer.load(tiny, dtype="float32", shard="tensor")  # a group of one: the whole model
    assert not hasattr(model, "shard") and resident_bytes(model) == resident_bytes(loaded[0])
    with pytest.raises(InvalidOptionError, match="shard must be"):
        mlxinfer.load(tiny, shard="diagonal")


def mlxinfer_cli() -> str:
    return shutil.which("mlxinfer", path=str(Path(sys.executable).parent)) or shutil.which("mlxinfer")


def test_generate_under_mlx_launch_prints_once_and_equals_one_process(can_launch, tiny, loaded):
    model, tok = loaded
    args = ["generate", "-m", str(tiny), "--prompt", "hello there", "--max-tokens", "8", "--temp", "0", "--raw",
            "--dtype", "float32"]
    done = launch(2, "--", mlxinfer_cli(), *args)
    want = mlxinfer.generate(model, tok, "hello there", max_tokens=8, temperature=0.0)
    assert done.stdout == want + "\n", done.stdout + done.stderr
    assert done.stderr.count("decode 8 tok") == 1 and "tensor-sharded: rank 0 of 2" in done.stderr
    sampling = ["generate", "-m", str(tiny), "--prompt", "hello there", "--max-tokens", "8", "--temp", "0.9",
                "--top-p", "1.0", "--raw", "--dtype", "float32", "--ignore-eos"]
    seeded = launch(2, "--", mlxinfer_cli(), *sampling, "--seed", "5")
    assert seeded.stdout == mlxinfer.generate(model, tok, "hello there", max_tokens=8, temperature=0.9, seed=5,
                                              ignore_eos=True) + "\n"
    unseeded = launch(2, "--", mlxinfer_cli(), *sampling)  # rank 0 picks the seed for all
    assert unseeded.stderr.count("decode 8 tok") == 1, unseeded.stdout + unseeded.stderr


@pytest.fixture(scope="module")
def chatty(hf_checkpoint) -> Path:
    """A tiny Llama with room for a long message (4 heads, 2 KV heads, 2 layers)."""
    return hf_checkpoint("llama", head_dim=32, max_position_embeddings=2048)


# a message longer than one relay message (its second all_sum), commands, a rewind, a changed option
CHAT = ["hello there", "hello " * 700 + "what next", "/undo", "/set temperature 0.9", "again please",
        "/system be brief", "/reset", "once more"]


@pytest.mark.parametrize("split, sampling", [("tensor", ["--temp", "0"]), ("pipeline", ["--seed", "3"])])
def test_chat_under_mlx_launch_equals_one_process(can_launch, chatty, split, sampling):
    """Rank 0 reads the lines and shares each; every rank replays it, so the transcript is the
    one process's. /save refuses (each rank holds part of the KV cache)."""
    args = ["chat", "-m", str(chatty), "--max-tokens", "10", "--dtype", "float32", *sampling]
    one = subprocess.run([mlxinfer_cli(), *args], input="\n".join([*CHAT, "/exit"]) + "\n", capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr
    flags = ["--pipeline"] if split == "pipeline" else []
    done = launch(2, "--", mlxinfer_cli(), *args, *flags, stdin="\n".join([*CHAT, "/save s.json", "/exit"]) + "\n")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr

    def text(out: str) -> list[str]:
        return [line for line in out.splitlines() if not line.startswith("[")]  # stats lines hold timings

    refused = "error: saving a session is not supported while the model is sharded across ranks"
    assert text(done.stdout) == text(one.stdout) + [text(done.stdout)[-1]] and refused in text(done.stdout)[-1]
    assert done.stderr.count("mlxinfer chat:") == 1 and f"{split}" in done.stderr


def test_ctrl_c_under_mlx_launch_stops_every_rank_at_the_same_token(can_launch, chatty):
    """Ctrl-C reaches rank 0 in the middle of a reply (sent by rank 0 to itself at its 25th
    engine step: an event, not a time). Every rank stops there: the partial reply is kept, the
    chat goes on, and after /undo the next reply is one process's (a rank holding other K/V than
    rank 0 would give other text, or the ranks' collectives would no longer pair up)."""
    args = ["chat", "-m", str(chatty), "--max-tokens", "10", "--dtype", "float32", "--temp", "0"]
    one = subprocess.run([mlxinfer_cli(), *args], input="hello there\nagain please\n/exit\n", capture_output=True,
                         text=True, timeout=TIMEOUT)
    lines = ["hello there", "/set max_tokens 400", "/set ignore_eos true", "tell me everything", "/undo",
             "/set max_tokens 10", "/set ignore_eos false", "again please", "/exit"]
    done = launch(2, "--", str(HERE / "interrupted_rank.py"), *args, stdin="\n".join(lines) + "\n",
                  env={"MLXINFER_TEST_INTERRUPT_AT": "25"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr

    def replies(out: str) -> list[str]:
        return [line for line in out.splitlines() if not line.startswith("[") and "max_tokens" not in line
                and "ignore_eos" not in line and "dropped the last exchange" not in line]

    assert "[interrupted; the partial reply is kept]" in done.stdout, done.stdout
    got, want = replies(done.stdout), replies(one.stdout)
    assert got[0] == want[0] and got[-1] == want[-1] and len(got) == 3, (got, want)


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_inspect_under_mlx_launch_shows_the_sharding(can_launch, hf_checkpoint, split):
    folder = hf_checkpoint("llama", head_dim=32, num_hidden_layers=3, num_key_value_heads=1)  # multi-query
    args = ["inspect", "-m", str(folder), "--dtype", "float32", "hello there", "--steps", "3", "--json"]
    one = json.loads(subprocess.run([mlxinfer_cli(), *args], capture_output=True, text=True, check=True).stdout)
    done = launch(2, "--", mlxinfer_cli(), *args, *(["--pipeline"] if split == "pipeline" else []))
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout + done.stderr  # rank 0 prints, rank 1 is silent
    got = json.loads(lines[0])
    assert one["sharding"] is None and got["generated"] == one["generated"]
    s = got["sharding"]
    assert (s["mode"], s["ranks"], s["rank"]) == (split, 2, 0)
    total = resident_bytes(mlxinfer.load(folder, dtype="float32")[0])
    if split == "tensor":
        assert s["weight_bytes"] == [rank_bytes(folder, 2)] * 2 and s["layers"] == [3, 3]
        assert s["kv_heads"] == {"total": 1, "here": 1, "replicas": 2}
        assert "KV heads: 1, replicated on 2 ranks" in render(got, "t")
    else:
        assert sorted(s["layers"]) == [1, 2] and sum(s["weight_bytes"]) > total and s["kv_heads"] is None
    assert s["sent_per_token"] > 0


def test_speculative_decoding_under_mlx_launch_is_refused(can_launch, tiny):
    done = launch(2, "--", mlxinfer_cli(), "generate", "-m", str(tiny), "--prompt", "hi", "--prompt-lookup")
    assert "speculative decoding (--draft-model, --prompt-lookup) does not run across ranks" in done.stderr
    assert "Traceback" not in done.stderr


class LaunchedServer:
    """`mlxinfer serve` on 2 ranks over a free loopback port; stopped by SIGINT to rank 0 (a
    terminal's Ctrl-C reaches the launcher as well, which dies of it with its own traceback)."""

    def __init__(self, *args: str):
        from test_server import answers_health, free_port

        self.port = free_port()
        self.proc = subprocess.Popen(launcher(2, "--", mlxinfer_cli(), "serve", "--port", str(self.port), *args),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        if not answers_health(f"http://127.0.0.1:{self.port}", self.proc, TIMEOUT):
            self.kill()
            pytest.fail("the server did not start")

    def rank0(self) -> int:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid and b"MLX_RANK=0" in environ:  # field 6: the session id
                return int(stat.parent.name)
        raise AssertionError("rank 0 is not running")

    def stop(self) -> str:
        """Ctrl-C to rank 0; the group must end by itself (the wait is only a hang guard)."""
        os.kill(self.rank0(), signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return err

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_serve_under_mlx_launch_equals_one_process(can_launch, chatty, split):
    """Concurrent requests through rank 0's server, each sequence's steps replayed on rank 1:
    the replies equal one process's; a second turn reuses the pooled cache; Ctrl-C ends all."""
    import openai

    model, tok = mlxinfer.load(chatty, dtype="float32")
    server = LaunchedServer("-m", str(chatty), "--dtype", "float32", *(["--pipeline"] if split == "pipeline" else []))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=60)
        prompts = [f"question {i}: the quick brown fox" for i in range(4)]

        def ask(p: str) -> str:
            events = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                                    max_tokens=12, temperature=0, stream=True)
            return "".join(e.choices[0].delta.content or "" for e in events)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
        for p, text in zip(prompts, got):
            assert text == mlxinfer.generate(model, tok, [{"role": "user", "content": p}], max_tokens=12,
                                             temperature=0.0)
        sampled = client.completions.create(model="m", prompt="hello there", max_tokens=8, temperature=0.9, seed=4,
                                            logit_bias={"5": 2.0})
        assert sampled.choices[0].text == mlxinfer.generate(model, tok, "hello there", max_tokens=8,
                                                            temperature=0.9, seed=4, logit_bias={5: 2.0})
        convo = [{"role": "user", "content": prompts[0]}, {"role": "assistant", "content": got[0]},
                 {"role": "user", "content": "and then?"}]
        again = client.chat.completions.create(model="m", messages=convo, max_tokens=6, temperature=0)
        assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
        assert again.choices[0].message.content == mlxinfer.generate(model, tok, convo, max_tokens=6, temperature=0.0)
    except BaseException:
        server.kill()
        raise
    err = server.stop()
    assert server.proc.returncode == 0 and "Traceback" not in err, err


def test_a_rank_that_dies_ends_the_group_in_bounded_time(can_launch, tiny):
    """Bounded by `launch`'s timeout: a group left hanging is killed there and the test fails."""
    done = launch(2, "--", str(HERE / "dying_rank.py"), "generate", "-m", str(tiny), "--prompt", "hello there",
                  "--max-tokens", "200", "--temp", "0", "--dtype", "float32", timeout=120)
    assert "rank 1 exited with code 3" in done.stdout + done.stderr


def test_a_rank_that_hangs_ends_the_group_in_bounded_time(can_launch, tiny):
    """Rank 1 stops answering mid-generation (alive, connections open): rank 0's watchdog ends
    it with one line after MLXINFER_PEER_TIMEOUT, and mlx.launch stops rank 1 (without the
    watchdog the group would hang until `launch`'s timeout kills it and the test fails)."""
    done = launch(2, "--", str(HERE / "dying_rank.py"), "generate", "-m", str(tiny), "--prompt", "hello there",
                  "--max-tokens", "200", "--temp", "0", "--dtype", "float32", timeout=120,
                  env={"MLXINFER_TEST_FAULT": "hang", "MLXINFER_PEER_TIMEOUT": "3"})
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 0: a step waited 3 s on the other ranks (one is hung or unreachable); every "
                      "rank stops (MLXINFER_PEER_TIMEOUT sets the limit)"], done.stderr


# --- pipeline parallelism: layers split by bytes, the hidden state handed rank to rank ---

def shared_bytes(folder: Path, dtype: str | None = "float32") -> int:
    """Bytes outside the layers (embedding, final norm, head): every pipeline rank keeps them."""
    from mlx.utils import tree_flatten

    model, _ = mlxinfer.load(folder, dtype=dtype or None)
    return sum(v.nbytes for k, v in tree_flatten(model.parameters()) if ".layers." not in k)


@pytest.mark.parametrize("family, ranks", [("llama", 2), ("qwen3", 2), ("gemma3_text", 2), ("llama", 3),
                                           ("mixtral", 2), ("qwen3_moe", 2), ("deepseek_v3", 2), ("gpt_oss", 2)])
def test_pipeline_ranks_equal_one_process(ran, family, ranks):
    folder, got = ran
    logits, tokens, total = alone(folder)
    for r in got:
        np.testing.assert_allclose(np.array(r["logits"]), logits, atol=1e-4, rtol=0, err_msg=f"rank {r['rank']}")
        assert r["tokens"] == tokens
    shared = shared_bytes(folder)
    assert sum(r["bytes"] - shared for r in got) == total - shared  # every layer on exactly one rank


def test_pipeline_4bit(ran):
    folder, got = ran
    logits, tokens, _ = alone(folder, None)
    for r in got:
        np.testing.assert_allclose(np.array(r["logits"]), logits, atol=1e-4, rtol=0)
        assert r["tokens"] == tokens


def test_layer_ranges_balance_bytes_and_refuse_too_many_ranks():
    from mlxinfer.models.shard import layer_ranges

    assert layer_ranges([10] * 8, 2) == [range(0, 4), range(4, 8)]
    assert layer_ranges([10] * 7, 3) == [range(0, 2), range(2, 5), range(5, 7)] or \
        [len(r) for r in layer_ranges([10] * 7, 3)] in ([2, 3, 2], [3, 2, 2], [2, 2, 3])
    assert layer_ranges([40, 10, 10, 10, 10], 2) == [range(0, 1), range(1, 5)]
    with pytest.raises(ConfigError, match="at most 2 ranks"):
        layer_ranges([1, 1], 3)


def test_generate_pipeline_under_mlx_launch(can_launch, hf_checkpoint):
    folder = hf_checkpoint("llama", num_hidden_layers=3)
    model, tok = mlxinfer.load(folder, dtype="float32")
    done = launch(2, "--", mlxinfer_cli(), "generate", "-m", str(folder), "--prompt", "hello there", "--max-tokens",
                  "8", "--temp", "0", "--raw", "--dtype", "float32", "--pipeline")
    assert done.stdout == mlxinfer.generate(model, tok, "hello there", max_tokens=8, temperature=0.0) + "\n"
    assert "pipeline: rank 0 of 2" in done.stderr
