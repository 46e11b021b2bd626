"""A GGUF file as a conversion source: Hugging Face config, tensor names and layout
rebuilt from llama.cpp's metadata and naming."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxinfer.errors import ConfigError, ConversionError, UnsupportedArchitectureError

from .gguf_file import BF16, BLOCK_TYPES, F32, FLOAT_TYPES, Q8_0, GGUFFile, Packed, TensorInfo, gguf_type
from .gguf_tokenizer import generation_config, tokenizer_config, tokenizer_json
from .quantize import BITS, QuantSpec
from .sources import Source, SourceTensor, Tensor

Getter = Callable[..., Any]


def _gemma3_config(get: Getter) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves to llama.cpp's code: a global layer every 6th, local
    RoPE base 10000, attention scaled by head_dim**-0.5 except in the 62-layer 27B,
    which uses hidden / heads (llama.cpp's llama-model.cpp, LLM_ARCH_GEMMA3)."""
    layers, heads, hidden = get("block_count"), get("attention.head_count"), get("embedding_length")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == 62 else get("attention.key_length"),
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": 10000.0,
    }


@dataclass(frozen=True)
class Arch:
    """How a GGUF `general.architecture` maps back onto a Hugging Face family."""

    model_type: str
    cls: str  # the config's `architectures` entry
    permuted_qk: bool = False  # llama.cpp interleaved the rotary halves of Q/K rows
    names: dict[str, str] = field(default_factory=dict)  # block tensors named unlike Llama's
    norm_shift: float = 0.0  # llama.cpp stores norm weights plus this (Gemma's 1 + w, pre-added)
    config: Callable[[Getter], dict[str, Any]] | None = None  # family keys beyond the common ones


ARCHITECTURES = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM"),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        names={
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_shift=1.0,
        config=_gemma3_config,
    ),
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
        spec = ARCHITECTURES[arch]
        tensors = {}
        for info in gguf.tensors:
            name = hf_name(info.name, spec.names)
            rows = heads.get(name.rpartition(".")[0].rpartition(".")[2]) if spec.permuted_qk else None
            shift = spec.norm_shift if name.endswith("norm.weight") else 0.0
            read = partial(_read, gguf, info, rows, shift)
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


def hf_name(name: str, overrides: dict[str, str] | None = None) -> str:
    """llama.cpp's tensor name as Hugging Face's (`overrides`: an architecture's own block
    names); unknown names pass through to be reported as unused."""
    names = {**_BLOCK_NAMES, **(overrides or {})}
    if match := _BLOCK_TENSOR.fullmatch(name):
        layer, part, leaf = match.groups()
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{leaf}"
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
    spec = ARCHITECTURES[arch]

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
        "architectures": [spec.cls],
        "model_type": spec.model_type,
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
    if spec.config:
        del config["hidden_act"]
        config.update(spec.config(get))
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


def _read(gguf: GGUFFile, info: TensorInfo, heads: int | None, shift: float) -> Tensor:
    tensor = gguf.read(info)
    if shift:
        tensor = tensor - shift
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
