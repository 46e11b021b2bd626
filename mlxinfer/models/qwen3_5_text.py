"""Qwen3.5 (text): Qwen3-Next's hybrid of Gated DeltaNet and gated attention, with separate
q/k/v, z, b and a projections and a dense MLP in every layer."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .config import ModelConfig
from .hybrid import HybridLM
from .qwen3_next import hybrid_config, mlx_lm_layout

__all__ = ["Model", "config"]


def config(d: dict[str, Any]) -> ModelConfig:
    return hybrid_config(d)


class Model(HybridLM):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(mlx_lm_layout(weights))
