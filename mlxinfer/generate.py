"""The text layer: prompt → chunked prefill → a token source → streamed text.

Whatever produces the tokens (plain, speculative or batched decoding: `decode`,
`speculative`, `batch`), `TextStream` turns one sequence's tokens into `Chunk`s the
same way: streaming detokenizer, thinking apart from the answer, stop strings, EOS,
limits and timing stats."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
import warnings
from dataclasses import dataclass, fields
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from .cache import KV_BITS, KV_GROUP_SIZES, PromptCache
from .checks import flag, integer, is_integer, token_ids
from .constrain import Constraint, json_answer, response_format
from .tools import ToolCall, ToolPlan, check_tools
from .tools import plan as plan_tools
from .decode import Score, Stats, Token
from .errors import ImageError, InvalidOptionError
from .images import NO_IMAGES, expand_placeholders
from .models.vision import Pixels
from .reasoning import ChannelSplitter, Reasoning, reasoning_for, tags_for
from .sample import Sampler, SamplingConfig
from .speculative import LOOKUP_DRAFT, MODEL_DRAFT, PREDICTION_DRAFT, PredictedOutput, SpeculativeDecoder, make_drafter
from .tokenizer import Tokenizer

Prompt = str | Sequence[int] | Sequence[dict]
# Stop strings are markers ("</answer>", "\nUser:"): OpenAI takes 4 of them. Matching costs
# nothing per stop, but text that may begin one is held back from the stream, so a stop's
# length is how far streaming can lag; 16 stops of 1,000 characters are generous for both.
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
# Choices one request may ask for (`n`): each is a sequence of its own in the batch engine.
MAX_CHOICES = 16


@dataclass(frozen=True)
class PromptToken:
    """One token of an echoed prompt: its id, the text it adds, and (when the prompt is scored)
    its log-probability given the tokens before it with the most likely tokens there. The first
    token has none: nothing comes before it."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Chunk:
    text: str
    token: int | None
    logprob: float | None
    finish_reason: str | None
    stats: Stats
    top_logprobs: list[tuple[int, float]] | None = None
    drafted: bool = False
    error: str | None = None  # why a sequence ended with finish_reason "error" (batch engine)
    tool_calls: list[ToolCall] | None = None  # on the last chunk of a reply that called tools
    content: str | None = None  # with tool_calls: the reply's text outside the calls
    reasoning: str = ""  # thinking this token added (a reasoning model's <think> part); `text` is the answer only
    stop_sequence: str | None = None  # the stop string that ended the reply (Anthropic's API names it)
    prompt: list[PromptToken] | None = None  # echo: the prompt's tokens, on a first chunk whose `text` is the prompt
    index: int = 0  # which of the request's `n` choices this chunk belongs to


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
    response_format: Any = None  # OpenAI's shape, or {"type": "regex"|"grammar", ...}: see `constrain`
    tools: Any = None  # OpenAI's tools list: see `tools`
    tool_choice: Any = None  # "auto" (default), "none", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True  # False: a reply makes at most one call (held to the grammar)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": False}
    split_reasoning: bool = True  # a thinking model's thoughts in Chunk.reasoning, not in the text (`reasoning`)
    echo: bool = False  # the prompt comes back first, as one chunk (its text and tokens), before the reply
    prompt_logprobs: int | None = None  # with echo: score the prompt's tokens, with this many top alternatives
    n: int = 1  # choices: the batch engine runs n sequences from one prefill (`BatchGenerator.enqueue_choices`)
    prediction: str | None = None  # the expected output (Predicted Outputs): the speculative draft, in place of others
    adapter: str | None = None  # the LoRA adapter (by its loaded name) to run with; None: the model's default

    def __post_init__(self) -> None:
        """Types and ranges, so a bad value fails before any work and not inside MLX."""
        integer("max_tokens", self.max_tokens, 0)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidOptionError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOPS:
            raise InvalidOptionError(f"stop holds {len(self.stop)} strings; at most {MAX_STOPS} are allowed")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise InvalidOptionError(f"a stop string has {len(longest)} characters; at most {MAX_STOP_CHARS} are "
                                     "allowed")
        flag("ignore_eos", self.ignore_eos)
        flag("parallel_tool_calls", self.parallel_tool_calls)
        flag("split_reasoning", self.split_reasoning)
        check_template_kwargs(self.chat_template_kwargs)
        flag("echo", self.echo)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", self.prompt_logprobs, 0)
            if not self.echo:
                raise InvalidOptionError("prompt_logprobs needs echo=True: the scores come with the echoed prompt")
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
        integer("n", self.n, 1, MAX_CHOICES)
        if self.adapter is not None and not (isinstance(self.adapter, str) and self.adapter):
            raise InvalidOptionError(f"adapter must be the name of a loaded adapter, got {self.adapter!r:.60}")
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise InvalidOptionError(f"prediction must be the expected output as text, got "
                                     f"{type(self.prediction).__name__}")
        if self.draft_model is not None and self.prompt_lookup:
            raise InvalidOptionError("choose one drafter: a draft model or prompt lookup, not both")
        if response_format(self.response_format) is not None and self.ignore_eos:
            raise InvalidOptionError("ignore_eos cannot be combined with response_format: a constrained reply "
                                     "ends with EOS once it is complete")
        if self.tools is not None:
            check_tools(self.tools)
            fmt = response_format(self.response_format)
            if fmt is not None and fmt.kind not in ("json_object", "json_schema"):
                raise InvalidOptionError(f"tools combine with a json_schema or json_object response_format only, not "
                                         f"{fmt.kind}: a reply is a tool call or JSON")
        elif self.tool_choice is not None:
            raise InvalidOptionError("tool_choice needs tools")


# Variables the renderer sets itself: a template kwarg may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools")


def check_template_kwargs(kwargs: Any) -> None:
    """chat_template_kwargs: template variables by name; never one the renderer sets itself."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise InvalidOptionError('chat_template_kwargs must be an object of template variables, e.g. '
                                 '{"enable_thinking": false}')
    taken = [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]
    if taken:
        raise InvalidOptionError(f"chat_template_kwargs cannot set '{taken[0]}': it comes from the request itself"
                                 + (" (pass tools as the tools option)" if taken[0] == "tools" else ""))


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


def prompt_tokens(tokenizer: Tokenizer, prompt: Prompt, vocab_size: int,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A string, token ids, or chat messages (rendered with the chat template and
    `template_kwargs`), as ids checked against the model's `vocab_size` (a tokenizer may
    know more tokens than the model has embedding rows)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
    else:
        ids = prompt
    ids = token_ids(ids, vocab_size, "the prompt")
    if not ids:
        raise InvalidOptionError("the prompt is empty; give some text, token ids or chat messages")
    return ids


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


class StopMatcher:
    """Holds back text that might be the start of a stop string, so neither a
    stop string nor a prefix of one that turns out to be one is ever emitted.

    The text so far is the concatenation of every push; a push that completes a
    stop string emits the text before the earliest-starting one and drops the rest.
    An Aho-Corasick automaton over the (non-empty) stop strings reads each character
    once, whatever their number and length: its state is the longest suffix of the
    text that is a prefix of some stop, which is exactly what must be held back.
    Reading n characters costs at most 2n moves (`moves` counts them), so a push
    costs what it brings, not what is held back or how long the stops are. `matched` is the
    stop string the last push hit (the earliest-starting one; of those, the shortest)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._goto: list[dict[str, int]] = [{}]  # trie edges; node 0 is the empty prefix
        self._depth = [0]  # each node's prefix length
        self._ends = [""]  # the longest stop that ends the node's prefix ("": none)
        for stop in self.stops:
            self._insert(stop)
        self._fail = self._failure_links()
        self._longest = max((len(s) for s in self.stops), default=0)
        self._state = 0
        self._held: collections.deque[str] = collections.deque()  # the last `_depth[_state]` characters read,
        self._skip = 0  # in pieces, less the first `_skip` characters of the first piece (already released)
        self.moves = 0
        self.matched: str | None = None

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = self._goto[node][ch] = len(self._goto)
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._ends.append("")
            node = nxt
        self._ends[node] = stop

    def _failure_links(self) -> list[int]:
        """Each node's longest proper suffix that is also a node, breadth first; a node's
        `_ends` also takes the stops that end its suffixes."""
        fail = [0] * len(self._goto)
        queue = collections.deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                link = fail[node]
                while link and ch not in self._goto[link]:
                    link = fail[link]
                fail[child] = self._goto[link].get(ch, 0)
                self._ends[child] = self._ends[child] or self._ends[fail[child]]
                queue.append(child)
        return fail

    def _step(self, state: int, ch: str) -> int:
        goto, fail = self._goto, self._fail
        while True:
            self.moves += 1
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if not state:
                return 0
            state = fail[state]

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.matched = None
        if not self.stops:
            return self.flush() + text, False
        held = self._depth[self._state]
        state, first = self._state, None  # first: where the earliest-starting stop found so far starts
        for i, ch in enumerate(text):
            state = self._step(state, ch)
            if self._ends[state]:
                start = i + 1 - len(self._ends[state])
                if first is None or start < first:
                    first, self.matched = start, self._ends[state]
            if first is not None and i + 1 - first >= self._longest:
                break  # a stop ending later would be longer than the longest to start before `first`
        if first is not None:  # `first` counts from the start of `text`; negative reaches into the held text
            out = self._release(held + first) if first < 0 else self.flush() + text[:first]
            self._held.clear()
            self._skip = self._state = 0
            return out, True
        self._state = state
        if text:
            self._held.append(text)
        return self._release(held + len(text) - self._depth[state]), False

    def _release(self, n: int) -> str:
        """The first n held characters (the rest may still begin a stop); a piece released
        in parts is sliced, never copied whole again."""
        out = []
        while n:
            piece = self._held[0]
            take = min(n, len(piece) - self._skip)
            out.append(piece[self._skip : self._skip + take])
            self._skip += take
            n -= take
            if self._skip == len(piece):
                self._held.popleft()
                self._skip = 0
        return "".join(out)

    def flush(self) -> str:
        out = self._release(self._depth[self._state])
        self._state = 0
        return out


def context_limit(model, cache: PromptCache, n_prompt: int, max_tokens: int) -> int:
    """max_tokens, capped by the context a non-rotating cache can hold."""
    if cache.bounded:
        return max_tokens
    return min(max_tokens, model.config.max_position_embeddings - n_prompt)


def top_logprobs(logprobs: mx.array, k: int) -> list[tuple[int, float]] | None:
    """The `k` most likely tokens of a step and their log-probabilities (None for k = 0).
    Tokens that could not be drawn (-inf: masked out by a response format) are no
    alternatives, and no JSON can carry their -inf: with fewer legal tokens, fewer entries."""
    if not k:
        return None
    best = mx.argsort(-logprobs)[:k]
    return [(t, lp) for t, lp in zip(best.tolist(), logprobs[best].tolist()) if math.isfinite(lp)]


class TextStream:
    """One sequence's tokens → chunks: streamed text, thinking told apart from the answer
    (`reasoning`: how, for a thinking model), stop strings and tool calls on the answer
    only, EOS, limits, stats. Its time to first token counts from `start` (default: now); its
    chunks carry `index`, the choice it is of a request's n."""

    def __init__(self, tokenizer: Tokenizer, options: GenerationOptions, stats: Stats, limit: int,
                 cache: PromptCache, start: float | None = None, reasoning: Reasoning | None = None,
                 index: int = 0):
        self.options, self.stats, self.limit, self.cache, self.index = options, stats, limit, cache, index
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer()
        self.split = reasoning.splitter() if reasoning is not None else None
        self.stop = StopMatcher(options.stop)
        self.eos = set() if options.ignore_eos else set(tokenizer.eos_token_ids)
        self.generated = 0
        self.start = time.perf_counter() if start is None else start
        self.first_token_at = self.start

    def emit(self, token: Token) -> Chunk:
        stats = self.stats
        self.generated += 1
        n = self.generated
        if n == 1:
            self.first_token_at = time.perf_counter()
            stats.ttft = self.first_token_at - self.start
            stats.prefill_tps = stats.prefill_tokens / max(stats.ttft, 1e-9)
        else:
            stats.decode_tps = (n - 1) / max(time.perf_counter() - self.first_token_at, 1e-9)
        stopped_by_eos = token.id in self.eos
        thinking, answer = ("", "") if stopped_by_eos else self._parts(self.detok.add(token.id))
        text, hit = self.stop.push(answer)
        finish = "stop" if (stopped_by_eos or hit) else ("length" if n >= self.limit else None)
        if finish and not hit:
            more, rest = self._rest()
            thinking, text = thinking + more, text + rest
        stats.generated_tokens = n
        if finish:
            self._finish(finish)
        return Chunk(text, token.id, token.logprob, finish, stats, top_logprobs(token.logprobs, self.options.logprobs),
                     token.drafted, reasoning=thinking, stop_sequence=self.stop.matched, index=self.index)

    @property
    def addressed(self) -> list[tuple[str, str]] | None:
        """(recipient, body) of each message the reply addressed to a tool (harmony's calls,
        kept out of the text); None when the reply is not split (its text holds them)."""
        if self.split is None:
            return None
        return self.split.calls if isinstance(self.split, ChannelSplitter) else []

    def _parts(self, text: str) -> tuple[str, str]:
        """(thinking, answer) in newly decoded text."""
        return self.split.push(text) if self.split is not None else ("", text)

    def _rest(self) -> tuple[str, str]:
        """(thinking, answer) held back at the end of a sequence: by the detokenizer, the
        reasoning split and the stop matcher."""
        thinking, answer = self._parts(self.detok.finalize())
        if self.split is not None:
            more, tail = self.split.flush()
            thinking, answer = thinking + more, answer + tail
        return thinking, self.stop.push(answer)[0] + self.stop.flush()

    def prompt(self, ids: Sequence[int], scores: Sequence[Score] | None = None) -> Chunk:
        """The echoed prompt as one chunk: its text, and each token with the text it adds (the
        pieces join to the text) and, when `scores` (one per token after the first) are given,
        its log-probability and the most likely tokens at its position."""
        detok = self.tokenizer.detokenizer()
        pieces = [detok.add(t) for t in ids]
        pieces[-1] += detok.finalize()
        scored = [None, *scores] if scores is not None else [None] * len(ids)
        tokens = [PromptToken(t, piece, s.logprob if s else None, s.top_logprobs if s else None)
                  for t, piece, s in zip(ids, pieces, scored)]
        return Chunk("".join(pieces), None, None, None, self.stats, prompt=tokens, index=self.index)

    def _finish(self, reason: str) -> None:
        self.stats.finish_reason = reason
        self.stats.cache_bytes = self.cache.nbytes
        self.stats.peak_memory = mx.get_peak_memory()

    def end(self, reason: str) -> Chunk:
        """The last chunk of a sequence that ends without a token of its own: nothing may
        be generated ("length": max_tokens=0 or a full context), or it was cancelled;
        text held back for a possible stop string is released."""
        self._finish(reason)
        thinking, text = self._rest() if self.generated else ("", "")
        return Chunk(text, None, None, reason, self.stats, reasoning=thinking, index=self.index)


def tool_plan(options: GenerationOptions, tokenizer: Tokenizer) -> ToolPlan | None:
    if options.tools is None:
        return None
    return plan_tools(tokenizer, options.tools, options.tool_choice, options.parallel_tool_calls,
                      json_answer(options.response_format))


def request_tokens(tokenizer: Tokenizer, prompt: Prompt, vocab_size: int, tools: ToolPlan | None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt's ids; with tools, chat messages rendered with them (by the template, or the
    fallback). Token ids are taken as rendered with the tools already (a chat session does that).
    `template_kwargs` reach the template when there are messages to render."""
    if tools is None or (isinstance(prompt, Sequence) and prompt and not isinstance(prompt[0], dict)
                         and not isinstance(prompt, str)):
        return prompt_tokens(tokenizer, prompt, vocab_size, template_kwargs)
    if isinstance(prompt, str):
        raise InvalidOptionError("tools need chat messages as the prompt (a list of {'role', 'content'} dicts)")
    messages, extra = with_tools(tokenizer, prompt, tools)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **(template_kwargs or {}), **extra)
    return prompt_tokens(tokenizer, ids, vocab_size)


def with_tools(tokenizer: Tokenizer, messages: Sequence[dict],
               tools: ToolPlan | None) -> tuple[list[dict], dict[str, Any]]:
    """Chat messages and the template's extra variables with the tools shown: by the template
    (its `tools` variable) where it takes them, else in the messages (the fallback)."""
    if tools is None:
        return list(messages), {}
    messages, native = tools.messages(tokenizer, list(messages))
    return messages, {"tools": tools.tools} if native else {}


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's images as the engine runs them: each preprocessed (`Pixels`, in prompt order),
    and the prompt's cache keys: its ids with every image's placeholder tokens replaced by that
    image's key (`image_key`), so a prompt cache is reused across the same pixels only."""

    pixels: tuple[Pixels, ...]
    keys: tuple[int, ...]


def image_prompt(model, tokenizer: Tokenizer, request, tools: ToolPlan | None) -> tuple[list[int], ImagePrompt | None]:
    """The ids of a request and, when it has images, their `ImagePrompt`: the messages rendered
    as text, each image's placeholder expanded to its tokens as the HF processor does, then encoded."""
    o, vocab = request.options, model.config.vocab_size
    if not request.images:
        return request_tokens(tokenizer, request.prompt, vocab, tools, o.chat_template_kwargs), None
    if model.image_token_id is None:
        raise ImageError(NO_IMAGES)
    if model.image_processor is None:
        raise ImageError("this checkpoint has no preprocessor_config.json, so its images cannot be prepared; "
                         "copy the file from the original model into its folder")
    if o.prompt_logprobs is not None:
        raise InvalidOptionError("prompt_logprobs cannot score a prompt with images; drop one or the other")
    # each image decoded, preprocessed to the model's size and let go before the next is decoded
    pixels = tuple(model.image_processor(image.rgb()) for image in request.images)
    text = render(tokenizer, request.prompt, tools, o.chat_template_kwargs)
    text = expand_placeholders(text, pixels, model.image_processor, tokenizer.decode([model.image_token_id]))
    ids = prompt_tokens(tokenizer, tokenizer.encode(text, add_special_tokens=False), vocab)
    return ids, ImagePrompt(pixels, image_keys(ids, model.image_token_id, pixels))


def render(tokenizer: Tokenizer, messages: Sequence[dict], tools: ToolPlan | None,
           template_kwargs: dict[str, Any] | None) -> str:
    """Chat messages as the template writes them (with the tools, as `request_tokens` shows them)."""
    messages, extra = with_tools(tokenizer, messages, tools)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {}), **extra)


def image_key(image: Pixels) -> int:
    """The cache key an image's tokens stand as: negative (never a token id), from its digest."""
    return -1 - int(image.digest[:15], 16)


def image_keys(ids: Sequence[int], image_token_id: int, pixels: Sequence[Pixels]) -> tuple[int, ...]:
    """`ids` with each image's `tokens` placeholder ids, in order, replaced by its `image_key`;
    the prompt must hold exactly as many placeholder ids as the images take."""
    keys, images, left = list(ids), iter(pixels), 0
    key = 0
    for i, t in enumerate(ids):
        if t != image_token_id:
            if left:
                break
            continue
        if not left:
            image = next(images, None)
            if image is None:
                break
            key, left = image_key(image), image.tokens
        keys[i] = key
        left -= 1
    found = sum(1 for t in ids if t == image_token_id)
    if left or next(images, None) is not None or found != sum(p.tokens for p in pixels):
        raise ImageError(f"the prompt holds {found} image tokens where its {len(pixels)} images take "
                         f"{sum(p.tokens for p in pixels)}; do not write the image token in the text")
    return tuple(keys)


# Prompt tokens read for where a reply starts (inside an opened thinking or not): the end of a
# generation prompt, its tag and the blank space after it, without decoding a long prompt whole.
REASONING_TAIL = 32


def reasoning_of(options: GenerationOptions, tokenizer: Tokenizer, ids: Sequence[int]) -> Reasoning | None:
    """How a reply to `ids` splits into thinking and answer (None: it does not)."""
    if not options.split_reasoning or tags_for(tokenizer) is None:
        return None
    return reasoning_for(tokenizer, tokenizer.decode(ids[-REASONING_TAIL:]))


def constraint_for(options: GenerationOptions, tokenizer: Tokenizer, vocab_size: int,
                   tools: ToolPlan | None = None) -> Constraint | None:
    """A fresh matcher for the options' tool calls (and the format a reply may answer in
    instead) or their response format, if they ask for one."""
    if tools is not None and tools.grammar is not None:
        return tools.constraint(tokenizer, vocab_size)
    fmt = response_format(options.response_format)
    return Constraint(fmt, tokenizer, vocab_size) if fmt is not None else None


def read_tool_calls(chunk: Chunk, reply: str, tools: ToolPlan | None,
                    addressed: list[tuple[str, str]] | None = None) -> Chunk:
    """The last chunk of a reply, with the calls it made (finish_reason "tool_calls"): read
    from its text, or `addressed` to them (`TextStream.addressed`)."""
    if tools is None or chunk.finish_reason not in ("stop", "length"):
        return chunk
    content, calls = tools.parse(reply, addressed)
    if not calls:
        return chunk
    chunk.stats.finish_reason = "tool_calls"
    return dataclasses.replace(chunk, finish_reason="tool_calls", tool_calls=calls, content=content)


def predicted_tokens(tokenizer: Tokenizer, options: GenerationOptions, vocab_size: int) -> tuple[int, ...] | None:
    """The prediction's token ids (None without one). Ids the model has no row for (a tokenizer
    may know more tokens than the model) could never be drawn, so they are left out."""
    if options.prediction is None:
        return None
    return tuple(t for t in tokenizer.encode(options.prediction, add_special_tokens=False) if t < vocab_size)


def speculative_source(model, cache: PromptCache, sampler: Sampler, last: int, limit: int,
                       options: GenerationOptions, stats: Stats, constraint: Constraint | None = None,
                       prediction: PredictedOutput | None = None) -> SpeculativeDecoder:
    """Speculative decoding with the drafter asked for: a `prediction` first (it is what the
    caller expects this very output to be), else the options' draft model or prompt lookup;
    held to `constraint` when there is one."""
    o = options
    if prediction is not None:
        drafter, max_draft = prediction, o.num_draft_tokens or PREDICTION_DRAFT
    else:
        drafter = make_drafter(model, sampler, o.draft_model, o.draft_cache, constraint,
                               max_kv_size=o.max_kv_size, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size)
        max_draft = o.num_draft_tokens or (LOOKUP_DRAFT if o.prompt_lookup else MODEL_DRAFT)
    return SpeculativeDecoder(model, cache, sampler, drafter, last, limit, stats, max_draft, constraint=constraint)
