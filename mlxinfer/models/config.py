"""Model configuration: one dataclass read from a Hugging Face `config.json`.

Family modules pass the few fields they define differently (biases, q/k norm,
which layers slide); everything else is read here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..base.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
CONV = "conv"  # LFM2's short convolution
RECURRENT = (LINEAR, CONV)  # layers that keep a fixed-size state instead of keys and values


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, normalised from `rope_parameters` (transformers 5)
    or the older `rope_theta` + `rope_scaling` pair."""

    theta: float = 10000.0
    kind: str = "default"
    params: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts feed-forward: `experts_per_token` of `num_experts`
    routed experts per token, plus an always-on shared expert when
    `shared_intermediate_size` is set; `dense_layers` keep a plain MLP."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool = False
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.experts_per_token > self.num_experts:
            raise ConfigError(
                f"config.json routes each token to {self.experts_per_token} experts but has only "
                f"{self.num_experts}; fix num_experts_per_tok"
            )

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A Gated DeltaNet's sizes: `key_heads` query/key heads of `key_dim`, `value_heads` value
    heads of `value_dim` (a multiple of the key heads, each key head serving consecutive value
    heads), and the width of the causal convolution in front of it."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ConfigError(
                f"config.json's linear_num_value_heads ({self.value_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.key_heads}); fix the file"
            )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False  # one qkv_proj (Phi-3) instead of q/k/v_proj
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3), gate rows first
    moe: MoEConfig | None = None
    linear: LinearAttentionConfig | None = None  # the Gated DeltaNet of `linear_attention` layers
    conv_kernel: int = 0  # the short convolution of `conv` layers (LFM2): its width
    conv_channels: int = 0  # and its channels, when fewer than hidden_size (a tensor-sharded rank's)
    conv_bias: bool = False
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: o * sigmoid(gate) (Qwen3-Next)
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    layer_ropes: dict[str, RopeConfig] = field(default_factory=dict)
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    sandwich_norms: bool = False
    attn_softcap: float | None = None
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    final_softcap: float | None = None
    nope_layers: frozenset[int] = frozenset()  # layers whose attention has no RoPE (SmolLM3's NoPE layers)
    quantization: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def window(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_of(self, layer: int) -> RopeConfig:
        """RoPE settings of `layer`: its layer type's own when the config gives
        one (Gemma 3's local base for sliding layers), else the model's."""
        return self.layer_ropes.get(self.layer_types[layer], self.rope)

    @property
    def recurrent_kinds(self) -> tuple[str, ...]:
        """The recurrent layer types this model has weights for."""
        return ((LINEAR,) if self.linear else ()) + ((CONV,) if self.conv_kernel else ())

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)


def _require(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"config.json has no '{key}'; the checkpoint's config is incomplete")
    return d[key]


# --- what each key may hold ---------------------------------------------------------------------
# config.json is untrusted input: a wrong type or an impossible value must be one ConfigError
# naming the key, not a TypeError or a giant allocation deep inside model building. Every key a
# family reads is described here once and checked before any family looks at the dict.

INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Field:
    """The JSON type one key must have, its allowed range (`low` excluded when `strict`),
    and whether null is allowed (families read null as "absent")."""

    kind: type
    low: float | None = None
    high: float | None = None
    strict: bool = False
    item: type | None = None  # element type of a list
    nullable: bool = True

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.item is not None:
            return isinstance(value, list) and all(_is(v, self.item) and self._in_range(v) for v in value)
        return _is(value, self.kind) and self._in_range(value)

    def _in_range(self, value: Any) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return True
        above = self.low is None or value > self.low or (value == self.low and not self.strict)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        text = f"a list of {_PLURAL[self.item]}" if self.item is not None else _SINGULAR[self.kind]
        if self.low is not None and self.high is not None and self.high < INT_MAX:
            text += f" from {self.low:g} to {self.high:.0f}"
        elif self.low is not None:
            text += f" {'>' if self.strict else '>='} {self.low:g}"
        return text + (" or null" if self.nullable else "")


_SINGULAR = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
_PLURAL = {int: "integers", float: "numbers", str: "strings"}


def _is(value: Any, kind: type) -> bool:
    """JSON's types as Python reads them: true is not an integer, an integer is a number."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, int)
    if kind is float:
        try:
            return isinstance(value, (int, float)) and math.isfinite(value)
        except OverflowError:  # an integer beyond any float
            return False
    return isinstance(value, kind)


COUNT = Field(int, 1, INT_MAX, nullable=False)  # sizes every model has
# Widths: real models stay below 2**15; the bound keeps RoPE's per-dimension tables small.
DIM_MAX = 2**20
WIDTH = Field(int, 1, DIM_MAX, nullable=False)
SIZE = Field(int, 1, INT_MAX)
AT_LEAST_0 = Field(int, 0, INT_MAX)
POSITIVE = Field(float, 0, strict=True)
# Keys families read as `d.get(key, default)`, where a null would pass through as the value.
SIZE_SET = Field(int, 1, INT_MAX, nullable=False)
AT_LEAST_0_SET = Field(int, 0, INT_MAX, nullable=False)
POSITIVE_SET = Field(float, 0, strict=True, nullable=False)
NUMBER_SET = Field(float, nullable=False)
NUMBER = Field(float)
FLAG = Field(bool)
NAME = Field(str)

CONFIG_FIELDS: dict[str, Field] = {
    "model_type": Field(str, nullable=False),
    "vocab_size": COUNT,
    "hidden_size": WIDTH,
    "intermediate_size": COUNT,
    "num_hidden_layers": Field(int, 1, 1024, nullable=False),  # real models have < 200; bounds the layer list
    "num_attention_heads": COUNT,
    "num_key_value_heads": SIZE,
    "head_dim": Field(int, 1, DIM_MAX),
    "max_position_embeddings": COUNT,
    "rms_norm_eps": POSITIVE_SET,  # MLX refuses an RMSNorm eps of 0
    "rope_theta": POSITIVE_SET,
    "rope_local_base_freq": POSITIVE_SET,
    "partial_rotary_factor": Field(float, 0, 1, strict=True, nullable=False),
    "tie_word_embeddings": Field(bool, nullable=False),
    "attention_bias": FLAG,
    "mlp_bias": FLAG,
    "hidden_act": Field(str, nullable=False),
    "hidden_activation": Field(str, nullable=False),
    "layer_types": Field(list, item=str),
    "sliding_window": AT_LEAST_0,
    "use_sliding_window": FLAG,
    "max_window_layers": AT_LEAST_0_SET,
    "sliding_window_pattern": SIZE_SET,
    "original_max_position_embeddings": SIZE,
    "query_pre_attn_scalar": POSITIVE,
    "attn_logit_softcapping": POSITIVE,
    "final_logit_softcapping": POSITIVE,
    "rope_scaling": Field(dict),
    "rope_parameters": Field(dict),
    "quantization": Field(dict),
    "quantization_config": Field(dict),
    "text_config": Field(dict),
    # mixtures of experts
    "num_experts": SIZE,
    "num_local_experts": SIZE,
    "num_experts_per_tok": SIZE,
    "moe_intermediate_size": SIZE_SET,
    "shared_expert_intermediate_size": AT_LEAST_0,
    "decoder_sparse_step": AT_LEAST_0,
    "mlp_only_layers": Field(list, 0, item=int),
    "norm_topk_prob": FLAG,
    # DeepSeek latent attention and routing
    "kv_lora_rank": WIDTH,
    "q_lora_rank": Field(int, 1, DIM_MAX),
    "qk_nope_head_dim": WIDTH,
    "qk_rope_head_dim": WIDTH,
    "v_head_dim": WIDTH,
    "n_routed_experts": AT_LEAST_0,
    "n_shared_experts": AT_LEAST_0,
    "n_group": SIZE,
    "topk_group": SIZE,
    "topk_method": NAME,
    "routed_scaling_factor": NUMBER_SET,
    "first_k_dense_replace": AT_LEAST_0_SET,
    "moe_layer_freq": SIZE_SET,
    "rope_interleave": FLAG,
    # hybrid models: Gated DeltaNet (Qwen3-Next, Qwen3.5) and short convolutions (LFM2)
    "linear_conv_kernel_dim": Field(int, 1, 64, nullable=False),
    "linear_key_head_dim": WIDTH,
    "linear_value_head_dim": WIDTH,
    "linear_num_key_heads": Field(int, 1, INT_MAX, nullable=False),
    "linear_num_value_heads": Field(int, 1, INT_MAX, nullable=False),
    "full_attention_interval": SIZE_SET,
    "conv_L_cache": Field(int, 1, 64, nullable=False),
    "conv_bias": FLAG,
    "full_attn_idxs": Field(list, 0, item=int),
    "block_ff_dim": SIZE_SET,
    "block_multiple_of": SIZE_SET,
    "block_ffn_dim_multiplier": POSITIVE,
    "block_auto_adjust_ff_dim": FLAG,
    "norm_eps": POSITIVE_SET,
    "short_conv_channels": WIDTH,  # a tensor-sharded rank's share of the channels (`shard.shard_config`)
    "num_nextn_predict_layers": AT_LEAST_0,
    # SmolLM3's layers without RoPE; GLM-4.5's optional q/k norm
    "no_rope_layers": Field(list, 0, 1, item=int),
    "no_rope_layer_interval": SIZE_SET,
    "use_qk_norm": FLAG,
    # gpt-oss
    "swiglu_alpha": NUMBER_SET,
    "swiglu_limit": POSITIVE_SET,
    # vision-language models: the image placeholder and the vision tower's own config
    "image_token_id": Field(int, 0, INT_MAX),
    "vision_config": Field(dict),
}

# A vision tower's config.json `vision_config` (Qwen-VL; Hugging Face and older hub names).
VISION_FIELDS: dict[str, Field] = {
    "depth": Field(int, 1, 1024, nullable=False),
    "hidden_size": WIDTH,
    "intermediate_size": COUNT,
    "num_heads": COUNT,
    "in_channels": SIZE_SET,
    "in_chans": SIZE_SET,
    "patch_size": Field(int, 1, 1024, nullable=False),
    "temporal_patch_size": Field(int, 1, 64, nullable=False),
    "spatial_merge_size": Field(int, 1, 64, nullable=False),
    "window_size": SIZE_SET,
    "out_hidden_size": WIDTH,
    "fullatt_block_indexes": Field(list, 0, item=int),
    "deepstack_visual_indexes": Field(list, 0, item=int),
    "num_position_embeddings": SIZE_SET,
    "embed_dim": WIDTH,  # Qwen2-VL: the tower's width (its hidden_size is the language model's)
    "mlp_ratio": POSITIVE,
    "spatial_patch_size": Field(int, 1, 1024, nullable=False),
    "hidden_act": Field(str, nullable=False),
    "rope_parameters": Field(dict),
}

ROPE_FIELDS: dict[str, Field] = {
    "rope_theta": POSITIVE_SET,
    "rope_type": NAME,
    "type": NAME,
    "factor": POSITIVE,
    "original_max_position_embeddings": SIZE,
    "low_freq_factor": NUMBER_SET,
    "high_freq_factor": NUMBER_SET,
    "beta_fast": POSITIVE,
    "beta_slow": POSITIVE,
    "mscale": NUMBER,
    "mscale_all_dim": NUMBER,
    "attention_factor": POSITIVE,
    "short_factor": Field(list, 0, strict=True, item=float),
    "long_factor": Field(list, 0, strict=True, item=float),
    "partial_rotary_factor": Field(float, 0, 1, strict=True, nullable=False),
    "truncate": FLAG,
    "mrope_section": Field(list, 0, item=int),  # M-RoPE's frequencies per position axis (Qwen-VL)
    "mrope_interleaved": FLAG,
}

QUANT_FIELDS: dict[str, Field] = {
    "bits": Field(int, 1, 8),
    "group_size": Field(int, 1, INT_MAX),
    "mode": NAME,
}

# What each RoPE scaling kind cannot do without (longrope: phi3.py, which also takes the top-level keys).
ROPE_NEEDS = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "original_max_position_embeddings")}


def _check_fields(d: dict[str, Any], fields: dict[str, Field], where: str) -> None:
    for key, spec in fields.items():
        if key in d and not spec.accepts(d[key]):
            shown = repr(d[key])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise ConfigError(f"{where}: '{key}' must be {spec.describe()}, got {shown}; fix the file")


def _check_rope(params: dict[str, Any], where: str) -> None:
    """A RoPE dict, or transformers 5's per-layer-type dict of them."""
    for kind in (FULL, SLIDING):
        if kind in params:
            _check_fields(params, {kind: Field(dict)}, where)
            _check_rope(params[kind] or {}, f"{where}[{kind}]")
    _check_fields(params, ROPE_FIELDS, where)


def _check_quantization(q: dict[str, Any], where: str) -> None:
    """mlx-lm's `quantization`: defaults, then per-layer overrides (an object, or false for "not quantized")."""
    _check_fields(q, QUANT_FIELDS, where)
    for key, value in q.items():
        if key in QUANT_FIELDS:
            continue
        if isinstance(value, dict):
            _check_fields(value, QUANT_FIELDS, f"{where}[{key}]")
        elif not isinstance(value, bool):
            raise ConfigError(f"{where}: layer '{key}' must be an object or true/false, got {value!r:.40}")


def check_config(d: Any, source: str = "config.json") -> dict[str, Any]:
    """`d` if it is a config.json object whose known keys all hold values of their type and
    range; otherwise a ConfigError naming `source` and the key. Cross-key rules (divisibility,
    layer counts) are checked where the config is parsed (`parse_config`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source} must hold a JSON object, not {type(d).__name__}; fix or re-download it")
    _check_fields(d, CONFIG_FIELDS, source)
    for key in ("rope_scaling", "rope_parameters"):
        if d.get(key):
            _check_rope(d[key], f"{source} {key}")
    if d.get("quantization"):
        _check_quantization(d["quantization"], f"{source} quantization")
    if d.get("text_config"):
        check_config({"model_type": "text", **d["text_config"]}, f"{source} text_config")
    if d.get("vision_config"):
        _check_fields(d["vision_config"], VISION_FIELDS, f"{source} vision_config")
        rope = d["vision_config"].get("rope_parameters")
        if rope:
            _check_fields(rope, ROPE_FIELDS, f"{source} vision_config rope_parameters")
    return d


def parse_rope(d: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either config convention into one shape."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    factor = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    missing = [k for k in ROPE_NEEDS.get(kind, ()) if params.get(k) is None]
    if missing:
        raise ConfigError(f"config.json's {kind} rope scaling has no '{missing[0]}'; the config is incomplete")
    return RopeConfig(float(theta), kind, params, float(factor))


def parse_layer_ropes(d: dict[str, Any]) -> tuple[RopeConfig, dict[str, RopeConfig]]:
    """The model's RoPE and per-layer-type ones: transformers 5 keys `rope_parameters`
    by layer type when they differ (Gemma 3); the full-attention entry is the model's."""
    params = d.get("rope_parameters") or {}
    by_type = {t: p for t, p in params.items() if t in (FULL, SLIDING)}
    if not by_type:
        return parse_rope(d), {}
    ropes = {t: parse_rope({**d, "rope_parameters": p}) for t, p in by_type.items()}
    return ropes.get(FULL, parse_rope({**d, "rope_parameters": None})), ropes


def parse_config(d: dict[str, Any], **family: Any) -> ModelConfig:
    """Build a ModelConfig from a checked config.json (`check_config`); `family` overrides per-family fields."""
    heads = _require(d, "num_attention_heads")
    hidden = _require(d, "hidden_size")
    layers = _require(d, "num_hidden_layers")
    if not d.get("head_dim") and hidden % heads:
        raise ConfigError(
            f"config.json's hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
            "and there is no head_dim; fix the file"
        )
    window = d.get("sliding_window")
    layer_types = tuple(d.get("layer_types") or (FULL,) * layers)
    if len(layer_types) != layers:
        raise ConfigError(f"config.json lists {len(layer_types)} layer_types for {layers} layers")
    rope, layer_ropes = parse_layer_ropes(d)
    cfg = ModelConfig(
        model_type=d.get("model_type", ""),
        vocab_size=_require(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require(d, "intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope=rope,
        layer_ropes=layer_ropes,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        hidden_act=d.get("hidden_act", "silu"),
        layer_types=layer_types,
        sliding_window=window,
        quantization=d.get("quantization"),
        raw=d,
    )
    cfg = replace(cfg, **family)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    unknown = sorted(set(cfg.layer_types) - {FULL, SLIDING, *cfg.recurrent_kinds})
    if unknown:
        raise ConfigError(f"config.json has layer type '{unknown[0]}', which {cfg.model_type} does not have; "
                          "fix layer_types")
    if SLIDING in cfg.layer_types and not cfg.sliding_window:
        raise ConfigError("config.json has sliding-attention layers but no sliding_window size")
    if cfg.rotary_dims < 2 or cfg.rotary_dims % 2:
        raise ConfigError(
            f"config.json gives {cfg.rotary_dims} rotary dimensions (head_dim {cfg.head_dim} x "
            f"partial_rotary_factor {cfg.rope.partial_rotary_factor}); RoPE needs a positive even number"
        )
    return cfg
