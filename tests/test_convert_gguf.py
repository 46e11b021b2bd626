"""GGUF sources: files written here with llama.cpp's own `gguf` package from random-weight
checkpoints (tensor names from its name map, Q/K rows permuted as its converter does), then
converted and compared with independent readers: `mx.load` of the GGUF bit for bit, the
`gguf` package's dequantization for logits, mlx-lm's quantizer for re-quantized layers, and
the original tokenizer.json for the rebuilt tokenizer."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import CHATML, CORPUS, real_tokenizer
from tokenizers import Tokenizer

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.convert.gguf_tokenizer import tokenizer_json
from mlxinfer.base.errors import ConversionError, CorruptCheckpointError, TokenizerError, UnsupportedArchitectureError

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import TokenType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

IDS = np.random.default_rng(1).integers(0, 500, size=(2, 16))
TEXTS = [
    *CORPUS[:5],
    "Hello world! 12345 and 3.14159, 1000000 items",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # ünïcödé, 日本語, emoji 🎉\n\n\n",
    "   leading spaces,\ttabs\r\nand CRLF   ",
    "I'm sure they'll say it's John's, we've seen THEY'RE",
]


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q_proj/k_proj rows (rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(shape: tuple[int, int], kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Blocks of `kind` with random codes; K-quant scales set to give weights of roughly +-0.1."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    if kind == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (fp16)
        raw[..., 192:208] = rng.integers(-16, 17, size=raw[..., 192:208].shape).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = np.full(raw.shape[:2], 3e-4, np.float16)[..., None].view(np.uint8)
    elif kind == Q.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales/mins, qs[128]
        raw[..., 0:4] = np.array([2e-4, 1.5e-3], np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


def tokenizer_metadata(tok: dict, pre: str | None) -> dict:
    """`tokenizer.ggml.*` as llama.cpp's converter writes them for a tokenizer.json."""
    model = tok["model"]
    added = {t["id"]: t for t in tok["added_tokens"]}
    ids = {**model["vocab"], **{t["content"]: i for i, t in added.items()}}
    tokens = [None] * (max(ids.values()) + 1)
    for token, i in ids.items():
        tokens[i] = token
    types = []
    for i, token in enumerate(tokens):
        if i in added:
            types.append(TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED)
        elif pre is None and token.startswith("<0x") and len(token) == 6:
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    post = json.dumps(tok.get("post_processor"))
    bos = next((t for t in ("<|begin_of_text|>", "<s>") if f'"{t}"' in post), None)
    meta = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.add_bos_token": bos is not None,
    }
    if bos:
        meta["tokenizer.ggml.bos_token_id"] = ids[bos]
    if pre is None:  # SentencePiece: piece scores instead of merges; a piece scores higher the earlier it merges
        unk = ids[model["unk_token"]]
        types[unk] = TokenType.UNKNOWN
        first_merge = {}
        for rank, merge in enumerate(model["merges"]):
            first_merge.setdefault("".join(merge.split(" ") if isinstance(merge, str) else merge), rank)
        meta.update({
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.scores": [-float(first_merge.get(t, len(tokens) + i)) for i, t in enumerate(tokens)],
            "tokenizer.ggml.unknown_token_id": unk,
            "tokenizer.ggml.token_type": [int(t) for t in types],
        })
    else:
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.merges": merges})
    return meta


def model_metadata(w: gguf.GGUFWriter, config: dict) -> None:
    """The `<arch>.*` keys llama.cpp's converter writes for every family."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    w.add_vocab_size(config["vocab_size"])


def write_gguf(
    path: Path, hf_folder: Path, kind_of: Callable[[str, np.ndarray], Q], arch: str = "llama", pre: str = "gpt-2"
) -> dict[str, np.ndarray]:
    """A GGUF of the checkpoint in `hf_folder`; returns what it holds, dequantized by the `gguf`
    package, under Hugging Face names and in Hugging Face row order."""
    config = json.loads((hf_folder / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(hf_folder / "model.safetensors")).items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    model_metadata(w, config)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    setters = {
        "tokenizer.ggml.model": w.add_tokenizer_model,
        "tokenizer.ggml.pre": w.add_tokenizer_pre,
        "tokenizer.ggml.tokens": w.add_token_list,
        "tokenizer.ggml.token_type": w.add_token_types,
        "tokenizer.ggml.merges": w.add_token_merges,
        "tokenizer.ggml.add_bos_token": w.add_add_bos_token,
    }
    for key, value in tokenizer_metadata(json.loads((hf_folder / "tokenizer.json").read_text()), pre).items():
        setters[key](value)
    tok_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    vocab = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    w.add_eos_token_id(vocab.token_to_id(tok_config["eos_token"]))
    w.add_pad_token_id(vocab.token_to_id(tok_config["pad_token"]))
    w.add_chat_template(tok_config["chat_template"])
    gguf_arch = gguf.MODEL_ARCH.__members__.get(arch.upper(), gguf.MODEL_ARCH.LLAMA)
    names = gguf.get_tensor_name_map(gguf_arch, config["num_hidden_layers"])
    rng = np.random.default_rng(0)
    reference = {}
    for name, value in weights.items():
        kind = kind_of(name, value)
        if kind in (Q.F32, Q.F16):
            data = value.astype(np.float16 if kind == Q.F16 else np.float32)
        elif kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            data = quantize(value, kind)
        else:
            data = random_blocks(value.shape, kind, rng)
        with contextlib.suppress(NotImplementedError):  # only for the type nothing can read
            reference[name] = dequantize(data, kind).reshape(value.shape)
        rows = {"q_proj": heads, "k_proj": kv_heads}.get(name.split(".")[-2])
        if arch == "llama" and rows:
            data = llama_permute(data, rows)
        raw = {} if kind in (Q.F32, Q.F16) else {"raw_dtype": kind}
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, **raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def reference_folder(folder: Path, hf_folder: Path, weights: dict[str, np.ndarray]) -> Path:
    """The dequantized GGUF contents as a float32 Hugging Face checkpoint."""
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_folder / name, folder / name)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return folder


def logits(model) -> np.ndarray:
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def tensors(folder: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


def matrices_as(kind: Q) -> Callable[[str, np.ndarray], Q]:
    return lambda name, value: kind if value.ndim == 2 else Q.F32


@pytest.mark.parametrize("kind", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda k: k.name)
def test_legacy_gguf_maps_losslessly(hf_checkpoint, tmp_path, kind):
    import mlx_lm

    src = hf_checkpoint("llama")
    config = json.loads((src / "config.json").read_text())
    file = tmp_path / "model.gguf"
    reference = write_gguf(file, src, matrices_as(kind))
    report = convert(file, tmp_path / "out", dtype="float32")
    out = tmp_path / "out"

    # Bit for bit what mx.load (MLX's own GGUF reader) makes of each tensor, Q/K rows re-permuted.
    ours, theirs = tensors(out), mx.load(str(file))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    parts = ("weight", "scales", "biases") if kind != Q.F16 else ("weight",)
    for name, value in reference.items():
        path, leaf = name.rsplit(".", 1)
        gpath = names.get_name(path)
        for part in parts if value.ndim == 2 else (leaf,):
            a = ours[f"{path}.{part}"]
            b = np.array(theirs[f"{gpath}.{part}"].astype(a.dtype))  # fp16 -> fp32 is exact
            a = np.array(a)
            rows = heads.get(path.split(".")[-1])
            np.testing.assert_array_equal(llama_permute(a, rows) if rows else a, b, err_msg=f"{name} {part}")

    expected = {Q.F16: "float32", Q.Q8_0: "8-bit g32"}.get(kind, "4-bit g32")
    assert report.precisions[expected] >= 16 and report.source_precisions[kind.name] == 16
    want = mlxinfer.load(reference_folder(tmp_path / "ref", src, reference), dtype="float32")[0]
    got = mlxinfer.load(out)[0]
    np.testing.assert_allclose(logits(got), logits(want), atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits(mlx_lm.load(str(out))[0]), logits(got), atol=1e-5, rtol=0)


GGUF_VARIANTS = {
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32)),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
    "llama-tied-mha-bias": (
        "llama", dict(tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True, mlp_bias=True)
    ),
    "llama-rope-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_gguf_architectures_and_settings(hf_checkpoint, tmp_path, variant):
    model_type, overrides = GGUF_VARIANTS[variant]
    src = hf_checkpoint(model_type, **overrides)
    file = tmp_path / "model.gguf"
    reference = write_gguf(file, src, matrices_as(Q.Q8_0), arch=model_type)
    convert(file, tmp_path / "out", dtype="float32")
    want = mlxinfer.load(reference_folder(tmp_path / "ref", src, reference), dtype="float32")[0]
    got = mlxinfer.load(tmp_path / "out")[0]
    assert np.abs(logits(want)).max() > 0.1
    np.testing.assert_allclose(logits(got), logits(want), atol=1e-4, rtol=0)


def test_gguf_tokenizer_and_settings_rebuilt(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama")
    file = tmp_path / "model.gguf"
    write_gguf(file, src, matrices_as(Q.Q8_0))
    convert(file, tmp_path / "out")
    out = tmp_path / "out"
    ours, ref = Tokenizer.from_file(str(out / "tokenizer.json")), Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == ref.encode(text).ids, text
        assert ours.decode(ref.encode(text).ids) == ref.decode(ref.encode(text).ids)
    wrapped, original = mlxinfer.load_tokenizer(out), mlxinfer.load_tokenizer(src)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert wrapped.chat_template == CHATML
    assert wrapped.apply_chat_template(chat, tokenize=True) == original.apply_chat_template(chat, tokenize=True)
    assert wrapped.eos_token_ids == original.eos_token_ids
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ref.token_to_id("<|im_end|>")


def test_kquant_gguf_requantized_like_mlx_lm(hf_checkpoint, tmp_path):
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    src = hf_checkpoint("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    sensitive = ("embed_tokens", "lm_head", "v_proj", "down_proj")

    def kind_of(name, value):
        if value.ndim == 1:
            return Q.F32
        return Q.Q6_K if any(s in name for s in sensitive) else Q.Q4_K

    file = tmp_path / "model.gguf"
    reference = write_gguf(file, src, kind_of)
    report = convert(file, tmp_path / "out", dtype="float32")
    out = tmp_path / "out"
    assert report.source_precisions["Q6_K"] == 10 and report.source_precisions["Q4_K"] == 20
    assert report.precisions == {"6-bit g32": 10, "4-bit g32": 20, "float32": 9}

    # The packed layers are exactly what mlx-lm's quantizer makes of the gguf-dequantized weights.
    ref_folder = reference_folder(tmp_path / "ref", src, reference)
    per_layer = json.loads((out / "config.json").read_text())["quantization"]
    model, config = mlx_lm.load(str(ref_folder), return_config=True)[0::2]
    expected, _ = quantize_model(model, config, 32, 4, quant_predicate=lambda p, m: per_layer.get(p, False))
    ours = tensors(out)
    for name, value in tree_flatten(expected.parameters()):
        assert mx.array_equal(ours[name], value).item(), name

    # Logits stay within quantization error of the dequantized source: closer to it than the
    # same weights quantized uniformly at 4 bits (random weights make this model sensitive).
    want = logits(mlxinfer.load(ref_folder, dtype="float32")[0])
    uniform, _ = quantize_model(mlx_lm.load(str(ref_folder))[0], config, 32, 4)

    def error(x: np.ndarray) -> float:
        return float(np.linalg.norm(x - want) / np.linalg.norm(want))

    assert error(logits(mlxinfer.load(out)[0])) < error(logits(uniform)) < 0.5


def test_requantizing_a_gguf(hf_checkpoint, tmp_path):
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    src = hf_checkpoint("llama")
    file = tmp_path / "model.gguf"
    reference = write_gguf(file, src, matrices_as(Q.Q8_0))
    convert(file, tmp_path / "out", quantize=True, bits=3, group_size=64, dtype="float32")
    model, config = mlx_lm.load(str(reference_folder(tmp_path / "ref", src, reference)), return_config=True)[0::2]
    expected, _ = quantize_model(model, config, 64, 3)
    ours = tensors(tmp_path / "out")
    for name, value in tree_flatten(expected.parameters()):
        assert mx.array_equal(ours[name], value).item(), name


PRE_TOKENIZERS = [  # (real tokenizer, the GGUF pre-tokenizer that names its split)
    ("smollm2", "smollm"),
    ("qwen3", "qwen2"),
    ("llama3.1", "llama-bpe"),
    ("llama2", None),
    ("mistral-v0.1", None),
]


@pytest.mark.parametrize("name,pre", PRE_TOKENIZERS, ids=[n for n, _ in PRE_TOKENIZERS])
def test_real_tokenizers_rebuilt_from_metadata(name, pre):
    file = real_tokenizer(name) / "tokenizer.json"
    ref = Tokenizer.from_file(str(file))
    ours = tokenizer_json(tokenizer_metadata(json.loads(file.read_text()), pre))
    for text in TEXTS:
        assert ours.encode(text).ids == ref.encode(text).ids, text
        assert ours.decode(ref.encode(text).ids) == ref.decode(ref.encode(text).ids), text


def test_gguf_errors_are_one_line_and_write_nothing(hf_checkpoint, tmp_path, monkeypatch):
    src, out = hf_checkpoint("llama"), tmp_path / "out"

    alien = tmp_path / "alien.gguf"
    write_gguf(alien, src, matrices_as(Q.F16), arch="rwkv9")
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'rwkv9' is not supported"):
        convert(alien, out)

    odd_pre = tmp_path / "pre.gguf"
    write_gguf(odd_pre, src, matrices_as(Q.F16), pre="tekken")
    with pytest.raises(TokenizerError, match="pre-tokenizer 'tekken' is not supported"):
        convert(odd_pre, out)

    truncated = tmp_path / "truncated.gguf"
    write_gguf(truncated, src, matrices_as(Q.Q8_0))
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 5000)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        convert(truncated, out)

    exotic = tmp_path / "exotic.gguf"  # Q8_1 is an activation format nothing dequantizes
    write_gguf(exotic, src, lambda n, v: Q.Q8_1 if n.endswith("o_proj.weight") else matrices_as(Q.F16)(n, v))
    with pytest.raises(ConversionError, match="Q8_1, which cannot be dequantized"):
        convert(exotic, out)

    kquant = tmp_path / "k.gguf"
    write_gguf(kquant, hf_checkpoint("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4),
               matrices_as(Q.Q6_K))
    monkeypatch.setitem(sys.modules, "gguf", None)  # the optional extra not installed
    with pytest.raises(ConversionError, match=r"pip install 'mlxinfer\[gguf\]'") as e:
        convert(kquant, out)
    assert "\n" not in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
