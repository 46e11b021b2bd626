"""Where and within what a generation runs: its own MLX stream per thread, the model's memory wired on
Metal, and the context a prompt and its reply must fit."""

from __future__ import annotations

import contextlib
import threading
import warnings

import mlx.core as mx
from mlx.utils import tree_flatten

from ..models.prompt_cache import PromptCache
from ..base.errors import InvalidOptionError


def check_context(model, cache: PromptCache, n_prompt: int) -> None:
    """Refuse a prompt the model cannot continue: it has no LM head, or the prompt is longer than its context."""
    model.require_head()
    limit = model.config.max_position_embeddings
    if n_prompt > limit and not cache.bounded:
        raise InvalidOptionError(
            f"the prompt has {n_prompt} tokens but the model's context is {limit}; "
            "shorten it or pass --max-kv-size to use a rotating cache"
        )


@contextlib.contextmanager
def wired_limit(model):
    """On Metal, wire the model's memory so macOS does not page it out mid-generation."""
    if not mx.metal.is_available():
        yield
        return
    model_bytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    info = mx.device_info()
    recommended = info.get("max_recommended_working_set_size", 0)
    if recommended and model_bytes > 0.9 * recommended:
        warnings.warn(
            f"the model needs {model_bytes / 2**30:.1f} GiB, close to the {recommended / 2**30:.1f} GiB this Mac "
            "recommends for the GPU; generation may be slow. Try a smaller or more quantized model."
        )
    previous = mx.set_wired_limit(recommended) if recommended else None
    try:
        yield
    finally:
        if previous is not None:
            mx.synchronize()
            mx.set_wired_limit(previous)


_thread_streams = threading.local()


def generation_stream() -> mx.Stream:
    """A stream of our own, so generation is not queued behind other work on the default one.
    One per thread: an MLX stream belongs to the thread that made it, and another thread using it
    fails ("There is no Stream(cpu, 1) in current thread"), e.g. a server's engine thread after
    generating on the main one."""
    stream = getattr(_thread_streams, "stream", None)
    if stream is None:
        stream = _thread_streams.stream = mx.new_stream(mx.default_device())
    return stream


def context_limit(model, cache: PromptCache, n_prompt: int, max_tokens: int) -> int:
    """max_tokens, capped by the context a non-rotating cache can hold."""
    if cache.bounded:
        return max_tokens
    return min(max_tokens, model.config.max_position_embeddings - n_prompt)
