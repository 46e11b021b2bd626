"""mlxinfer: on-device LLM inference on Apple Silicon, built on MLX."""

from .base import blas

blas.preload()  # before anything imports mlx.core: a BLAS chosen later would not be used

from .loading.model import load, load_tokenizer
from .loading.adapters import load_adapter, unload_adapter
from .engine.batch import BatchGenerator
from .engine.generate import batch_generate, generate, stream_generate
from .models.cache import make_cache
from .models.prompt_cache import PromptCache
from .engine.prompt_file import load_prompt_cache, save_prompt_cache
from .engine.chat import ChatSession
from .engine.embed import embed
from .base.errors import MlxinferError
from .decode.sources import Stats
from .engine.text_stream import Chunk
from .engine.pool import PromptCachePool
from .decode.sample import SamplingConfig

__version__ = "0.1.0"
__all__ = [
    "BatchGenerator",
    "ChatSession",
    "Chunk",
    "MlxinferError",
    "PromptCache",
    "PromptCachePool",
    "SamplingConfig",
    "Stats",
    "__version__",
    "batch_generate",
    "embed",
    "generate",
    "load",
    "load_adapter",
    "load_prompt_cache",
    "load_tokenizer",
    "make_cache",
    "save_prompt_cache",
    "stream_generate",
    "unload_adapter",
]
