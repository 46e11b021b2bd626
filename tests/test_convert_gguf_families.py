"""GGUF files of every family we run, written the way llama.cpp's converter writes them
(its tensor names from the `gguf` package's name map, Q/K rows permuted for Llama, Gemma
norms stored as 1 + w, experts stacked, Llama 3 scaling as a `rope_freqs` tensor), then
converted and compared with transformers' own GGUF loader, which maps and dequantizes the
same file independently. transformers' GGUF reader drops settings llama.cpp keeps elsewhere
(rope_freqs, sliding windows, Gemma's attention scale), so the oracle takes its config from
the original checkpoint and only its weights from the GGUF."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_convert_gguf import IDS, llama_permute, logits, model_metadata, tokenizer_metadata

import mlxinfer
from mlxinfer.convert import convert

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

pytest.importorskip("accelerate")  # transformers loads GGUF files only with it
torch = pytest.importorskip("torch")

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_theta": 10000.0,
}
PHI3 = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # Phi3Config's defaults lie beyond our vocabulary
LONGROPE = {  # 16 test tokens exceed the original 8 positions: the long factors apply
    "max_position_embeddings": 64, "original_max_position_embeddings": 8,
    "rope_scaling": {
        "rope_type": "longrope", "short_factor": np.linspace(1.0, 1.5, 8).tolist(),
        "long_factor": np.linspace(1.0, 6.0, 8).tolist(),
    },
}
QWEN_MOE = {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
# name: (HF model_type, GGUF architecture, config overrides)
FAMILIES = {
    "llama3-rope-freqs": ("llama", "llama", {"rope_parameters": LLAMA3, "max_position_embeddings": 131072}),
    "mistral-sliding-window": ("mistral", "llama", {"sliding_window": 4, "head_dim": 16}),
    "phi3": ("phi3", "phi3", {**PHI3, "sliding_window": 6}),
    "phi3-longrope": ("phi3", "phi3", {**PHI3, **LONGROPE}),
    "gemma2": (
        "gemma2", "gemma2",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4, "tie_word_embeddings": True,
         "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    ),
    "qwen2moe": ("qwen2_moe", "qwen2moe", {**QWEN_MOE, "shared_expert_intermediate_size": 48}),
    "qwen3moe": ("qwen3_moe", "qwen3moe", {**QWEN_MOE, "head_dim": 16, "norm_topk_prob": True}),
}


def llama3_rope_freqs(src: Path) -> np.ndarray:
    """The `rope_freqs` tensor: unscaled over scaled inverse frequencies, the scaled ones by
    transformers' own llama3 RoPE initialisation."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(src)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    dim = cfg.head_dim
    base = 1.0 / (LLAMA3["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (base / scaled).numpy().astype(np.float32)


def family_metadata(w: gguf.GGUFWriter, config: dict, arch: str) -> None:
    """What llama.cpp's converter adds for each family beyond the common keys."""
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "deepseek2":
        deepseek2_metadata(w, config)
    if "moe" in arch:
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def deepseek2_metadata(w: gguf.GGUFWriter, config: dict) -> None:
    """llama.cpp's DeepSeek keys: latent attention as one shared KV head of kv_lora_rank +
    rotary dims (the `_mla` keys hold the per-head sizes), routing, YaRN's log multiplier."""
    rank, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    w.add_head_count_kv(1)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(config["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(config["v_head_dim"])
    w.add_rope_dimension_count(rope_dim)
    if config.get("q_lora_rank"):
        w.add_q_lora_rank(config["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_leading_dense_block_count(config["first_k_dense_replace"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    w.add_expert_weights_norm(config["norm_topk_prob"])
    sigmoid = config["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if (config.get("n_group") or 1) > 1:
        w.add_expert_group_count(config["n_group"])
        w.add_expert_group_used_count(config["topk_group"])
    rope = config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def split_kv_b(value: np.ndarray, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's k_b [heads, rank, nope] (transposed) and v_b [heads, v, rank] of kv_b_proj."""
    nope = config["qk_nope_head_dim"]
    per_head = value.reshape(config["num_attention_heads"], nope + config["v_head_dim"], -1)
    return per_head[:, :nope].transpose(0, 2, 1), per_head[:, nope:]


def gguf_tensors(weights: dict[str, np.ndarray], config: dict, arch: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as llama.cpp stores them, under Hugging Face names still
    (experts stacked as `<block>.experts.<proj>.weight` [experts, out, in])."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, value in weights.items():
        if arch == "llama" and name.split(".")[-2] in heads:
            value = llama_permute(value, heads[name.split(".")[-2]])
        if arch == "gemma2" and name.endswith("norm.weight"):
            value = value + 1
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if name.endswith("kv_b_proj.weight") and arch == "deepseek2":
            block = name.removesuffix("kv_b_proj.weight")
            out[block + "k_b_proj.weight"], out[block + "v_b_proj.weight"] = split_kv_b(value, config)
            continue
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if m := re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)\.weight", name):
            experts[f"{m[1]}.{m[3]}.weight"][int(m[2])] = value
            continue
        out[name] = value.squeeze() if value.shape[0] == 1 else value  # llama.cpp squeezes [1, n] to [n]
    out.update({name: np.stack([e[i] for i in sorted(e)]) for name, e in experts.items()})
    return out


def write_family_gguf(path: Path, src: Path, arch: str, kind: Q = Q.F32) -> None:
    """The checkpoint in `src` as llama.cpp writes it, matrices (and stacked experts) stored as `kind`."""
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(src / "model.safetensors")).items()}
    rope = config.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    model_metadata(w, config)
    family_metadata(w, config, arch)
    tok = json.loads((src / "tokenizer.json").read_text())
    meta = tokenizer_metadata(tok, "gpt-2")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.__members__[arch.upper()], config["num_hidden_layers"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(src))
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    for name, value in gguf_tensors(weights, config, arch).items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if kind == Q.F32 or value.ndim == 1 or value.shape[-1] % 32:  # llama.cpp too keeps odd rows float
            w.add_tensor(gname, np.ascontiguousarray(value))
        else:
            w.add_tensor(gname, quantize(np.ascontiguousarray(value), kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def transformers_logits(folder: Path, file: str, src: Path) -> np.ndarray:
    """The GGUF's weights as transformers' GGUF loader maps and dequantizes them, run by
    transformers' model for the original config. The loader knows llama.cpp's `llama` files
    only as Llama, so a Mistral file is loaded as one and its weights moved over."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    config = AutoConfig.from_pretrained(src)
    as_llama = {k: v for k, v in config.to_diff_dict().items() if k not in ("model_type", "architectures")}
    stored = LlamaConfig(**as_llama) if config.model_type == "mistral" else config
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=stored, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model.load_state_dict(loaded.state_dict(), strict=True)
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_family_matches_transformers_gguf_loader(hf_checkpoint, tmp_path, family):
    model_type, arch, overrides = FAMILIES[family]
    src = hf_checkpoint(model_type, **overrides)
    write_family_gguf(tmp_path / "model.gguf", src, arch)
    convert(tmp_path / "model.gguf", tmp_path / "out", dtype="float32")
    want = transformers_logits(tmp_path, "model.gguf", src)
    got = logits(mlxinfer.load(tmp_path / "out")[0])
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0], ids=lambda k: k.name)
def test_quantized_moe_gguf_matches_transformers_gguf_loader(hf_checkpoint, tmp_path, kind):
    """Stacked experts stored quantized keep their blocks (repacked as MLX 4/8-bit) and still
    give the logits of transformers' dequantization of the same file."""
    model_type, arch, overrides = FAMILIES["qwen2moe"]
    src = hf_checkpoint(model_type, **overrides)
    write_family_gguf(tmp_path / "model.gguf", src, arch, kind)
    report = convert(tmp_path / "model.gguf", tmp_path / "out", dtype="float32")
    assert report.source_precisions[kind.name] > 0
    want = transformers_logits(tmp_path, "model.gguf", src)
    np.testing.assert_allclose(logits(mlxinfer.load(tmp_path / "out")[0]), want, atol=1e-4, rtol=0)


DEEPSEEK = ["v2-q-lora-null", "v2-q-lora-grouped", "v3-grouped-k2"]


@pytest.mark.parametrize("variant", DEEPSEEK)
def test_deepseek2_gguf_matches_transformers(hf_checkpoint, tmp_path, variant):
    """llama.cpp's DeepSeek layout (kv_b split into k_b/v_b, experts stacked, one shared KV head
    in the metadata) converted back. transformers cannot load deepseek2 GGUF files, so the
    oracle is transformers on the original checkpoint, which the float32 file holds exactly.
    The variants keep YaRN's mscale equal to mscale_all_dim, the only case llama.cpp computes."""
    from test_models_deepseek import VARIANTS, checkpoint
    from transformers import AutoModelForCausalLM

    src = checkpoint(hf_checkpoint, *VARIANTS[variant])
    write_family_gguf(tmp_path / "model.gguf", src, "deepseek2")
    convert(tmp_path / "model.gguf", tmp_path / "out", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(logits(mlxinfer.load(tmp_path / "out")[0]), want, atol=1e-4, rtol=0)
