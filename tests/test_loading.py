"""Bad checkpoints and bad arguments each get one precise, one-line error."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import mlxinfer
from mlxinfer.base.errors import (
    ConfigError,
    CorruptCheckpointError,
    InvalidOptionError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


@pytest.fixture
def damaged(hf_checkpoint, copy_checkpoint):
    return copy_checkpoint(hf_checkpoint("llama"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        mlxinfer.load(tmp_path)
    assert "config.json" in one_line(e) and str(tmp_path) in one_line(e)


def test_missing_folder_path():
    with pytest.raises(ModelNotFoundError) as e:
        mlxinfer.load("./no/such/model/here")
    assert "no model folder" in one_line(e)


def test_uncached_hub_id_offline():
    with pytest.raises(ModelNotFoundError) as e:
        mlxinfer.load("mlxinfer-tests/definitely-not-a-real-model")
    msg = one_line(e)
    assert "not in the local Hugging Face cache" in msg and "local folder" in msg


def test_unknown_model_type_lists_supported(damaged):
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (damaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as e:
        mlxinfer.load(damaged)
    msg = one_line(e)
    assert "frobnicator" in msg and all(f in msg for f in ("llama", "mistral", "qwen2", "qwen3"))


def test_missing_tensor_is_named(damaged):
    file = damaged / "model.safetensors"
    weights = mx.load(str(file))
    del weights["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(file), weights)
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.load(damaged)
    assert "model.layers.1.mlp.down_proj.weight" in one_line(e) and "missing" in one_line(e)


def test_shape_disagreeing_with_config(damaged):
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (damaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.load(damaged)
    msg = one_line(e)
    assert "(128, 64)" in msg and "(96, 64)" in msg and "model.safetensors" in msg


def test_truncated_shard_names_the_tensor(damaged):
    file = damaged / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.load(damaged)
    msg = one_line(e)
    assert "truncated" in msg and "tensor '" in msg and str(len(data) - 1000) in msg


def test_sharded_checkpoint_with_index(hf_checkpoint, copy_checkpoint):
    folder = copy_checkpoint(hf_checkpoint("llama"))
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(folder / shard), {k: weights[k] for k in keys})
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = mlxinfer.load(folder)
    ref, _ = mlxinfer.load(hf_checkpoint("llama"))
    x = mx.array([[1, 2, 3]])
    assert mx.array_equal(model(x), ref(x))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.load(folder)
    assert "model-00002-of-00002.safetensors" in one_line(e) and "missing" in one_line(e)


def test_pickle_only_checkpoint_is_refused(damaged):
    (damaged / "model.safetensors").unlink()
    (damaged / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CorruptCheckpointError) as e:
        mlxinfer.load(damaged)
    msg = one_line(e)
    assert "pytorch_model.bin" in msg and "safetensors" in msg and "unsafe" in msg


def test_dtype_casts_and_rejects_unknown(hf_checkpoint):
    model, _ = mlxinfer.load(hf_checkpoint("llama"), dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    model, _ = mlxinfer.load(hf_checkpoint("llama"), dtype=mx.float16)
    assert model.lm_head.weight.dtype == mx.float16
    with pytest.raises(InvalidOptionError) as e:
        mlxinfer.load(hf_checkpoint("llama"), dtype="float8")
    assert "float8" in one_line(e)


def test_bad_config_json(damaged):
    (damaged / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        mlxinfer.load(damaged)
    assert "config.json" in one_line(e)


def test_unsupported_rope_type(damaged):
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "wobble", "rope_theta": 10000.0}
    (damaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        mlxinfer.load(damaged)
    assert "wobble" in one_line(e) and "yarn" in one_line(e)


def test_load_tokenizer_alone(hf_checkpoint):
    tok = mlxinfer.load_tokenizer(hf_checkpoint("llama"))
    assert tok.decode(tok.encode("hello there")) == "hello there"
