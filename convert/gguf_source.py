"""A GGUF file as a conversion source: Hugging Face config, tensor names and layout
rebuilt from llama.cpp's metadata and naming."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxinfer.errors import ConfigError, ConversionError, UnsupportedArchitectureError

from .gguf_file import BF16, BLOCK_TYPES, F32, FLOAT_TYPES, Q8_0, GGUFFile, Packed, TensorInfo, gguf_type
from .gguf_tokenizer import generation_config, tokenizer_config, tokenizer_json
from .quantize import BITS, QuantSpec
from .sources import Source, SourceTensor, Tensor

# GGUF `general.architecture` -> (config.json model_type, architectures entry, Q/K rows permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> Source:
    gguf = GGUFFile(path)
    try:
        meta = gguf.metadata
        arch = meta.get("general.architecture", "<missing>")
        config = hf_config(meta, {t.name for t in gguf.tensors})
        gguf.check_dequantizable()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        permuted = ARCHITECTURES[arch][2]
        tensors = {}
        for info in gguf.tensors:
            name = hf_name(info.name)
            rows = heads.get(name.rpartition(".")[0].rpartition(".")[2]) if permuted else None
            read = partial(_read, gguf, info, rows)
            tensors[name] = SourceTensor(name, info.shape, info.type_name, _precision(info), read)
        files = {
            "tokenizer.json": tokenizer_json(meta).to_str(pretty=True),
            "tokenizer_config.json": _dumps(tokenizer_config(meta)),
            "generation_config.json": _dumps(generation_config(meta)),
        }
    except BaseException:
        gguf.close()
        raise
    return Source(
        kind="GGUF file",
        location=path,
        config=config,
        tensors=tensors,
        origin=dict.fromkeys(tensors, path.name),
        dtype=_dtype(gguf.tensors),
        nbytes=path.stat().st_size,
        write_extras=partial(_write_files, files),
        close=gguf.close,
    )


def hf_name(name: str) -> str:
    """llama.cpp's tensor name as Hugging Face's; unknown names pass through to be reported as unused."""
    if match := _BLOCK_TENSOR.fullmatch(name):
        layer, part, leaf = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{leaf}"
    base, _, leaf = name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{leaf}" if base in _GLOBAL_NAMES else name


def hf_config(meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """config.json for the model a GGUF file describes."""
    arch = meta.get("general.architecture", "<missing>")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture '{arch}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if "rope_freqs.weight" in names:
        raise ConversionError(
            "this GGUF stores Llama 3.1-style rope scaling as a rope_freqs tensor, which cannot be converted "
            "back; convert the original Hugging Face checkpoint instead"
        )
    model_type, cls, _ = ARCHITECTURES[arch]

    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ...:
            raise ConfigError(f"GGUF metadata has no '{arch}.{key}'; the file is incomplete")
        return value

    heads, hidden = get("attention.head_count"), get("embedding_length")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedArchitectureError("GGUF models with a different head count per layer are not supported")
    head_dim = get("attention.key_length", hidden // heads)
    config = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        config["partial_rotary_factor"] = rope_dims / head_dim
    if scaling := _rope_scaling(meta, arch):
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = meta[f"tokenizer.ggml.{key}"]
    return config


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ConversionError(f"GGUF rope scaling '{kind}' is not supported; supported: linear, yarn")


def _precision(info: TensorInfo) -> QuantSpec | None:
    """Legacy quants map exactly; other quantized types get the narrowest MLX width (group 32,
    one fp16 scale and bias per group = +1 bit per weight) that stores at least as many bits."""
    if info.type in FLOAT_TYPES:
        return None
    if info.type in BLOCK_TYPES:
        return QuantSpec(8 if info.type == Q8_0 else 4, 32)
    qtype = gguf_type(info.type, info.name)
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    source_bits = size * 8 / block
    return QuantSpec(next((b for b in BITS if b + 1 >= source_bits), BITS[-1]), 32)


def _read(gguf: GGUFFile, info: TensorInfo, heads: int | None) -> Tensor:
    tensor = gguf.read(info)
    return tensor if heads is None else unpermute(tensor, heads)


def unpermute(tensor: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves of Q/K rows, so the
    weights suit non-interleaved RoPE again. Rows are independent in every layout, so packed
    weights, scales and biases are permuted alike, losslessly."""
    if isinstance(tensor, Packed):
        return Packed(*(unpermute(t, heads) for t in (tensor.weight, tensor.scales, tensor.biases)), tensor.spec)
    rows, *rest = tensor.shape
    return tensor.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(tensor.shape)


def _dtype(tensors: list[TensorInfo]) -> mx.Dtype:
    """bfloat16 if the file has BF16 tensors, float16 if it has F16 or quantized ones (their
    scales are fp16), else float32."""
    kinds = {t.type for t in tensors}
    if BF16 in kinds:
        return mx.bfloat16
    return mx.float32 if kinds <= {F32} else mx.float16


def _write_files(files: dict[str, str], folder: Path) -> None:
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
