"""The hybrid families (Qwen3-Next, Qwen3.5 dense and MoE, LFM2) from the GGUF files llama.cpp's
own `convert_hf_to_gguf.py` (llama-cpp-python sdist, as test_convert_llama3_gguf fetches it)
writes of random-weight transformers checkpoints, converted back with ours. The converter
rearranges these layers heavily (A as -exp(A_log), norms as 1 + w, Qwen3.5's value heads tiled,
Qwen3-Next's q/k/v/z cut apart, convolutions squeezed); the oracle is transformers on the
checkpoint the file came from: float32 logits over a prompt longer than one chunk of the
recurrence, prefilled in two pieces, and greedy tokens through our caches equal to its
teacher-forced argmax. Qwen checkpoints carry a multi-token-prediction block as the hub's do
(llama.cpp writes it as an extra layer, which is left out). A Q8_0 file of Qwen3.5 (value
heads moved back row by row and, packed, block by block) comes back with every weight within
Q8_0's rounding of the original. The sdist's converter writes all four families; the new
pre-tokenizers their GGUFs name (`qwen35`, `lfm2`) are checked against transformers'."""

from __future__ import annotations

import json
import shutil
from contextlib import closing
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import build_hf_checkpoint, llama_cpp_gguf, real_tokenizer
from family_checks import NEAR_TIE, PREFILL_STEP, prompt, real_vocab_checkpoint
from safetensors.numpy import load_file, save_file
from test_convert_gguf import TEXTS, tokenizer_metadata
from test_models_hybrid import EXPERTS, LINEAR, VARIANTS
from test_parity import TOL

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.convert.gguf_file import GGUFFile
from mlxinfer.convert.gguf_tokenizer import tokenizer_json
from mlxinfer.engine.generate import stream_generate
from mlxinfer.models.cache import make_cache
from mlxinfer.base.errors import MlxinferError

QWEN3_IDS = dict(vocab_size=151669, bos_token_id=None, eos_token_id=151645, pad_token_id=151643)
# name: (model_type, GGUF architecture, config overrides)
FAMILIES = {
    "qwen3_next": ("qwen3_next", "qwen3next", dict(LINEAR, **EXPERTS)),  # llama.cpp has no dense layers for it
    # value heads of 32: out_proj's columns move back in whole Q8_0 blocks
    "qwen3_5_text": ("qwen3_5_text", "qwen35", dict(LINEAR, linear_value_head_dim=32)),
    # transformers gives this model type Qwen's tokenizer class whatever the folder says, so
    # llama.cpp's converter needs a Qwen vocabulary to recognise its pre-tokenizer
    "qwen3_5_moe_text": ("qwen3_5_moe_text", "qwen35moe", dict(LINEAR, **EXPERTS, **QWEN3_IDS,
                                                                 tie_word_embeddings=True)),
    # llama.cpp's converter cannot write a convolution bias (it squeezes it like the kernel)
    "lfm2": ("lfm2", "lfm2", {**VARIANTS["lfm2"][1], "conv_bias": False}),
}
QUANTIZED = ("qwen3_5_text",)  # also written as Q8_0: reordered rows and column blocks of packed weights
LENGTH = 80  # longer than one 64-token chunk of the gated delta rule
STEPS = 10


def checkpoint(folder: Path, name: str) -> Path:
    """A random-weight checkpoint as the hub has the family: Qwen's with an `mtp.*` block."""
    model_type, _, overrides = FAMILIES[name]
    if "vocab_size" not in overrides:
        src = real_vocab_checkpoint(folder, model_type, overrides)
    else:
        src = build_hf_checkpoint(folder, model_type, overrides)
        for file in real_tokenizer("qwen3").iterdir():
            shutil.copyfile(file, src / file.name)
    if model_type == "qwen3_5_moe_text":  # its config has no dense width: llama.cpp writes none
        config = json.loads((src / "config.json").read_text())
        del config["intermediate_size"]
        (src / "config.json").write_text(json.dumps(config))
    if model_type.startswith("qwen"):
        add_mtp_block(src, overrides["num_hidden_layers"] - 1)
    return src


def add_mtp_block(src: Path, layer: int) -> None:
    """Hub Qwen3-Next / Qwen3.5 checkpoints carry a multi-token-prediction block (`mtp.*`: a
    full-attention layer, a fusing projection and norms) that transformers does not build;
    here one like layer `layer`, perturbed."""
    file = src / "model.safetensors"
    weights = load_file(file)
    rng = np.random.default_rng(1)
    hidden = weights["model.norm.weight"].shape[0]
    prefix = f"model.layers.{layer}."
    for name, w in list(weights.items()):
        if name.startswith(prefix):
            weights["mtp.layers.0." + name.removeprefix(prefix)] = w + rng.normal(0, 0.02, w.shape).astype(w.dtype)
    weights["mtp.fc.weight"] = rng.normal(0, 0.05, (hidden, 2 * hidden)).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = rng.normal(0, 0.1, hidden).astype(np.float32)
    save_file(weights, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ggufs(llama_cpp, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{name: (checkpoint, its float32 GGUF)}, and {name + "-q8_0": (checkpoint, Q8_0 GGUF)}."""
    root = tmp_path_factory.mktemp("hybrid-gguf")
    made = {name: (checkpoint(root / name, name), root / f"{name}.gguf") for name in FAMILIES}
    made |= {f"{name}-q8_0": (made[name][0], root / f"{name}-q8_0.gguf") for name in QUANTIZED}
    for name, (src, out) in made.items():
        llama_cpp_gguf(llama_cpp, src, out, name.partition("-")[2] or "f32")
    return made


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def variant(request, ggufs, tmp_path_factory):
    """(name, transformers checkpoint, our model converted from llama.cpp's GGUF of it, tokenizer)."""
    name = request.param
    src, gguf_file = ggufs[name]
    with closing(GGUFFile(gguf_file)) as file:
        assert file.metadata["general.architecture"] == FAMILIES[name][1]
    out = tmp_path_factory.mktemp(name) / "out"
    convert(gguf_file, out, dtype="float32")
    model, tok = mlxinfer.load(out, dtype="float32")
    return name, src, model, tok


def test_logits_and_greedy_match_transformers(variant):
    """The prompt prefilled in two pieces (the state carried between them) gives transformers'
    logits; greedy tokens decoded through our caches after a prefill in chunks are its argmax
    given the sequence so far (teacher forcing), except past a near-tie, where the two
    continuations part and the rest is not compared."""
    from transformers import AutoModelForCausalLM

    name, src, model, tok = variant
    ids = prompt(LENGTH)
    cache = make_cache(model)
    got = np.concatenate([np.array(model(mx.array([part]), cache=cache)) for part in (ids[:50], ids[50:])], 1)
    kinds = {type(c).__name__ for c in cache}
    assert kinds == {"KVCache", "StateCache"}, kinds  # both kinds of layer came back
    greedy = [c.token for c in stream_generate(model, tok, ids, max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                               prefill_step=PREFILL_STEP) if c.token is not None]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids + greedy[:-1]])).logits.numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want[:, :LENGTH], atol=TOL, rtol=0)
    assert len(greedy) == STEPS
    for step, (ours, row) in enumerate(zip(greedy, want[0, LENGTH - 1 :])):
        if ours != int(row.argmax()):
            top = np.sort(row)[-2:]
            assert top[1] - top[0] < NEAR_TIE, f"step {step}: we chose {ours}, transformers {int(row.argmax())}"
            return


def test_config_is_the_checkpoints(variant):
    """The layer mix and the recurrent layers' sizes read back from llama.cpp's metadata; the
    multi-token-prediction layer llama.cpp counts in `block_count` is not one of them."""
    name, src, model, _ = variant
    original = json.loads((src / "config.json").read_text())
    assert len(model.layers) == original["num_hidden_layers"]
    want = original.get("layer_types") or ["full_attention" if i in original["full_attn_idxs"] else "conv"
                                            for i in range(original["num_hidden_layers"])]
    assert list(model.config.layer_types) == want
    if model.config.linear is not None:
        lin = model.config.linear
        assert (lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim, lin.conv_kernel) == tuple(
            original[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                  "linear_value_head_dim", "linear_conv_kernel_dim"))


@pytest.mark.parametrize("name", QUANTIZED)
def test_q8_0_gguf_weights_are_the_originals(ggufs, tmp_path, name):
    """llama.cpp's Q8_0 file (rows of packed blocks, value heads tiled across key heads) comes
    back with every weight within one Q8_0 step (max |block| / 127) of the original's, as our
    converter lays out the original folder; a misplaced row or column would be off by the
    weights' own size."""
    src, gguf_file = ggufs[f"{name}-q8_0"]
    convert(gguf_file, tmp_path / "gguf", dtype="float32")
    convert(src, tmp_path / "folder", dtype="float32")
    ours, original = (mx.load(str(tmp_path / kind / "model.safetensors")) for kind in ("gguf", "folder"))
    assert json.loads((tmp_path / "gguf" / "config.json").read_text())["quantization"]["bits"] == 8
    packed = 0
    for key, want in original.items():
        path, _, leaf = key.rpartition(".")
        got = ours[key]
        if f"{path}.scales" in ours and leaf == "weight":
            got = mx.dequantize(got, ours[f"{path}.scales"], ours[f"{path}.biases"], 32, 8)
            packed += 1
        want, got = np.array(want), np.array(got)
        step = np.abs(want.reshape(*want.shape[:-1], -1, 32) if want.shape[-1] % 32 == 0 else want).max(-1) / 127
        err = np.abs(got - want).reshape(step.shape + (-1,)).max(-1)
        assert np.all(err <= step + 1e-6), key
    assert packed > 10 and any("linear_attn.out_proj" in k for k in ours if k.endswith(".scales"))


# Words whose combining marks (\p{M}) Qwen3.5's split keeps inside the word and Qwen2's cuts off
MARKED = ["नमस्ते दुनिया, किताबें पढ़ो", "ภาษาไทย สวัสดีครับ", "e\u0301te\u0301 cafe\u0301 nai\u0308ve", "Привет, мир! 123"]


def test_qwen35_and_lfm2_pre_tokenizers_rebuilt(qwen3_tokenizer, llama31_tokenizer):
    """`qwen35` (Qwen3.5's GGUFs) splits as transformers' Qwen3.5 tokenizer does, marks inside
    words (here over Qwen3's vocabulary, whose own Qwen2 split tokenizes these texts otherwise);
    `lfm2`, which llama.cpp runs as Llama 3's split, as the Llama 3.1 tokenizer does."""
    from tokenizers import Tokenizer
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    llama3 = llama31_tokenizer / "tokenizer.json"
    qwen = json.loads((qwen3_tokenizer / "tokenizer.json").read_text())
    ref = Qwen3_5Tokenizer.from_pretrained(qwen3_tokenizer).backend_tokenizer
    ours = tokenizer_json(tokenizer_metadata(qwen, "qwen35"))
    qwen2 = Tokenizer.from_file(str(qwen3_tokenizer / "tokenizer.json"))
    for text in TEXTS + MARKED:
        assert ours.encode(text).ids == ref.encode(text).ids, text
    assert any(qwen2.encode(text).ids != ref.encode(text).ids for text in MARKED)
    ref = Tokenizer.from_file(str(llama3))
    ours = tokenizer_json(tokenizer_metadata(json.loads(llama3.read_text()), "lfm2"))
    for text in TEXTS + MARKED:
        assert ours.encode(text).ids == ref.encode(text).ids, text


def write_metadata(file: Path, meta: dict) -> Path:
    """A GGUF of metadata alone (no tensors), written by the `gguf` package."""
    import gguf
    from gguf import GGUFValueType as V

    def kind(v) -> V:
        return {bool: V.BOOL, int: V.INT64, float: V.FLOAT64, str: V.STRING}[type(v)]

    w = gguf.GGUFWriter(file, meta["general.architecture"])
    for key, value in meta.items():
        if key != "general.architecture":
            w.add_key_value(key, value, *((V.ARRAY, kind(value[0])) if isinstance(value, list) else (kind(value),)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return file


@pytest.mark.parametrize("name,key,value,says", [
    ("qwen3_5_text", "ssm.time_step_rank", 3, "cannot serve 2 key heads"),
    ("qwen3_5_text", "attention.recurrent_layers", [True, False], "has 2 entries for 4 layers"),
    ("lfm2", "attention.head_count_kv", [0, 2, 0], "has 3 entries for 4 layers"),
    ("lfm2", "attention.head_count_kv", [0, 2, 0, 4], "KV head counts [0, 2, 4] per layer are not supported"),
])
def test_inconsistent_hybrid_metadata_is_one_line_error(ggufs, tmp_path, name, key, value, says):
    """llama.cpp's metadata for a family, one value made inconsistent: a one-line error, nothing written."""
    with closing(GGUFFile(ggufs[name][1])) as file:
        meta = {k: v for k, v in file.metadata.items() if not k.startswith("tokenizer.")}
    meta |= {f"{meta['general.architecture']}.{key}": value, "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(MlxinferError) as error:
        convert(write_metadata(tmp_path / "bad.gguf", meta), tmp_path / "out")
    assert says in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()
