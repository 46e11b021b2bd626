"""mlxinfer: on-device LLM inference on Apple Silicon, built on MLX."""

from .cache import make_cache
from .errors import MlxinferError
from .loading import load, load_tokenizer

__version__ = "0.1.0"
__all__ = ["MlxinferError", "load", "load_tokenizer", "make_cache", "__version__"]
