"""The generation loop: prompt → chunked prefill → pipelined decode → streamed text."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from dataclasses import dataclass, fields
from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from .cache import KV_BITS, KV_GROUP_SIZES, PromptCache
from .checks import flag, integer, is_integer, token_ids
from .errors import InvalidOptionError
from .sample import Sampler, SamplingConfig
from .tokenizer import Tokenizer

Prompt = str | Sequence[int] | Sequence[dict]


@dataclass
class Stats:
    """Numbers for one generation; updated as it runs."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    ttft: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    peak_memory: int = 0
    cache_bytes: int = 0
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    plain_tps: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target accepted (speculative decoding)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verification round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def speedup(self) -> float:
        """decode_tps over the plain decoding rate measured during this same
        generation (speculative decoding times both); 0 when not measured."""
        return self.decode_tps / self.plain_tps if self.plain_tps else 0.0


@dataclass
class Chunk:
    text: str
    token: int | None
    logprob: float | None
    finish_reason: str | None
    stats: Stats
    top_logprobs: list[tuple[int, float]] | None = None
    drafted: bool = False


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    prefill_step: int = 512
    logprobs: int = 0
    draft_model: Any = None
    draft_cache: PromptCache | None = None
    num_draft_tokens: int | None = None  # most tokens per draft; default 8 for prompt lookup, 4 for a draft model
    prompt_lookup: bool = False

    def __post_init__(self) -> None:
        """Types and ranges, so a bad value fails before any work and not inside MLX."""
        integer("max_tokens", self.max_tokens, 0)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidOptionError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        flag("ignore_eos", self.ignore_eos)
        if self.max_kv_size is not None:
            integer("max_kv_size", self.max_kv_size, 2)
        if self.kv_bits is not None and (not is_integer(self.kv_bits) or self.kv_bits not in KV_BITS):
            raise InvalidOptionError(f"kv_bits must be one of {KV_BITS}, got {self.kv_bits!r}")
        if self.kv_group_size is not None and (not is_integer(self.kv_group_size)
                                               or self.kv_group_size not in KV_GROUP_SIZES):
            raise InvalidOptionError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {self.kv_group_size!r}")
        integer("prefill_step", self.prefill_step, 1)
        integer("logprobs", self.logprobs, 0)
        if self.draft_cache is not None and not isinstance(self.draft_cache, PromptCache):
            raise InvalidOptionError(f"draft_cache must be a PromptCache, got {type(self.draft_cache).__name__}")
        if self.num_draft_tokens is not None:
            integer("num_draft_tokens", self.num_draft_tokens, 1)
        flag("prompt_lookup", self.prompt_lookup)
        if self.draft_model is not None and self.prompt_lookup:
            raise InvalidOptionError("choose one drafter: a draft model or prompt lookup, not both")


def split_options(options: dict[str, Any], vocab_size: int | None = None) -> tuple[SamplingConfig, GenerationOptions]:
    """Route keyword options to the sampling and generation configs, validated (token ids
    against `vocab_size`, the model's, when it is known); reject unknown ones."""
    sampling = {f.name for f in fields(SamplingConfig)}
    generation = {f.name for f in fields(GenerationOptions)}
    unknown = sorted(set(options) - sampling - generation)
    if unknown:
        raise InvalidOptionError(f"unknown option '{unknown[0]}'; valid: {', '.join(sorted(sampling | generation))}")
    gen = {k: v for k, v in options.items() if k in generation}
    stop = gen.get("stop") or ()
    gen["stop"] = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else stop
    config = SamplingConfig(**{k: v for k, v in options.items() if k in sampling})
    if vocab_size is not None:
        config.check_vocab(vocab_size)
    return config, GenerationOptions(**gen)


def prompt_tokens(tokenizer: Tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """A string, token ids, or chat messages (rendered with the chat template), as ids
    checked against the model's `vocab_size` (a tokenizer may know more tokens than
    the model has embedding rows)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    else:
        ids = prompt
    ids = token_ids(ids, vocab_size, "the prompt")
    if not ids:
        raise InvalidOptionError("the prompt is empty; give some text, token ids or chat messages")
    return ids


def check_context(model, cache: PromptCache, n_prompt: int) -> None:
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


@functools.cache
def _generation_stream() -> mx.Stream:
    """A stream of our own, so generation is not queued behind other work on the default one."""
    return mx.new_stream(mx.default_device())


class StopMatcher:
    """Holds back text that might be the start of a stop string, so neither a
    stop string nor a prefix of one that turns out to be one is ever emitted."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class _Step:
    """One decode step's lazily computed outputs."""

    token: mx.array
    logprobs: mx.array
    logprob: mx.array


class Generator:
    """Owns one generation: the cache, sampler and stats."""

    def __init__(self, model, tokenizer: Tokenizer, prompt: Prompt, prompt_cache: PromptCache | None, options):
        self.model, self.tokenizer = model, tokenizer
        self.sampling, self.options = split_options(options, model.config.vocab_size)
        self.prompt = prompt_tokens(tokenizer, prompt, model.config.vocab_size)
        o = self.options
        self.cache = prompt_cache or PromptCache.for_model(
            model, max_kv_size=o.max_kv_size, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size
        )
        self.cache.check_fits(model)
        check_context(model, self.cache, len(self.prompt))
        self.sampler = Sampler(self.sampling)
        self.stats = Stats(prompt_tokens=len(self.prompt))

    def forward(self, tokens: Sequence[int] | mx.array) -> mx.array:
        """Run tokens through the model and the cache; last position's logits."""
        x = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens))
        logits = self.model(x[None], cache=self.cache.caches)
        return logits[:, -1, :]

    def prefill_body(self, tokens: list[int]) -> None:
        """Prompt tokens in bounded chunks; only cache state is evaluated, so the
        LM head never runs on them."""
        step = self.options.prefill_step
        for i in range(0, len(tokens), step):
            chunk = tokens[i : i + step]
            self.forward(chunk)
            self.cache.feed(chunk)
            mx.eval([c.keys for c in self.cache.caches])

    def sample(self, logits: mx.array) -> _Step:
        history = None
        if self.sampling.penalised:
            history = self.history[None]
        token = self.sampler(logits, history)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, token[:, None], axis=-1)[0, 0]
        if self.sampling.penalised:
            self.history = mx.concatenate([self.history, token])[-self.sampling.penalty_window :]
        return _Step(token, logprobs, chosen)

    def top_logprobs(self, logprobs: mx.array) -> list[tuple[int, float]] | None:
        k = self.options.logprobs
        if not k:
            return None
        row = logprobs.reshape(-1)
        best = mx.argsort(-row)[:k]
        return list(zip(best.tolist(), row[best].tolist()))

    @functools.cached_property
    def limit(self) -> int:
        """max_tokens, capped by the context a non-rotating cache can hold (read per token, computed once)."""
        if self.cache.bounded:
            return self.options.max_tokens
        return min(self.options.max_tokens, self.model.config.max_position_embeddings - len(self.prompt))

    def begin(self) -> list[int]:
        """Start the clock; the prompt tokens the cache still needs."""
        o = self.options
        self.detok = self.tokenizer.detokenizer()
        self.stop = StopMatcher(o.stop)
        self.eos = set() if o.ignore_eos else set(self.tokenizer.eos_token_ids)
        self.generated: list[int] = []
        mx.reset_peak_memory()
        self.start = time.perf_counter()
        todo = self.cache.prepare(self.prompt)
        self.stats.prefill_tokens = len(todo)
        return todo

    def emit(self, token: int, logprob: float, logprobs: mx.array, drafted: bool = False) -> Chunk:
        """One generated token → a chunk: streamed text, stop strings, EOS, limits, stats."""
        stats = self.stats
        self.generated.append(token)
        n = len(self.generated)
        if n == 1:
            self.first_token_at = time.perf_counter()
            stats.ttft = self.first_token_at - self.start
            stats.prefill_tps = stats.prefill_tokens / stats.ttft
        else:
            stats.decode_tps = (n - 1) / max(time.perf_counter() - self.first_token_at, 1e-9)
        stopped_by_eos = token in self.eos
        text, hit = ("", False) if stopped_by_eos else self.stop.push(self.detok.add(token))
        finish = "stop" if (stopped_by_eos or hit) else ("length" if n >= self.limit else None)
        if finish and not hit:
            text += self.stop.push(self.detok.finalize())[0] + self.stop.flush()
        stats.generated_tokens = n
        stats.finish_reason = finish
        if finish:
            stats.cache_bytes = self.cache.nbytes
            stats.peak_memory = mx.get_peak_memory()
        return Chunk(text, token, logprob, finish, stats, self.top_logprobs(logprobs), drafted)

    def emit_nothing(self) -> Chunk:
        """The only chunk when no token may be generated (max_tokens=0 or a full context)."""
        self.stats.finish_reason = "length"
        return Chunk("", None, None, "length", self.stats)

    def plain_tokens(self, count: int) -> Iterator[Chunk]:
        """Up to `count` tokens decoded one at a time, pipelined as mlx-lm does:
        the next step's graph is queued before the current token is read, so the
        device never waits on Python. The cache holds the context but its last
        token before and after."""
        context = self.prompt + self.generated
        self.history = mx.array(context[-self.sampling.penalty_window :])
        step = self.sample(self.forward(context[-1:]))
        self.cache.feed(context[-1:])
        mx.async_eval(step.token, step.logprob)
        for i in range(count):
            nxt = None
            if i + 1 < count and len(self.generated) + 1 < self.limit:
                nxt = self.sample(self.forward(step.token))
                mx.async_eval(nxt.token, nxt.logprob)
            token = int(step.token.item())
            if nxt is not None:
                self.cache.feed([token])
            chunk = self.emit(token, step.logprob.item(), step.logprobs)
            yield chunk
            if chunk.finish_reason or nxt is None:
                return
            step = nxt

    def run(self) -> Iterator[Chunk]:
        todo = self.begin()
        if self.limit <= 0:
            yield self.emit_nothing()
            return
        self.prefill_body(todo[:-1])
        yield from self.plain_tokens(self.limit)


def stream_generate(
    model, tokenizer: Tokenizer, prompt: Prompt, prompt_cache: PromptCache | None = None, **options: Any
) -> Iterator[Chunk]:
    """Stream a completion chunk by chunk (one chunk per generated token).

    Options: max_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, penalty_window, logit_bias, seed, stop,
    ignore_eos, max_kv_size, kv_bits, kv_group_size, prefill_step, logprobs, and
    for speculative decoding draft_model, draft_cache (the draft's PromptCache, to
    reuse across calls), num_draft_tokens, prompt_lookup.
    Pass a `PromptCache` to reuse the longest common prefix across calls.
    """
    gen = Generator(model, tokenizer, prompt, prompt_cache, options)
    with wired_limit(model), mx.stream(_generation_stream()):
        if gen.options.draft_model is not None or gen.options.prompt_lookup:
            from .speculative import speculative_run

            yield from speculative_run(gen)
        else:
            yield from gen.run()


def generate(model, tokenizer: Tokenizer, prompt: Prompt, **options: Any) -> str:
    """The whole completion as one string (same options as `stream_generate`)."""
    return "".join(chunk.text for chunk in stream_generate(model, tokenizer, prompt, **options))
