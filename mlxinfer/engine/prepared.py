"""A request made ready for the engine (`Prepared`): everything about it that does not need the
engine's state, its prompt rendered and tokenized, images preprocessed, grammar compiled and
context checked. None of it touches a sequence in flight, so a server prepares requests on other
threads while the engine thread keeps stepping."""

from __future__ import annotations

from dataclasses import dataclass

from ..decode.sample import SamplingConfig
from ..models.lora import identity
from ..models.prompt_cache import PromptCache
from ..text.constrain import Constraint
from ..text.reasoning import Reasoning
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolPlan
from ..text.tools import plan as plan_tools
from .decoders import constraint_for
from .options import GenerationOptions
from .prompt import ImagePrompt, image_prompt, predicted_tokens, reasoning_of, tool_plan
from .request import Request
from .runtime import check_context

CACHE_OPTIONS = ("max_kv_size", "kv_bits", "kv_group_size")


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine (`prepare`): its prompt ids and checked options."""

    request: Request  # what it was prepared from: a replicated engine shares this with the other ranks
    ids: list[int]
    sampling: SamplingConfig
    options: GenerationOptions
    tools: ToolPlan | None
    # a fresh matcher for its format or tool calls per choice (built here: it can be slow), or Nones
    constraints: tuple[Constraint | None, ...]
    reasoning: Reasoning | None = None  # how its reply splits into thinking and answer
    predicted: tuple[int, ...] | None = None  # the prediction's tokens, when it has one
    images: ImagePrompt | None = None  # its images, preprocessed, and its cache keys


def cache_options(o: GenerationOptions) -> dict[str, int | None]:
    """The options a request's cache is made with (`PromptCache.for_model`'s keywords)."""
    return {k: getattr(o, k) for k in CACHE_OPTIONS}


def prepare(model, tokenizer: Tokenizer, request: Request) -> Prepared:
    """The prompt rendered and tokenized, its grammar compiled (one per choice), its context and
    adapter checked: work that grows with a request's size, done before it reaches the engine."""
    o, vocab = request.options, model.config.vocab_size
    tools = tool_plan(o, tokenizer)
    ids, images = image_prompt(model, tokenizer, request, tools)
    check_context(model, PromptCache.for_model(model, **cache_options(o)), len(ids))
    identity(model, o.adapter)  # an adapter this model does not have is refused here, before any work
    constraints = tuple(constraint_for(o, tokenizer, vocab, tools) for _ in range(o.n))
    return Prepared(request, ids, request.sampling, o, tools, constraints, reasoning_of(o, tokenizer, ids),
                    predicted_tokens(tokenizer, o, vocab), images)


def count(model, tokenizer: Tokenizer, request: Request) -> int:
    """How many tokens the request's prompt is as `prepare` renders it, tools included (they
    render alike whatever tool_choice says); no grammar is compiled and nothing is checked
    against the context, so a client can measure a prompt before sending it."""
    o = request.options
    shown = plan_tools(tokenizer, o.tools, "none") if o.tools is not None else None
    return len(image_prompt(model, tokenizer, request, shown)[0])
