"""A GGUF file as a conversion source: Hugging Face config, tensor names and layout
rebuilt from llama.cpp's metadata and naming."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxinfer.base.errors import ConfigError, ConversionError, CorruptCheckpointError, UnsupportedArchitectureError
from mlxinfer.models.layers import inv_freq, llama3_inv_freq

from .gguf_file import BF16, BLOCK_TYPES, F32, FLOAT_TYPES, MXFP4, Q8_0, GGUFFile, Packed, TensorInfo, gguf_type
from .gguf_recurrent import Layout, Part, gated_delta_layout, short_conv_layout
from .gguf_tokenizer import generation_config, tokenizer_config, tokenizer_json
from .quantize import BITS, QuantSpec
from .sources import Source, SourceTensor, Tensor

Getter = Callable[..., Any]
ConfigPart = Callable[[Getter, set[str]], dict[str, Any]]


def _gemma3_config(get: Getter, names: set[str]) -> dict[str, Any]:
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


def _gemma2_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """Gemma 2 as llama.cpp runs it: sliding and global layers alternating (sliding first),
    attention scaled by head_dim**-0.5 except in the 46-layer 27B, which uses hidden / heads;
    soft-capping at llama.cpp's defaults (50, 30) where the file does not say."""
    layers, heads, hidden = get("block_count"), get("attention.head_count"), get("embedding_length")
    caps = {k: get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping") if get(k, None) is not None}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == 46 else get("attention.key_length"),
        "sliding_window": get("attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(layers)],
        **caps,
    }


def _llama_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """llama.cpp runs Mistral as `llama`; a sliding window in the metadata makes it Mistral again."""
    window = get("attention.sliding_window", None)
    if not window:
        return {}
    return {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": window}


def _phi3_config(get: Getter, names: set[str]) -> dict[str, Any]:
    window = get("attention.sliding_window", None)
    return {"sliding_window": window} if window else {}


def _moe_config(norm_topk_prob: bool) -> ConfigPart:
    """Qwen MoE settings; a layer without stacked experts is one of the dense `mlp_only_layers`.
    llama.cpp renormalizes the top-k weights for Qwen3-MoE and not for Qwen2-MoE."""

    def config(get: Getter, names: set[str]) -> dict[str, Any]:
        layers = get("block_count") - get("nextn_predict_layers", 0)
        return {
            "num_experts": get("expert_count"),
            "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in names],
        }

    return config


def _deepseek2_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """DeepSeek-V2/V3 as llama.cpp stores them: latent attention written as one shared KV head
    whose `key_length` is kv_lora_rank + rotary dims (the `_mla` keys hold the per-head sizes;
    files from before llama.cpp split kv_b have only the per-head ones), sigmoid gating and
    `exp_probs_b` for V3, expert groups where the file has them."""
    heads, rope = get("attention.head_count"), get("rope.dimension_count")
    key, value = get("attention.key_length_mla", None), get("attention.value_length_mla", None)
    if key is None or value is None:
        key, value = get("attention.key_length"), get("attention.value_length")
    v3 = get("expert_gating_func", 1) == 2
    groups = get("expert_group_count", 1)
    method = "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy"
    return {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": heads,
        "head_dim": rope,
        "q_lora_rank": get("attention.q_lora_rank", None),
        "kv_lora_rank": get("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope,
        "v_head_dim": value,
        "n_routed_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "n_shared_experts": get("expert_shared_count", 0),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "routed_scaling_factor": get("expert_weights_scale", 1.0),
        "norm_topk_prob": get("expert_weights_norm", False),
        "n_group": groups,
        "topk_group": get("expert_group_used_count", 1),
        "topk_method": method,
        "scoring_func": "sigmoid" if v3 else "softmax",
    }


def _smollm3_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """llama.cpp leaves RoPE out of every 4th SmolLM3 layer (its `n_no_rope_layer_step`, not stored)."""
    return {"no_rope_layer_interval": 4}


def _olmo2_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """OLMo 3 is written as `olmo2` with a sliding window: its pattern (true: sliding) is in the
    file or, as llama.cpp assumes, every 4th layer full; the sliding layers have their own RoPE
    base. RoPE scaling, if any, stays in `rope_scaling`, which the family applies to the full
    layers only, as transformers and llama.cpp do."""
    window = get("attention.sliding_window", 0)
    if not window:
        return {}
    layers = get("block_count")
    pattern = get("attention.sliding_window_pattern", [(i + 1) % 4 != 0 for i in range(layers)])
    if len(pattern) != layers:
        raise CorruptCheckpointError(
            f"GGUF metadata 'olmo2.attention.sliding_window_pattern' has {len(pattern)} entries for {layers} "
            "layers; the file is damaged"
        )
    base = get("rope.freq_base", 10000.0)
    return {
        "model_type": "olmo3",
        "architectures": ["Olmo3ForCausalLM"],
        "sliding_window": window,
        "layer_types": ["sliding_attention" if slides else "full_attention" for slides in pattern],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": base},
            "sliding_attention": {"rope_type": "default", "rope_theta": get("rope.freq_base_swa", base)},
        },
    }


def _glm4moe_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """GLM-4.5: the multi-token-prediction layers llama.cpp counts in `block_count` are not the
    model's; partial RoPE as the rotary dimensions say; DeepSeek-V3's routing keys."""
    head_dim = get("attention.key_length", get("embedding_length") // get("attention.head_count"))
    return {
        "num_hidden_layers": get("block_count") - get("nextn_predict_layers", 0),
        "num_nextn_predict_layers": get("nextn_predict_layers", 0),
        "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        "n_routed_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "n_shared_experts": get("expert_shared_count", 0),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "routed_scaling_factor": get("expert_weights_scale", 1.0),
        "norm_topk_prob": get("expert_weights_norm", False),
        "n_group": get("expert_group_count", 1),
        "topk_group": get("expert_group_used_count", 1),
    }


def _gpt_oss_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """gpt-oss as llama.cpp runs it: sliding and full layers alternating (sliding first), and
    experts with their own width. llama.cpp rounds YaRN's correction range outward for every
    model; gpt-oss's own definition does not (transformers' `truncate: false`), and that is
    the model the folder must be."""
    layers = get("block_count")
    return {
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "intermediate_size": get("expert_feed_forward_length"),
        "sliding_window": get("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": False,
        },
    }


def _gated_delta_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5: which layers are linear attention (`recurrent_layers`, else, as
    llama.cpp reads older files, all but every `full_attention_interval`-th), the linear
    attention's sizes from the `ssm` keys, and the multi-token-prediction layers that
    `block_count` includes left out. Text positions make Qwen3.5's MRoPE sections plain RoPE."""
    layers = get("block_count") - get("nextn_predict_layers", 0)
    interval = get("full_attention_interval", 4)
    recurrent = get("attention.recurrent_layers", [(i + 1) % interval != 0 for i in range(layers)])
    if len(recurrent) < layers:
        raise CorruptCheckpointError(
            f"GGUF metadata 'attention.recurrent_layers' has {len(recurrent)} entries for {layers} layers; "
            "the file is damaged"
        )
    value_heads, key_heads = get("ssm.time_step_rank"), get("ssm.group_count")
    if value_heads % key_heads or get("ssm.inner_size") % value_heads:
        raise CorruptCheckpointError(
            f"GGUF ssm metadata: {value_heads} value heads (time_step_rank) of {get('ssm.inner_size')} values "
            f"(inner_size) in all cannot serve {key_heads} key heads (group_count); the file is damaged"
        )
    return {
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_value_head_dim": get("ssm.inner_size") // value_heads,
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
    }


def _gated_delta_moe_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5-MoE's experts: llama.cpp always renormalises the top-k weights.
    Qwen3.5-MoE configs have no dense width; its shared expert's stands in, as the family's."""
    config = {**_gated_delta_config(get, names), **_moe_config(True)(get, names)}
    if get("feed_forward_length", None) is None:
        config["intermediate_size"] = get("expert_shared_feed_forward_length")
    return config


def _lfm2_config(get: Getter, names: set[str]) -> dict[str, Any]:
    """LFM2: a layer with no KV heads is a short convolution; the MLP width is stored as used."""
    layers, kv_heads = get("block_count"), get("attention.head_count_kv")
    if not isinstance(kv_heads, list):
        kv_heads = [kv_heads] * layers
    if len(kv_heads) != layers:
        raise CorruptCheckpointError(
            f"GGUF metadata 'attention.head_count_kv' has {len(kv_heads)} entries for {layers} layers; "
            "the file is damaged"
        )
    return {
        "layer_types": ["full_attention" if n else "conv" for n in kv_heads],
        "conv_L_cache": get("shortconv.l_cache"),
        "conv_bias": any(n.endswith(".shortconv.conv.bias") for n in names),
        "block_auto_adjust_ff_dim": False,
    }


@dataclass(frozen=True)
class Arch:
    """How a GGUF `general.architecture` maps back onto a Hugging Face family."""

    model_type: str
    cls: str  # the config's `architectures` entry
    permuted_qk: bool = False  # llama.cpp interleaved the rotary halves of Q/K rows
    names: dict[str, str] = field(default_factory=dict)  # block tensors named unlike Llama's
    norm_shift: float = 0.0  # llama.cpp stores norm weights plus this (Gemma's 1 + w, pre-added)
    config: ConfigPart | None = None  # family keys beyond the common ones
    layout: Layout | None = None  # tensors llama.cpp rearranged, and how to put them back


_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Stacked experts [experts, out, in] are already our `switch_mlp` layout.
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Qwen3-Next's and Qwen3.5's linear attention; `ssm_a` (no leaf) is a whole name.
_GATED_DELTA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_LFM2_NAMES = {
    "token_embd_norm": "model.norm",  # llama.cpp's name for LFM2's final norm
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_SHARED_EXPERTS = {  # DeepSeek's and GLM's names: several shared experts as one, no gate
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
ARCHITECTURES = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted_qk=True, config=_llama_config),
    "gpt-oss": Arch(
        "gpt_oss", "GptOssForCausalLM",
        names={
            **_POST_NORMS,
            "attn_sinks.weight": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
            "ffn_gate_exps": "mlp.experts.gate_proj",
            "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj",
        },
        config=_gpt_oss_config,
    ),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": Arch("qwen2_moe", "Qwen2MoeForCausalLM", names=_MOE_NAMES, config=_moe_config(False)),
    "qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", names=_MOE_NAMES, config=_moe_config(True)),
    "phi3": Arch(
        "phi3", "Phi3ForCausalLM", names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        config=_phi3_config,
    ),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", names=_GEMMA_NAMES, norm_shift=1.0, config=_gemma2_config),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", names=_GEMMA_NAMES, norm_shift=1.0, config=_gemma3_config),
    "deepseek2": Arch(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        names={
            **_MOE_NAMES,
            "attn_q_a": "self_attn.q_a_proj",
            "attn_q_a_norm": "self_attn.q_a_layernorm",
            "attn_q_b": "self_attn.q_b_proj",
            "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
            "attn_kv_a_norm": "self_attn.kv_a_layernorm",
            **_SHARED_EXPERTS,
        },
        config=_deepseek2_config,
    ),
    "smollm3": Arch("smollm3", "SmolLM3ForCausalLM", permuted_qk=True, config=_smollm3_config),
    "olmo2": Arch("olmo2", "Olmo2ForCausalLM", names=_POST_NORMS, config=_olmo2_config),
    "glm4moe": Arch(
        "glm4_moe", "Glm4MoeForCausalLM", names={**_MOE_NAMES, **_SHARED_EXPERTS, **_POST_NORMS},
        config=_glm4moe_config,
    ),
    "qwen3next": Arch(
        "qwen3_next", "Qwen3NextForCausalLM", names={**_MOE_NAMES, **_GATED_DELTA_NAMES}, norm_shift=1.0,
        config=_gated_delta_moe_config, layout=gated_delta_layout(reordered=False),
    ),
    "qwen35": Arch(
        "qwen3_5_text", "Qwen3_5ForCausalLM", names=_GATED_DELTA_NAMES, norm_shift=1.0,
        config=_gated_delta_config, layout=gated_delta_layout(reordered=True),
    ),
    "qwen35moe": Arch(
        "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", names={**_MOE_NAMES, **_GATED_DELTA_NAMES}, norm_shift=1.0,
        config=_gated_delta_moe_config, layout=gated_delta_layout(reordered=True),
    ),
    "lfm2": Arch("lfm2", "Lfm2ForCausalLM", names=_LFM2_NAMES, config=_lfm2_config, layout=short_conv_layout),
}
# DeepSeek's K/V up-projection: one attn_kv_b, or (newer llama.cpp) per-head attn_k_b and attn_v_b.
_KV_B = re.compile(r"blk\.(\d+)\.attn_(kv|k|v)_b\.weight")
# Tensors llama.cpp derives from the config; they are read back into it, never stored as weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
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
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def open_gguf(path: Path) -> Source:
    gguf = GGUFFile(path)
    try:
        meta = checked_metadata(gguf.metadata, gguf.path.name)
        config = hf_config(gguf, meta)
        gguf.check_dequantizable()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        spec = ARCHITECTURES[meta["general.architecture"]]
        mla = _mla_tensors(gguf, config) if "kv_lora_rank" in config else {}
        tensors = dict(mla)
        for info in gguf.tensors:
            if info.name in _ROPE_TENSORS or (mla and _KV_B.fullmatch(info.name)):
                continue
            if (block := _BLOCK.match(info.name)) and int(block[1]) >= config["num_hidden_layers"]:
                continue  # a block past the model's layers: GLM's multi-token-prediction layer
            name = hf_name(info.name, spec.names)
            if spec.layout and (parts := spec.layout(name, info.shape, config)) is not None:
                tensors.update(_parts(gguf, info, parts))
                continue
            rows = heads.get(name.rpartition(".")[0].rpartition(".")[2]) if spec.permuted_qk else None
            shift = spec.norm_shift if name.endswith("norm.weight") else 0.0
            shape = _hf_shape(name, info.shape)
            read = partial(_read, gguf, info, rows, shift, shape)
            tensors[name] = SourceTensor(name, shape, info.type_name, _precision(info), read)
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
    """llama.cpp's tensor name as Hugging Face's (`overrides`: an architecture's own names);
    unknown names pass through to be reported as unused."""
    names = {**_BLOCK_NAMES, **(overrides or {})}
    if match := _BLOCK_TENSOR.fullmatch(name):
        layer, part, leaf = match.groups()
        if leaf is None:  # a tensor with no leaf (Qwen3-Next's `ssm_a`): the entry is the whole name
            return f"model.layers.{layer}.{names[part]}" if part in names else name
        if f"{part}.{leaf}" in names:  # an entry naming the leaf too maps the whole name
            return f"model.layers.{layer}.{names[f'{part}.{leaf}']}"
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{leaf}"
    base, _, leaf = name.rpartition(".")
    outer = {**_GLOBAL_NAMES, **(overrides or {})}
    return f"{outer[base]}.{leaf}" if base in outer else name


def _parts(gguf: GGUFFile, info: TensorInfo, parts: list[Part]) -> dict[str, SourceTensor]:
    """The tensors a layout makes of one stored tensor, each read and rearranged on demand."""
    return {
        p.name: SourceTensor(p.name, p.shape, info.type_name, _precision(info), partial(_undo, gguf, info, p))
        for p in parts
    }


def _undo(gguf: GGUFFile, info: TensorInfo, part: Part) -> Tensor:
    return part.undo(gguf.read(info))


def _mla_tensors(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, SourceTensor]:
    """DeepSeek's K/V up-projection per layer in the layout the family loads: one `kv_b_proj`
    (V2) or per-head `embed_q` [heads, rank, nope] and `unembed_out` [heads, v, rank] (V3).
    llama.cpp stores either one `attn_kv_b` (older files) or exactly V3's halves as
    `attn_k_b` / `attn_v_b`; halves that must be joined, or a whole that must be split, are
    read as floats, since k_b's rows run along the other axis."""
    found: dict[str, dict[str, TensorInfo]] = {}
    for info in gguf.tensors:
        if m := _KV_B.fullmatch(info.name):
            found.setdefault(m[1], {})[m[2]] = info
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    shapes = {"kv": (heads * (nope + v_dim), rank), "k": (heads, rank, nope), "v": (heads, v_dim, rank)}
    leaves = {"kv": "kv_b_proj", "k": "embed_q", "v": "unembed_out"}
    wanted = ("k", "v") if config["model_type"] == "deepseek_v3" else ("kv",)
    out = {}
    for layer, parts in found.items():
        if set(parts) not in ({"kv"}, {"k", "v"}):
            raise CorruptCheckpointError(
                f"{gguf.path.name}: layer {layer} has {sorted(parts)} of attn_kv_b / attn_k_b / attn_v_b; "
                "expected attn_kv_b alone or attn_k_b with attn_v_b"
            )
        for kind, info in parts.items():
            if info.shape != shapes[kind]:
                raise CorruptCheckpointError(
                    f"{gguf.path.name}: '{info.name}' has shape {info.shape}, not {shapes[kind]} as the metadata says"
                )
        for kind in wanted:
            name = f"model.layers.{layer}.self_attn.{leaves[kind]}.weight"
            if kind in parts:  # stored as the family loads it
                info = parts[kind]
                out[name] = SourceTensor(name, info.shape, info.type_name, _precision(info), partial(gguf.read, info))
            elif kind == "kv":
                read = partial(_join_kv_b, gguf, parts["k"], parts["v"], shapes["kv"])
                out[name] = SourceTensor(name, shapes[kind], parts["k"].type_name, None, read)
            else:
                read = partial(_split_kv_b, gguf, parts["kv"], heads, nope, kind)
                out[name] = SourceTensor(name, shapes[kind], parts["kv"].type_name, None, read)
    return out


def _join_kv_b(gguf: GGUFFile, k: TensorInfo, v: TensorInfo, shape: tuple[int, ...]) -> mx.array:
    k_b, v_b = (_as_float(gguf.read(info)) for info in (k, v))
    return mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(shape)


def _split_kv_b(gguf: GGUFFile, kv: TensorInfo, heads: int, nope: int, kind: str) -> mx.array:
    w = _as_float(gguf.read(kv)).reshape(heads, -1, kv.shape[-1])
    return mx.contiguous(w[:, :nope].swapaxes(1, 2) if kind == "k" else w[:, nope:])


def _as_float(tensor: Tensor) -> mx.array:
    return tensor.dequantize() if isinstance(tensor, Packed) else tensor


def _hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """llama.cpp stores Qwen2-MoE's shared-expert gate [1, hidden] as a vector."""
    return (1, *shape) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape


def hf_config(gguf: GGUFFile, meta: dict[str, Any]) -> dict[str, Any]:
    """config.json for the model a GGUF file describes (`meta`: its checked metadata)."""
    names = {t.name for t in gguf.tensors}
    arch = meta["general.architecture"]
    spec = ARCHITECTURES[arch]

    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ...:
            raise ConfigError(f"{gguf.path.name}: GGUF metadata has no '{arch}.{key}'; the file is incomplete")
        return value

    heads, hidden = get("attention.head_count"), get("embedding_length")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer; 0 marks a layer without attention (LFM2's convolutions)
        counts = set(kv_heads) - {0}
        if len(counts) != 1:
            raise UnsupportedArchitectureError(
                f"GGUF '{arch}' models with KV head counts {sorted(set(kv_heads))} per layer are not supported"
            )
        kv_heads = counts.pop()
    head_dim = get("attention.key_length", hidden // heads)
    config = {
        "architectures": [spec.cls],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", None),
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
    if scaling := _rope_scaling(gguf, meta, config["rope_theta"], rope_dims, config["max_position_embeddings"]):
        config["rope_scaling"] = scaling
    if spec.config:
        family = spec.config(get, names)
        if "hidden_activation" in family:
            del config["hidden_act"]
        config.update(family)
    if config["intermediate_size"] is None:
        get("feed_forward_length")  # the family did not supply it either: the file is incomplete
    if rope_dims != config["head_dim"]:
        config["partial_rotary_factor"] = rope_dims / config["head_dim"]
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = meta[f"tokenizer.ggml.{key}"]
    return config


def _rope_scaling(
    gguf: GGUFFile, meta: dict[str, Any], theta: float, dims: int, context: int
) -> dict[str, Any] | None:
    """RoPE scaling from the metadata, or from the frequency tensors llama.cpp writes for
    Llama 3 (`rope_freqs`) and Phi-3 LongRoPE (`rope_factors_long/short`)."""
    arch, names = meta["general.architecture"], {t.name: t for t in gguf.tensors}
    if "rope_freqs.weight" in names:
        if arch != "llama":
            raise ConversionError(f"{gguf.path.name}: a rope_freqs tensor in a '{arch}' GGUF is not supported")
        divisors = _vector(gguf, names["rope_freqs.weight"])
        if divisors.shape != (dims // 2,) or not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
            raise CorruptCheckpointError(
                f"{gguf.path.name}: tensor 'rope_freqs.weight' should hold {dims // 2} positive numbers (a divisor "
                f"per rotary frequency), not shape {divisors.shape} with these values; the file is damaged"
            )
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        return llama3_scaling(divisors, theta, dims, original) or _exact_rope(divisors, context)
    if "rope_factors_long.weight" in names:
        long = names["rope_factors_long.weight"]
        return {
            "rope_type": "longrope",
            "long_factor": _vector(gguf, long).tolist(),
            "short_factor": _vector(gguf, names.get("rope_factors_short.weight", long)).tolist(),
            "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
        }
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        if (log_mul := meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")) is not None:
            # DeepSeek's 0.1 * mscale_all_dim; llama.cpp scales attention as if mscale were the same.
            scaling["mscale"] = scaling["mscale_all_dim"] = log_mul / 0.1
        return scaling
    raise ConversionError(f"GGUF rope scaling '{kind}' is not supported; supported: linear, yarn")


def _vector(gguf: GGUFFile, info: TensorInfo) -> np.ndarray:
    tensor = gguf.read(info)
    if isinstance(tensor, Packed) or len(info.shape) != 1:
        raise CorruptCheckpointError(f"{gguf.path.name}: tensor '{info.name}' should be a float vector")
    return np.array(tensor.astype(mx.float32))


# How closely derived Llama 3 settings must give back a rope_freqs tensor: float32 rounding
# (llama.cpp computes the divisors from float32 frequencies) and nothing more.
_LLAMA3_RTOL = 1e-5


def llama3_scaling(divisors: np.ndarray, theta: float, dims: int, original: int | None) -> dict[str, Any] | None:
    """Llama 3 `rope_scaling` that gives back every divisor of a `rope_freqs` tensor, or None.

    llama.cpp keeps only the divisors, not the settings that made them; the first candidate
    that reproduces them all is recorded, so transformers and mlx-lm run the same frequencies."""
    inv, divisors = inv_freq(theta, dims), divisors.astype(np.float64)
    for scaling in _llama3_candidates(divisors, inv / (2 * np.pi), original):
        if np.allclose(inv / llama3_inv_freq(inv, scaling), divisors, rtol=_LLAMA3_RTOL, atol=0):
            return scaling
    return None


def _llama3_candidates(divisors: np.ndarray, per_wavelength: np.ndarray, original: int | None) -> Iterator[dict]:
    """Settings that may have made `divisors`. Meta's rule divides frequencies of wavelength
    beyond original/low by `factor`, keeps those below original/high and blends in between
    with a weight linear in 1/wavelength. So the factor is the lowest frequency's divisor,
    and a line through the blended frequencies (two at least) gives the two wavelengths
    where blending starts and ends. Those fix only the ratios of original, low and high:
    `original` (the file's, else the one making low_freq_factor 1, as Meta's) picks one of
    the equivalent settings. Last, Meta's own values, for heads with one blended frequency."""
    factor = float(divisors[-1])
    if factor <= 1:
        return
    weight = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # 1: unscaled, 0: divided by factor
    blended = (weight > 1e-6) & (weight < 1 - 1e-6)
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(per_wavelength[blended], weight[blended], 1)
        if slope > 0 and intercept < 0:
            starts, ends = -intercept / slope, (1 - intercept) / slope  # 1/wavelength at weight 0 and 1
            context = original or max(1, round(1 / starts))
            for snap in (lambda x: float(f"{x:.5g}"), float):  # Meta's round numbers where they fit
                yield {
                    "rope_type": "llama3",
                    "factor": snap(factor),
                    "low_freq_factor": snap(context * starts),
                    "high_freq_factor": snap(context * ends),
                    "original_max_position_embeddings": context,
                }
    yield {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original or 8192,
    }


def _exact_rope(divisors: np.ndarray, context: int) -> dict[str, Any]:
    """Per-frequency divisors no Llama 3 setting gives back, kept exactly as the file has them.

    LongRoPE with equal short and long factors and attention factor 1 means precisely "divide
    frequency i by divisors[i]" at every length, and transformers, mlx-lm and our loader all
    read it that way, so the folder runs the GGUF's own frequencies in each of them."""
    factors = [float(d) for d in divisors]
    return {
        "rope_type": "longrope",
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": context,
        "short_factor": factors,
        "long_factor": factors,
    }


def _positive_int(v: Any) -> bool:
    return type(v) is int and v > 0


def _positive_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v > 0


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: type(v) is list and all(check(x) for x in v)


_INT, _NUMBER = (_positive_int, "a positive integer"), (_positive_number, "a positive number")
_COUNT = ((lambda v: type(v) is int and v >= 0), "a non-negative integer")
_TEXT, _FLAG = ((lambda v: type(v) is str), "a string"), ((lambda v: type(v) is bool), "true or false")
# What each metadata value we read must be; `{arch}.` is dropped from the architecture's keys.
ARCH_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(
        (
            "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.key_length", "attention.value_length", "rope.dimension_count", "vocab_size", "expert_count",
            "expert_used_count", "expert_feed_forward_length", "rope.scaling.original_context_length",
            "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla",
            "attention.value_length_mla", "expert_group_count", "expert_group_used_count", "expert_gating_func",
            "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
            "full_attention_interval", "shortconv.l_cache",
        ),
        _INT,
    ),
    **dict.fromkeys(("expert_shared_count", "leading_dense_block_count", "nextn_predict_layers"), _COUNT),
    **dict.fromkeys(
        ("attention.sliding_window_pattern", "attention.recurrent_layers"),
        (_list_of(lambda v: type(v) is bool), "a list of true/false"),
    ),
    "expert_weights_norm": _FLAG,
    "attention.head_count_kv": (
        lambda v: _positive_int(v) or (_list_of(_COUNT[0])(v) and any(v)), "a positive integer or a list of counts"
    ),
    "attention.sliding_window": _COUNT,
    "expert_shared_feed_forward_length": _COUNT,
    "rope.scaling.yarn_log_multiplier": (_number, "a number"),
    "rope.scaling.yarn_beta_fast": _NUMBER,
    "rope.scaling.yarn_beta_slow": _NUMBER,
    **dict.fromkeys(
        (
            "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor",
            "attn_logit_softcapping", "final_logit_softcapping", "expert_weights_scale",
        ),
        _NUMBER,
    ),
    "rope.scaling.type": _TEXT,
}
TOKENIZER_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tokenizer.ggml.model": _TEXT,
    "tokenizer.ggml.pre": _TEXT,
    "tokenizer.chat_template": _TEXT,
    "tokenizer.ggml.tokens": (_list_of(lambda v: type(v) is str), "a list of strings"),
    "tokenizer.ggml.merges": (_list_of(lambda v: type(v) is str and " " in v), "a list of 'left right' pairs"),
    "tokenizer.chat_templates": (_list_of(lambda v: type(v) is str), "a list of strings"),
    "tokenizer.ggml.token_type": (_list_of(lambda v: type(v) is int), "a list of integers"),
    "tokenizer.ggml.scores": (_list_of(_number), "a list of numbers"),
    **{f"tokenizer.ggml.add_{k}_token": _FLAG for k in ("bos", "eos", "sep")},
    "tokenizer.ggml.add_space_prefix": _FLAG,
}
_SPECIAL_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id")


def checked_metadata(meta: dict[str, Any], file: str) -> dict[str, Any]:
    """The metadata once every value this conversion reads has the type and range llama.cpp
    gives it, so a damaged or hand-edited file is one error naming the field, not a crash or
    a config that fails later. Like llama.cpp, special token ids beyond the vocabulary are
    ignored (some converters write -1 for "none"); the copy returned leaves them out."""

    def refuse(key: str, value: Any, expected: str) -> None:
        shown = repr(value if not isinstance(value, list) else value[:3])[:60]
        raise CorruptCheckpointError(f"{file}: GGUF metadata '{key}' is {shown}, not {expected}; the file is damaged")

    arch = meta.get("general.architecture", "<missing>")
    if type(arch) is not str:
        refuse("general.architecture", arch, "a string")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture '{arch}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )

    checks = {**{f"{arch}.{k}": c for k, c in ARCH_KEYS.items()}, **TOKENIZER_KEYS}
    for key, (ok, expected) in checks.items():
        if key in meta and not ok(meta[key]):
            refuse(key, meta[key], expected)
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or not tokens:
        raise CorruptCheckpointError(f"{file}: GGUF metadata has no 'tokenizer.ggml.tokens'; the file is incomplete")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta and len(meta[key]) != len(tokens):
            refuse(key, meta[key], f"a list of {len(tokens)} values, one per token")
    for key in filter(_SPECIAL_ID.fullmatch, meta):
        if type(meta[key]) is not int:
            refuse(key, meta[key], "a token id")
    for name in meta.get("tokenizer.chat_templates", []):
        if type(meta.get(f"tokenizer.chat_template.{name}")) is not str:
            refuse(f"tokenizer.chat_template.{name}", meta.get(f"tokenizer.chat_template.{name}"), "a string")
    for key in (k for k in meta if k.startswith("general.sampling.")):
        if not _number(meta[key]):
            refuse(key, meta[key], "a number")
    return {k: v for k, v in meta.items() if not _SPECIAL_ID.fullmatch(k) or 0 <= v < len(tokens)}


def _precision(info: TensorInfo) -> QuantSpec | None:
    """Legacy quants map exactly; other quantized types get the narrowest MLX width (group 32,
    one fp16 scale and bias per group = +1 bit per weight) that stores at least as many bits."""
    if info.type in FLOAT_TYPES:
        return None
    if info.type == MXFP4:
        return QuantSpec(4, 32, "mxfp4")
    if info.type in BLOCK_TYPES:
        return QuantSpec(8 if info.type == Q8_0 else 4, 32)
    qtype = gguf_type(info.type, info.name)
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    source_bits = size * 8 / block
    return QuantSpec(next((b for b in BITS if b + 1 >= source_bits), BITS[-1]), 32)


def _read(gguf: GGUFFile, info: TensorInfo, heads: int | None, shift: float, shape: tuple[int, ...]) -> Tensor:
    tensor = gguf.read(info)
    if shape != info.shape:
        tensor = tensor.reshape(shape)
    if shift:
        tensor = tensor - shift
    return tensor if heads is None else unpermute(tensor, heads)


def unpermute(tensor: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves of Q/K rows, so the
    weights suit non-interleaved RoPE again. Rows are independent in every layout, so packed
    weights, scales and biases are permuted alike, losslessly."""
    if isinstance(tensor, Packed):
        rows = {k: unpermute(t, heads) for k, t in tensor.tensors().items()}
        return Packed(rows["weight"], rows["scales"], rows.get("biases"), tensor.spec)
    rows, *rest = tensor.shape
    return tensor.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(tensor.shape)


def _dtype(tensors: list[TensorInfo]) -> mx.Dtype:
    """bfloat16 if the file has BF16 tensors, float16 if it has F16 or quantized ones (their
    scales are fp16; MXFP4's are exponents), else float32."""
    kinds = {t.type for t in tensors}
    if BF16 in kinds:
        return mx.bfloat16
    return mx.float32 if kinds <= {F32, MXFP4} else mx.float16


def _write_files(files: dict[str, str], folder: Path) -> None:
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
