"""A request's generation options, checked when they are made: what every front end and the engine
agree a request may ask for (the sampling half is `decode.sample.SamplingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

from ..models.cache import KV_BITS, KV_GROUP_SIZES
from ..models.prompt_cache import PromptCache
from ..base.checks import flag, integer, is_integer
from ..text.constrain import response_format
from ..base.errors import InvalidOptionError
from ..decode.sample import SamplingConfig
from ..text.reasoning import effort_kwargs
from ..text.tokenizer import Tokenizer
from ..text.tools import check_tools

Prompt = str | Sequence[int] | Sequence[dict]


# Stop strings are markers ("</answer>", "\nUser:"): OpenAI takes 4 of them. Matching costs
# nothing per stop, but text that may begin one is held back from the stream, so a stop's
# length is how far streaming can lag; 16 stops of 1,000 characters are generous for both.
MAX_STOPS, MAX_STOP_CHARS = 16, 1000


# Prompt tokens per prefill chunk. Measured with the CPU extension (demo model, 2 cores, prompts of 1,024-4,096
# tokens): 512 prefilled 4-5% faster than 256 and 1-6% faster than 1,024 (a chunk's activations leave the cache
# beyond it), and 20-35% faster than 2,048. It is also the stall bound: another stream waits at most one chunk.
PREFILL_STEP = 512


# Choices one request may ask for (`n`): each is a sequence of its own in the batch engine.
MAX_CHOICES = 16


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    prefill_step: int = PREFILL_STEP
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
        integer("n", self.n, 1)
        if self.n > MAX_CHOICES:
            raise InvalidOptionError(f"n must be at most {MAX_CHOICES} (choices per request), got {self.n}: ask for "
                                     "fewer or send several requests", "n")
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
        elif self.tool_choice not in (None, "none"):  # "none" without tools asks for what no tools give
            raise InvalidOptionError("tool_choice needs tools", "tool_choice")


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """What one request of an HTTP API asks for, in the engine's names; None: not asked (the
    engine's default). Each API's schema fills it from its own fields, renaming and nothing more;
    `keywords` applies the rules every API shares, so each is written once: top_p 0 is greedy,
    a reasoning effort is the template's thinking switch. The rest (n's limit, tool_choice without
    tools, stops, formats) `GenerationOptions` and `SamplingConfig` check as they are made."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None  # 0: greedy, as OpenAI reads it (the engine's nucleus takes (0, 1])
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    penalty_window: int | None = None  # the last tokens the penalties look at (Ollama's repeat_last_n)
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None  # top alternatives per token; 1 asks for the chosen token's alone
    response_format: dict[str, object] | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # thinking on or off where the template can (`reasoning.effort_kwargs`)
    chat_template_kwargs: dict[str, object] | None = None  # template variables as given: they win over the effort's
    n: int | None = None
    prediction: str | None = None
    echo: bool | None = None
    prompt_logprobs: int | None = None
    split_reasoning: bool | None = None
    adapter: str | None = None

    def keywords(self, tokenizer: Tokenizer) -> dict[str, object]:
        """`Request.of`'s keyword options: those asked for, with the shared rules applied."""
        asked = {f.name: getattr(self, f.name) for f in fields(self)
                 if getattr(self, f.name) is not None and f.name not in ("reasoning_effort", "chat_template_kwargs")}
        if self.top_p == 0:  # keep only the most likely token: greedy
            del asked["top_p"]
            asked["temperature"] = 0.0
        template = {**effort_kwargs(tokenizer, self.reasoning_effort), **(self.chat_template_kwargs or {})}
        if template:
            asked["chat_template_kwargs"] = template
        return asked


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
