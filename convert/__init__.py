"""Convert Hugging Face, MLX and GGUF checkpoints into (optionally quantized) MLX folders
that mlxinfer and mlx-lm both load. CLI: `mlxinfer convert`."""

import mlxinfer  # noqa: F401  (first: it chooses MLX's BLAS before mlx.core loads)

from .api import convert
from .quantize import BITS, GROUP_SIZES, RECIPES, QuantSpec, Recipe
from .report import Report

__all__ = ["BITS", "GROUP_SIZES", "RECIPES", "QuantSpec", "Recipe", "Report", "convert"]
