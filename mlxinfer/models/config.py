"""Model configuration: one dataclass read from a Hugging Face `config.json`.

Family modules pass the few fields they define differently (biases, q/k norm,
which layers slide); everything else is read here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"


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

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


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
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    layer_ropes: dict[str, RopeConfig] = field(default_factory=dict)
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    sandwich_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
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
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)


def _require(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ConfigError(f"config.json has no '{key}'; the checkpoint's config is incomplete")
    return d[key]


def parse_rope(d: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either config convention into one shape."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    factor = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
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
    """Build a ModelConfig from config.json; `family` overrides per-family fields."""
    heads = _require(d, "num_attention_heads")
    hidden = _require(d, "hidden_size")
    layers = _require(d, "num_hidden_layers")
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
    if SLIDING in cfg.layer_types and not cfg.sliding_window:
        raise ConfigError("config.json has sliding-attention layers but no sliding_window size")
    return cfg
