"""mlxinfer's model store (`mlxinfer.loading.store`): the names models get, resolving a name,
and deleting and copying models in our cache, on tiny checkpoints transformers wrote. The oracles:
the issue's example name, the files transformers wrote (bytes and config.json), and what the
Hugging Face cache layout holds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mlxinfer.base.errors import ModelNotFoundError, StoreError
from mlxinfer.loading import store


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """Our cache and the Hugging Face cache in a temporary folder."""
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def in_cache(src: Path, name: str) -> Path:
    """`src` copied into our cache as `name`, as a conversion leaves it."""
    folder = Path(os.environ["MLXINFER_HOME"]) / "models" / name
    shutil.copytree(src, folder)
    return folder


def make_hf_cache(root: Path, repo: str, src: Path) -> Path:
    """The Hugging Face cache layout, as huggingface_hub writes it: snapshot files link to blobs."""
    base = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = base / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (base / "blobs").mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        blob = base / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return snapshot


def test_cache_names_are_readable_and_stable():
    # the issue's own example: a repo name in lowercase with how it is stored
    assert store.cache_name("SmolLM2-135M-Instruct", "4bit") == "smollm2-135m-instruct-4bit"
    assert store.cache_name("SmolLM2-135M-Instruct-4bit", "4bit") == "smollm2-135m-instruct-4bit"  # not twice
    assert store.cache_name("Qwen2.5 0.5B (chat)", "mixed-4-6") == "qwen2.5-0.5b-chat-mixed-4-6"
    assert store.cache_name("tiny", "") == "tiny"


def test_find_resolves_each_kind_of_name(hf_checkpoint, isolated_home, tmp_path):
    src = hf_checkpoint("llama")
    in_cache(src, "tiny-4bit")
    make_hf_cache(tmp_path / "hf", "org/tiny-hf", src)
    ours, hub, folder = store.find("tiny-4bit"), store.find("org/tiny-hf"), store.find(str(src))
    assert (ours.where, ours.path) == ("mlxinfer", isolated_home / "models" / "tiny-4bit")
    assert hub.where == "huggingface" and hub.path.parent.name == "snapshots"
    assert (folder.where, folder.path) == ("folder", src)
    assert store.find("nothing-here") is None and store.find("org/nothing") is None
    in_cache(src, ".tiny-8bit.partial-1-0a1b2c3d")  # a conversion or copy under way: not a model yet
    listed = {m.name for m in store.local_models()}
    assert listed == {"tiny-4bit", "org/tiny-hf"}


def test_remove_deletes_only_what_our_cache_holds(hf_checkpoint, isolated_home, tmp_path):
    src = hf_checkpoint("llama")
    folder = in_cache(src, "tiny-4bit")
    make_hf_cache(tmp_path / "hf", "org/tiny-hf", src)
    removed = store.remove("tiny-4bit")
    assert removed.path == folder and not folder.exists()
    assert [p.name for p in (isolated_home / "models").iterdir()] == []  # no hidden leftovers
    with pytest.raises(ModelNotFoundError, match="`mlxinfer models`"):
        store.remove("tiny-4bit")
    with pytest.raises(StoreError, match="Hugging Face cache"):
        store.remove("org/tiny-hf")
    with pytest.raises(StoreError, match="folder of yours"):
        store.remove(str(src))
    assert (src / "config.json").is_file() and store.find("org/tiny-hf") is not None


def test_copy_makes_an_equal_model_under_the_new_name(hf_checkpoint, isolated_home, tmp_path):
    src = hf_checkpoint("llama")
    snapshot = make_hf_cache(tmp_path / "hf", "org/tiny-hf", src)
    made = store.copy("org/tiny-hf", "mine:latest")
    assert (made.name, made.where) == ("mine:latest", "mlxinfer")
    assert sorted(p.name for p in made.path.iterdir()) == sorted(p.name for p in src.iterdir())
    for f in src.iterdir():  # the files transformers wrote, byte for byte, and no links left
        assert (made.path / f.name).read_bytes() == f.read_bytes() and not (made.path / f.name).is_symlink()
    assert made.parameters == store.find(str(src)).parameters > 0
    again = store.copy("mine:latest", "mine-2")
    assert store.remove("mine:latest").name == "mine:latest"
    assert (again.path / "config.json").read_bytes() == (src / "config.json").read_bytes()  # links survive
    with pytest.raises(StoreError, match="already in mlxinfer's cache.*mlxinfer rm mine-2"):
        store.copy("org/tiny-hf", "mine-2")
    with pytest.raises(StoreError, match="cannot name a model"):
        store.copy("org/tiny-hf", "../escape")
    with pytest.raises(ModelNotFoundError):
        store.copy("no-such-model", "x")
    assert snapshot.is_dir()


def test_copy_refuses_a_file_that_links_outside_its_folder(hf_checkpoint, isolated_home, tmp_path):
    """A copy must not turn a link to a private file into a plain file loading would then read."""
    folder = tmp_path / "sneaky"
    shutil.copytree(hf_checkpoint("llama"), folder)
    secret = tmp_path / "secret.txt"
    secret.write_text("key")
    (folder / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(Exception, match="links outside the model folder"):
        store.copy(str(folder), "copied")
    assert not (isolated_home / "models").exists() or list((isolated_home / "models").iterdir()) == []


# the commands: pull, rm, show, cp


def invoke(*args: str, input: str | None = None):
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    return CliRunner().invoke(main, list(args), input=input)


def test_rm_asks_unless_yes_and_refuses_what_is_not_ours(hf_checkpoint, isolated_home, tmp_path):
    src = hf_checkpoint("llama")
    folder = in_cache(src, "tiny-4bit")
    make_hf_cache(tmp_path / "hf", "org/tiny-hf", src)
    declined = invoke("rm", "tiny-4bit", input="n\n")
    assert declined.exit_code == 1 and "delete tiny-4bit" in declined.stderr and folder.is_dir()
    accepted = invoke("rm", "tiny-4bit", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert "deleted tiny-4bit" in accepted.stdout and not folder.exists()
    in_cache(src, "tiny-4bit")
    assert invoke("rm", "tiny-4bit", "--yes").exit_code == 0 and not folder.exists()
    for name, why in (("org/tiny-hf", "Hugging Face cache"), (str(src), "folder of yours"),
                      ("tiny-4bit", "no model named")):
        refused = invoke("rm", name, input="y\n")  # refused before any question
        assert refused.exit_code == 1 and refused.stderr.startswith("error: ") and why in refused.stderr
        assert "delete" not in refused.stderr.split("error: ")[0] and len(refused.stderr.splitlines()) == 1
    assert store.find("org/tiny-hf") is not None and (src / "config.json").is_file()


def test_show_says_what_config_json_and_the_files_say(hf_checkpoint, isolated_home):
    import json

    import mlx.core as mx
    import numpy as np

    src = hf_checkpoint("llama")
    in_cache(src, "tiny")
    config = json.loads((src / "config.json").read_text())
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    parameters = sum(int(np.prod(v.shape)) for v in mx.load(str(src / "model.safetensors")).values())
    shown = invoke("show", "tiny", "--json")
    assert shown.exit_code == 0, shown.output
    d = json.loads(shown.stdout)
    assert d["family"] == config["model_type"] and d["context_length"] == config["max_position_embeddings"]
    assert d["parameters"] == parameters and d["template"] == template
    assert d["quantization"] == {"float32": "float32", "bfloat16": "bfloat16"}[config.get("dtype") or config["torch_dtype"]]
    assert d["size"] == sum(p.stat().st_size for p in src.iterdir()) and d["where"] == "mlxinfer"
    text = invoke("show", "tiny").stdout
    rows = dict(line.split(None, 1) for line in text.splitlines() if line[:1].strip())
    assert rows["family"] == config["model_type"] and rows["context"] == f"{config['max_position_embeddings']:,} tokens"
    assert rows["template"] == template.splitlines()[0]
    whole = invoke("show", "tiny", "--template").stdout
    assert all(line.strip() in whole for line in template.splitlines())
    missing = invoke("show", "nothing")
    assert missing.exit_code == 1 and "`mlxinfer models`" in missing.stderr


def test_show_names_the_quantization_method_a_calibrated_conversion_recorded(hf_checkpoint, isolated_home):
    import json

    folder = in_cache(hf_checkpoint("llama"), "tiny")
    config = json.loads((folder / "config.json").read_text())
    method = {"method": "gptq", "calibration": "python-reference", "calibration_tokens": 512}
    (folder / "config.json").write_text(json.dumps({**config, "quantization_method": method}))
    text = invoke("show", "tiny").stdout
    assert "gptq (calibration: python-reference, calibration_tokens: 512)" in text
    assert json.loads(invoke("show", "tiny", "--json").stdout)["quantization_method"] == method


def test_pull_cp_and_names_stable_across_runs(hf_checkpoint, isolated_home, tmp_path):
    import json

    src = tmp_path / "Tiny-Chat"
    shutil.copytree(hf_checkpoint("llama"), src)
    first = invoke("pull", str(src))
    assert first.exit_code == 0, first.output
    assert "pulled tiny-chat-4bit" in first.stdout and "converting" in first.stderr
    def ours() -> list[str]:
        return sorted(m["name"] for m in json.loads(invoke("models", "--json").stdout) if m["where"] == "mlxinfer")

    assert ours() == ["tiny-chat-4bit"]
    again = invoke("pull", str(src))
    assert again.exit_code == 1 and "mlxinfer rm tiny-chat-4bit" in again.stderr
    assert invoke("cp", "tiny-chat-4bit", "tiny-copy").exit_code == 0
    assert invoke("rm", "tiny-chat-4bit", "--yes").exit_code == 0
    assert invoke("pull", str(src)).exit_code == 0  # a new run: the same name
    assert ours() == ["tiny-chat-4bit", "tiny-copy"]
    both = invoke("pull", str(src), "--bits", "4", "--recipe", "mixed-4-6")
    assert both.exit_code == 1 and "--bits and --recipe" in both.stderr
