"""The model: families (looked up by config.json's `model_type`) written as differences on shared
layers, each new layer kind in one module; the caches they read back (`cache`), a sequence's caches
and the one place that runs a model over tokens (`prompt_cache`), and how weights split across the
ranks of a sharded model (`shard`)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..base.errors import UnsupportedArchitectureError
from .config import ModelConfig, check_config
from .layers import CausalLM

FAMILIES: dict[str, str] = {
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3_text",
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
    "lfm2": "lfm2",
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "olmo2": "olmo2",
    "olmo3": "olmo3",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2_moe",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_vl": "qwen2_vl",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_vl": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_next": "qwen3_next",
    "smollm3": "smollm3",
}


def family(model_type: str) -> ModuleType:
    """The family module for `model_type`, or a clear error listing what we support."""
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(FAMILIES))} (docs/models.md)"
        )
    return importlib.import_module(f"{__name__}.{FAMILIES[model_type]}")


def model_config(config: dict[str, Any]) -> ModelConfig:
    """The typed config of a config.json dict, checked key by key before any family reads it."""
    check_config(config)
    return family(config.get("model_type", "<missing>")).config(config)


def canonical_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the sizes a family derives from other keys written out (LFM2's MLP
    width), so a rank's config (`shard.shard_config`) can divide them."""
    if config.get("model_type") not in FAMILIES:
        return config  # refused with its reason where the model is built
    module = family(config["model_type"])
    return module.canonical(config) if hasattr(module, "canonical") else config


def build_model(config: dict[str, Any]) -> CausalLM:
    """An uninitialised model for a config.json dict."""
    return family(config.get("model_type", "<missing>")).Model(model_config(config))


def supported() -> dict[str, str]:
    """Each supported model_type with what it covers (its family module's opening words)."""
    return {t: family(t).__doc__.split(":")[0].split("\n")[0].rstrip(".") for t in sorted(FAMILIES)}
