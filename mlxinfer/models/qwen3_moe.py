"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm) with Qwen's sparse MoE feed-forward, no shared expert."""

from dataclasses import replace
from typing import Any

from .config import ModelConfig
from .moe import MoECausalLM as Model
from .qwen2_moe import moe_config
from .qwen3 import config as qwen3_config

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    return replace(qwen3_config(d), moe=moe_config(d))
