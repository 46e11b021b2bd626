"""SigLIP's vision encoder (Gemma 3's vision tower): an image cut into square patches, each
projected to the model width plus a learned position embedding, then pre-norm ViT layers
(LayerNorm, full attention over every patch, a GELU MLP) and a final LayerNorm.

The patch convolution is a linear layer over flattened patches: its stride equals its
kernel, so each output is one patch times the kernel, the same product as one matmul (MLX's
CPU convolution is slower and its weight layout differs from the checkpoint's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import ConfigError, InvalidOptionError
from .config import COUNT, WIDTH, Field, POSITIVE_SET, _check_fields

ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}

FIELDS: dict[str, Field] = {
    "hidden_size": WIDTH,
    "intermediate_size": COUNT,
    "num_hidden_layers": Field(int, 1, 1024, nullable=False),
    "num_attention_heads": COUNT,
    "num_channels": Field(int, 1, 16, nullable=False),
    "image_size": Field(int, 1, 2**14, nullable=False),
    "patch_size": Field(int, 1, 2**10, nullable=False),
    "layer_norm_eps": POSITIVE_SET,
    "hidden_act": Field(str, nullable=False),
}


@dataclass(frozen=True)
class VisionConfig:
    """A checkpoint's `vision_config` (transformers' SiglipVisionConfig, its defaults where a key is absent)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def parse(cls, d: dict[str, Any]) -> VisionConfig:
        _check_fields(d, FIELDS, "config.json vision_config")
        cfg = cls(**{k: d[k] for k in FIELDS if k in d})
        if cfg.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"vision_config's hidden_act '{cfg.hidden_act}' is not supported; "
                              f"supported: {', '.join(ACTIVATIONS)}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"vision_config's hidden_size ({cfg.hidden_size}) is not divisible by "
                              f"num_attention_heads ({cfg.num_attention_heads}); fix the file")
        if cfg.image_size % cfg.patch_size:
            raise ConfigError(f"vision_config's image_size ({cfg.image_size}) is not a multiple of "
                              f"patch_size ({cfg.patch_size}); fix the file")
        return cfg

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size**2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, cfg.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        """[N, C, H, W] pixels -> [N, patches, hidden], patches in row-major order as the convolution gives them."""
        n, c, size, p = pixels.shape[0], self.cfg.num_channels, self.cfg.image_size, self.cfg.patch_size
        if tuple(pixels.shape[1:]) != (c, size, size):
            raise InvalidOptionError(f"the vision encoder takes {c}x{size}x{size} pixel values, got "
                                     f"{'x'.join(map(str, pixels.shape[1:]))}; preprocess with the checkpoint's "
                                     "image processor")
        g = size // p
        patches = pixels.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
        return self.patch_embedding(patches) + self.position_embedding(mx.arange(g * g))  # quantized or not


class SelfAttention(nn.Module):
    """Every patch attends to every patch of its image."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)
        self.scale = (h // self.heads) ** -0.5

    def __call__(self, x: mx.array) -> mx.array:
        n, t, h = x.shape
        q, k, v = (p(x).reshape(n, t, self.heads, -1).transpose(0, 2, 1, 3) for p in (self.q_proj, self.k_proj,
                                                                                   self.v_proj))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(o.transpose(0, 2, 1, 3).reshape(n, t, h))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class VisionModel(nn.Module):
    """Pixels [N, C, H, W] -> patch features [N, patches, hidden] (the last hidden state; no pooling head).
    Module names are the checkpoint's under `vision_tower.` (`sanitize` maps the other layouts there)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], cfg: VisionConfig, prefix: str) -> dict[str, mx.array]:
        """The tower's tensors under `prefix` as this module names them: the `vision_model.` level older
        checkpoints have dropped, the pooling head (unused) dropped, and the patch convolution's kernel
        ([out, C, p, p] as transformers stores it, [out, p, p, C] as MLX converters do) flattened to the
        linear layer's [out, C*p*p]."""
        out = {}
        for name, w in weights.items():
            if not name.startswith(prefix):
                out[name] = w
                continue
            rest = name[len(prefix):].removeprefix("vision_model.")
            if rest.startswith("head."):
                continue
            if rest == "embeddings.patch_embedding.weight" and w.ndim == 4:
                if w.shape[-1] == cfg.num_channels and w.shape[1] != cfg.num_channels:
                    w = w.transpose(0, 3, 1, 2)
                w = w.reshape(w.shape[0], -1)
            out[prefix + rest] = w
        return out
