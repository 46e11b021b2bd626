"""Files we read are untrusted: config.json, safetensors headers, shard indexes, tokenizer
files, saved chats and prompt caches. Malformed content is one `MlxinferError` line naming
the file and the field, never another exception, a crash or an out-of-bounds read.

The targeted tests pin each known hole; the hypothesis tests mutate valid files at random
and assert that only `MlxinferError` ever escapes the loaders.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxinfer
from mlxinfer.engine.prompt_file import load_prompt_cache
from mlxinfer.engine.chat import ChatSession
from mlxinfer.base.errors import (
    ConfigError,
    CorruptCheckpointError,
    MlxinferError,
    SessionFileError,
)
from mlxinfer.loading.checkpoint import read_weights, weight_files
from mlxinfer.models import model_config
from mlxinfer.loading.store import describe
from mlxinfer.text.tokenizer import load_tokenizer_from_dir

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
# Values that are close to right: the edge cases of sizes, counts and flags.
NEAR = st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**64, 1.5, -0.0, float("inf"), True, "64", None, [], {}, [64]])


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key/index path inside a JSON value, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw, value: Any, rounds: int = 3) -> Any:
    """`value` with a few random edits: a node replaced by random JSON or a near value, or deleted."""
    value = json.loads(json.dumps(value))
    for _ in range(draw(st.integers(1, rounds))):
        path = draw(st.sampled_from(paths(value)))
        if not path:
            value = copy.deepcopy(draw(JSON | NEAR))  # NEAR's lists and dicts are shared: never edit them
            continue
        parent = value
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(draw(JSON | NEAR))
    return value


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A private folder for one hypothesis example (function-scoped fixtures are shared across examples)."""
    folder = Path(tempfile.mkdtemp(prefix="untrusted-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.fixture(scope="module")
def llama(hf_checkpoint) -> Path:
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def llama_config(llama) -> dict[str, Any]:
    return json.loads((llama / "config.json").read_text())


# --- config.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": "abc"}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"num_key_value_heads": True}, "num_key_value_heads"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor"),
        ({"rope_theta": "10000"}, "rope_theta"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None}, "not divisible"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
        ({"model_type": ["llama"]}, "model_type"),
        ({"quantization": {"bits": "4", "group_size": 64}}, "bits"),
    ],
)
def test_bad_config_field_is_named(llama, copy_checkpoint, change, field):
    folder = copy_checkpoint(llama)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        mlxinfer.load(folder)
    msg = one_line(e)
    assert field in msg and "config.json" in msg


@pytest.mark.parametrize("content", ["[1, 2]", '"llama"', "3", "null"])
def test_config_that_is_not_an_object(llama, copy_checkpoint, content):
    folder = copy_checkpoint(llama)
    (folder / "config.json").write_text(content)
    with pytest.raises(ConfigError) as e:
        mlxinfer.load(folder)
    assert "must hold a JSON object" in one_line(e) and str(folder / "config.json") in one_line(e)


@pytest.mark.parametrize(
    "model_type, change, field",
    [
        ("gemma2", {"hidden_size": None}, "hidden_size"),
        ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern"),
        ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 8}, "num_experts_per_tok"),
        ("deepseek_v2", {"kv_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
         "kv_lora_rank"),
        ("gemma3", {"text_config": {"hidden_size": -4}}, "hidden_size"),
    ],
)
def test_family_fields_are_checked(llama_config, model_type, change, field):
    with pytest.raises(ConfigError) as e:
        model_config({**llama_config, "model_type": model_type, **change})
    assert field in one_line(e)


@FUZZ
@given(data=st.data())
def test_fuzzed_config_only_raises_mlxinfer_errors(llama_config, data):
    model_type = data.draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3_moe", "mixtral", "phi3", "gemma2",
                                            "gemma3", "deepseek_v2", "deepseek_v3"]))
    config = data.draw(mutated({**llama_config, "model_type": model_type}))
    try:
        cfg = model_config(config)
    except MlxinferError as e:
        assert "\n" not in str(e)
        return
    assert cfg.head_dim > 0 and len(cfg.layer_types) == cfg.num_hidden_layers


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_config_folder_loads_or_fails_in_one_line(llama, data):
    config = data.draw(mutated(json.loads((llama / "config.json").read_text()), rounds=2))
    with scratch() as folder:
        for f in llama.iterdir():
            shutil.copyfile(f, folder / f.name)
        (folder / "config.json").write_text(json.dumps(config))
        try:
            mlxinfer.load(folder)
        except MlxinferError as e:
            assert "\n" not in str(e)
        assert describe("x", "folder", folder).family  # listed, broken or not


# --- safetensors headers ------------------------------------------------------------------------


def write_safetensors(file: Path, header: Any, data: bytes = b"\0" * 64, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return file


GOOD_ENTRY = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "header, length, fact",
    [
        ([1, 2], None, "not a JSON object"),
        ({"w": {"dtype": "F32", "shape": [4]}}, None, "data_offsets"),
        ({"w": {**GOOD_ENTRY, "dtype": 5}}, None, "dtype"),
        ({"w": {**GOOD_ENTRY, "shape": "4"}}, None, "shape"),
        ({"w": {**GOOD_ENTRY, "data_offsets": [16, 0]}}, None, "data_offsets"),
        ({"w": {**GOOD_ENTRY, "data_offsets": [0, 16000]}}, None, "truncated"),
        ({"w": {**GOOD_ENTRY, "shape": [400]}}, None, "bytes for shape"),
        ({"a": GOOD_ENTRY, "b": {**GOOD_ENTRY, "data_offsets": [8, 24]}}, None, "overlap"),
        ({"w": GOOD_ENTRY}, 10**6, "truncated"),
        ({"w": GOOD_ENTRY, "__metadata__": {"x": 1}}, None, "__metadata__"),
    ],
)
def test_bad_safetensors_header_is_refused(tmp_path, header, length, fact):
    file = write_safetensors(tmp_path / "model.safetensors", header, length=length)
    with pytest.raises(CorruptCheckpointError) as e:
        read_weights([file])
    msg = one_line(e)
    assert fact in msg and "model.safetensors" in msg


@FUZZ
@given(header=st.dictionaries(st.text(max_size=6), JSON | st.fixed_dictionaries(
    {}, optional={"dtype": st.sampled_from(["F32", "F16", "I64", "X"]) | JSON,
                  "shape": st.lists(st.integers(-2, 40), max_size=3) | JSON,
                  "data_offsets": st.lists(st.integers(-8, 200), min_size=2, max_size=2) | JSON}),
    max_size=3) | JSON, data=st.binary(max_size=128), length=st.none() | st.integers(0, 300),
    junk=st.none() | st.binary(max_size=64))
def test_fuzzed_safetensors_only_raise_mlxinfer_errors(header, data, length, junk):
    with scratch() as folder:
        file = folder / "model.safetensors"
        if junk is not None:
            file.write_bytes(junk)
        else:
            write_safetensors(file, header, data, length)
        try:
            arrays, _ = read_weights([file])
            mx.eval(list(arrays.values()))
        except MlxinferError as e:
            assert "\n" not in str(e)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        assert describe("x", "folder", folder).family


# --- shard indexes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index, fact",
    [
        ({"metadata": {}}, "weight_map"),
        ([1], "weight_map"),
        ({"weight_map": ["model.safetensors"]}, "weight_map"),
        ({"weight_map": {"w": "../outside.safetensors"}}, "refusing"),
        ({"weight_map": {"w": "OUTSIDE"}}, "refusing"),  # an absolute path
        ({"weight_map": {"w": "config.json"}}, "refusing"),
    ],
)
def test_bad_index_is_refused(llama, copy_checkpoint, tmp_path, index, fact):
    folder = copy_checkpoint(llama)
    outside = shutil.copyfile(folder / "model.safetensors", tmp_path / "outside.safetensors")
    index = json.loads(json.dumps(index).replace("OUTSIDE", str(outside)))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError) as e:
        weight_files(folder)
    assert fact in one_line(e)
    with pytest.raises(CorruptCheckpointError):
        mlxinfer.load(folder)


def test_weights_linked_from_outside_are_refused(llama, copy_checkpoint, tmp_path):
    folder = copy_checkpoint(llama)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    os.symlink(outside, folder / "model.safetensors")
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.load(folder)
    assert "outside the model folder" in one_line(e)


SECRET = "SECRET-7f3a"  # stands for a private file's content: it must reach no prompt and no converted output
OUTSIDE = {  # a valid stand-in for each file a checkpoint may hold, so following the link would go unnoticed
    "chat_template.jinja": SECRET + "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "chat_template.json": json.dumps({"chat_template": SECRET + "{{ messages[0]['content'] }}"}),
    "special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>", "additional_special_tokens": [SECRET]}),
}


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json",
                                  "generation_config.json", "tokenizer.json", "chat_template.json", "config.json",
                                  "model.safetensors.index.json"])
def test_a_file_linked_from_outside_is_refused_by_load_and_convert(llama, copy_checkpoint, tmp_path, name):
    """Every file read from a checkpoint, not only the weights: a link out of the folder is one line
    naming the file, for loading, for the tokenizer alone, for listing and for `convert`, which
    writes nothing."""
    from mlxinfer.convert import convert
    from mlxinfer.loading.store import describe

    folder = copy_checkpoint(llama)
    outside = tmp_path / "private" / name
    outside.parent.mkdir()
    if name == "model.safetensors.index.json":
        outside.write_text(json.dumps({"weight_map": dict.fromkeys(mx.load(str(folder / "model.safetensors")),
                                                                   "model.safetensors")}))
    elif name in OUTSIDE:
        outside.write_text(OUTSIDE[name])
    else:
        content = json.loads((folder / name).read_text()) if name.endswith(".json") else None
        if isinstance(content, dict) and name != "tokenizer.json":
            content["note"] = SECRET
            outside.write_text(json.dumps(content))
        else:
            shutil.copyfile(folder / name, outside)
        (folder / name).unlink()
    os.symlink(outside, folder / name)

    loaders = [lambda: mlxinfer.load(folder), lambda: convert(folder, tmp_path / "out")]
    if name != "model.safetensors.index.json":
        loaders.append(lambda: mlxinfer.load_tokenizer(folder))
    for load in loaders:
        with pytest.raises(CorruptCheckpointError) as e:
            load()
        assert name in one_line(e) and "outside the model folder" in one_line(e)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    if name in ("config.json", "model.safetensors.index.json"):  # what `mlxinfer models` reads
        assert describe("x", "folder", folder).family == "broken"


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(llama, tmp_path):
    """The HF cache's own layout (snapshots/<rev>/file -> ../../blobs/<hash>) loads and converts;
    a snapshot file linking into another repo's blobs does not."""
    from mlxinfer.convert import convert

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in llama.iterdir():
        blob = f"blob-{f.name}"
        shutil.copyfile(f, repo / "blobs" / blob)
        os.symlink(Path("..", "..", "blobs", blob), snapshot / f.name)
    model, tok = mlxinfer.load(snapshot)
    assert tok.encode("hello there") == mlxinfer.load_tokenizer(llama).encode("hello there")
    convert(snapshot, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()

    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(llama / "tokenizer.json", other / "stray")
    (snapshot / "tokenizer.json").unlink()
    os.symlink(Path("..", "..", "..", "models--org--other", "blobs", "stray"), snapshot / "tokenizer.json")
    with pytest.raises(CorruptCheckpointError, match="outside the model folder"):
        mlxinfer.load_tokenizer(snapshot)


@pytest.mark.parametrize("content", [b"{not json", b'{"model": {"type": "BPE"}}', b"\xff\xfe"])
def test_a_malformed_tokenizer_fails_the_conversion_not_the_first_load(llama, copy_checkpoint, tmp_path, content):
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    folder = copy_checkpoint(llama)
    (folder / "tokenizer.json").write_bytes(content)
    result = CliRunner().invoke(main, ["convert", str(folder), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("error: "), result.output
    assert "tokenizer.json" in result.output and "nothing was written" in result.output, result.output
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_index_outside_the_folder_is_refused_by_convert(llama, copy_checkpoint, tmp_path):
    from mlxinfer.convert import convert

    folder = copy_checkpoint(llama)
    shutil.copyfile(folder / "model.safetensors", tmp_path / "outside.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="refusing"):
        convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@FUZZ
@given(index=mutated({"metadata": {"total_size": 1}, "weight_map": {"a": "model.safetensors"}}))
def test_fuzzed_index_only_raises_mlxinfer_errors(llama, index):
    with scratch() as folder:
        shutil.copyfile(llama / "model.safetensors", folder / "model.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            files = weight_files(folder)
        except MlxinferError as e:
            assert "\n" not in str(e)
            return
        assert all(f.parent == folder for f in files)


# --- tokenizer files ----------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_fuzzed_tokenizer_files_only_raise_mlxinfer_errors(llama, data):
    name = data.draw(st.sampled_from(["tokenizer_config.json", "generation_config.json", "chat_template.json",
                                      "config.json"]))
    source = llama / name
    original = json.loads(source.read_text()) if source.is_file() else {"chat_template": "{{ messages }}"}
    content = data.draw(mutated(original, rounds=2))
    with scratch() as folder:
        for f in llama.iterdir():
            if f.name != name and f.suffix != ".safetensors":
                shutil.copyfile(f, folder / f.name)
        (folder / name).write_text(json.dumps(content))
        try:
            tok = load_tokenizer_from_dir(folder)
        except MlxinferError as e:
            assert "\n" not in str(e)
            return
        assert tok.chat_template is None or isinstance(tok.chat_template, str)
        assert all(isinstance(i, int) for i in tok.eos_token_ids)


# --- `mlxinfer models` --------------------------------------------------------------------------


def test_models_lists_a_broken_folder_as_broken(llama, tmp_path):
    from mlxinfer.loading.store import local_models

    shutil.copytree(llama, tmp_path / "good")
    shutil.copytree(llama, tmp_path / "bad-config")
    (tmp_path / "bad-config" / "config.json").write_text("[1, 2]")
    shutil.copytree(llama, tmp_path / "bad-header")
    write_safetensors(tmp_path / "bad-header" / "model.safetensors", {"w": {"dtype": "F32", "shape": [1]}})
    shutil.copytree(llama, tmp_path / "linked-out", ignore=shutil.ignore_patterns("*.safetensors"))
    os.symlink(llama / "model.safetensors", tmp_path / "linked-out" / "model.safetensors")
    found = {Path(m.path).name: m for m in local_models([tmp_path])}
    assert set(found) == {"good", "bad-config", "bad-header", "linked-out"}
    assert found["linked-out"].family == "broken" and "outside the model folder" in found["linked-out"].error
    assert found["good"].family == "llama" and found["good"].error is None
    assert found["bad-config"].family == "broken" and "JSON object" in found["bad-config"].error
    assert found["bad-header"].family == "broken" and "data_offsets" in found["bad-header"].as_dict()["error"]


# --- saved chats and prompt caches --------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_chat(loaded, tmp_path_factory) -> Path:
    model, tok = loaded
    session = ChatSession(model, tok, system="Be brief.", temperature=0.0, max_tokens=4)
    list(session.send("hello there"))
    return session.save(tmp_path_factory.mktemp("chat") / "chat.json")


def copy_chat(saved: Path, folder: Path) -> Path:
    for f in saved.parent.iterdir():
        shutil.copyfile(f, folder / f.name)
    return folder / saved.name


def edit_json(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text())
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    file.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "changes, fact",
    [
        ({"system": ...}, "system prompt"),
        ({"system": 5}, "system prompt"),
        ({"kv_cache": "../elsewhere.kv.safetensors"}, "not a file beside it"),
        ({"kv_cache": "/etc/passwd"}, "not a file beside it"),
    ],
)
def test_damaged_session_file_is_one_line(loaded, saved_chat, tmp_path, changes, fact):
    file = copy_chat(saved_chat, tmp_path)
    edit_json(file, **changes)
    with pytest.raises(SessionFileError) as e:
        ChatSession.load(file, *loaded)
    assert fact in one_line(e) and str(file) in one_line(e)


def test_transcript_with_ids_outside_the_vocabulary_is_dropped(loaded, saved_chat, tmp_path):
    model, tok = loaded
    file = copy_chat(saved_chat, tmp_path)
    data = json.loads(file.read_text())
    data["transcript"]["tokens"][-1] = model.config.vocab_size + 7
    file.write_text(json.dumps(data))
    session = ChatSession.load(file, model, tok)
    assert session._transcript.tokens == []  # nothing of it reaches the model
    out = list(session.send("more"))
    assert out[-1].finish_reason == "length" and all(0 <= c.token < model.config.vocab_size for c in out)


def rewrite_cache(file: Path, edit) -> None:
    """Apply `edit(arrays, layers)` to a saved prompt cache, keeping its metadata (and so its model fingerprint)."""
    arrays, meta = mx.load(str(file), return_metadata=True)
    layers = json.loads(meta["mlxinfer.layers"])
    edit(arrays, layers)
    meta["mlxinfer.layers"] = json.dumps(layers)
    mx.save_safetensors(str(file), arrays, metadata=meta)


def out_of_vocab_tokens(arrays, layers):
    arrays["tokens"] = mx.array(np.array(arrays["tokens"]) + 10**6)


def narrower_keys(arrays, layers):
    arrays["0.keys.0"] = arrays["0.keys.0"][..., :16]


def one_layer_fewer(arrays, layers):
    layers.pop()


@pytest.mark.parametrize("edit", [out_of_vocab_tokens, narrower_keys, one_layer_fewer])
def test_cache_that_does_not_fit_costs_a_prefill(loaded, saved_chat, tmp_path, edit):
    model, tok = loaded
    file = copy_chat(saved_chat, tmp_path)
    rewrite_cache(tmp_path / "chat.kv.safetensors", edit)
    session = ChatSession.load(file, model, tok)
    assert not session.cache_restored and session.cache.tokens == []
    out = list(session.send("more"))
    assert out[-1].stats.prefill_tokens == out[-1].stats.prompt_tokens


def test_loaded_cache_that_does_not_fit_is_refused_by_generate(loaded, saved_chat, tmp_path):
    model, tok = loaded
    file = tmp_path / "c.kv.safetensors"
    shutil.copyfile(saved_chat.with_suffix(".kv.safetensors"), file)
    rewrite_cache(file, out_of_vocab_tokens)
    cache = load_prompt_cache(file)
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.generate(model, tok, "hello", prompt_cache=cache, max_tokens=2)
    assert "vocabulary" in one_line(e)


def layers_not_a_list(arrays, layers):
    layers.clear()
    layers.append("KVCache")


def offset_beyond_tokens(arrays, layers):
    layers[0]["offset"] += 5


def tokens_as_matrix(arrays, layers):
    arrays["tokens"] = arrays["tokens"][None]


def missing_values(arrays, layers):
    del arrays["1.values.0"]


@pytest.mark.parametrize("edit", [layers_not_a_list, offset_beyond_tokens, tokens_as_matrix, missing_values])
def test_malformed_prompt_cache_file_is_one_line(saved_chat, tmp_path, edit):
    file = tmp_path / "c.kv.safetensors"
    shutil.copyfile(saved_chat.with_suffix(".kv.safetensors"), file)
    rewrite_cache(file, edit)
    with pytest.raises(CorruptCheckpointError) as e:
        load_prompt_cache(file)
    assert str(file) in one_line(e)


@FUZZ
@given(data=st.data())
def test_fuzzed_session_files_only_raise_mlxinfer_errors(loaded, saved_chat, data):
    model, tok = loaded
    with scratch() as folder:
        file = copy_chat(saved_chat, folder)
        file.write_text(json.dumps(data.draw(mutated(json.loads(file.read_text())))))
        try:
            session = ChatSession.load(file, model, tok, max_tokens=2)
            list(session.send("hi"))
        except MlxinferError as e:
            assert "\n" not in str(e)


def array_like(draw) -> mx.array:
    shape = draw(st.lists(st.integers(0, 3), max_size=4))
    dtype = draw(st.sampled_from([np.float32, np.float16, np.int32, np.uint32, np.int64]))
    return mx.array(np.ones(shape, dtype=dtype))


@FUZZ
@given(data=st.data())
def test_fuzzed_prompt_cache_files_only_raise_mlxinfer_errors(loaded, saved_chat, data):
    model, tok = loaded
    with scratch() as folder:
        file = copy_chat(saved_chat, folder)
        kv = folder / "chat.kv.safetensors"
        arrays, meta = mx.load(str(kv), return_metadata=True)
        layers = data.draw(mutated(json.loads(meta["mlxinfer.layers"]), rounds=2)) if data.draw(st.booleans()) else None
        for _ in range(data.draw(st.integers(0, 2))):
            name = data.draw(st.sampled_from(sorted(arrays)))
            if data.draw(st.booleans()):
                del arrays[name]
            else:
                arrays[name] = array_like(data.draw)
        if layers is not None:
            meta["mlxinfer.layers"] = json.dumps(layers)
        mx.save_safetensors(str(kv), arrays, metadata=meta)
        try:
            cache = load_prompt_cache(kv)
            list(mlxinfer.stream_generate(model, tok, "hello", prompt_cache=cache, max_tokens=2))
        except MlxinferError as e:
            assert "\n" not in str(e)
        session = ChatSession.load(file, model, tok, max_tokens=2)  # a bad cache only costs a prefill
        list(session.send("hi"))
