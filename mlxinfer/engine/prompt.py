"""A request's prompt as the engine runs it: messages rendered by the chat template (with the tools
shown), images expanded to their placeholder tokens and keyed by their pixels, checked token ids;
and what the prompt decides about the reply (where thinking starts, the prediction's tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..base.checks import token_ids
from ..text.constrain import json_answer
from ..base.errors import ImageError, InvalidOptionError
from ..text.images import expand_placeholders
from ..models.vision import Pixels, check_takes_images, image_spans
from .options import GenerationOptions, Prompt
from ..text.reasoning import Reasoning, reasoning_for, tags_for
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolPlan
from ..text.tools import plan as plan_tools


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
    check_takes_images(model)
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
    """`ids` with each image's run of placeholder ids (`image_spans`, which checks them) replaced
    by its `image_key`."""
    keys = list(ids)
    for (start, end), image in zip(image_spans(ids, image_token_id, pixels), pixels):
        keys[start:end] = [image_key(image)] * (end - start)
    return tuple(keys)


# Prompt tokens read for where a reply starts (inside an opened thinking or not): the end of a
# generation prompt, its tag and the blank space after it, without decoding a long prompt whole.
REASONING_TAIL = 32


def reasoning_of(options: GenerationOptions, tokenizer: Tokenizer, ids: Sequence[int]) -> Reasoning | None:
    """How a reply to `ids` splits into thinking and answer (None: it does not)."""
    if not options.split_reasoning or tags_for(tokenizer) is None:
        return None
    return reasoning_for(tokenizer, tokenizer.decode(ids[-REASONING_TAIL:]))


def predicted_tokens(tokenizer: Tokenizer, options: GenerationOptions, vocab_size: int) -> tuple[int, ...] | None:
    """The prediction's token ids (None without one). Ids the model has no row for (a tokenizer
    may know more tokens than the model) could never be drawn, so they are left out."""
    if options.prediction is None:
        return None
    return tuple(t for t in tokenizer.encode(options.prediction, add_special_tokens=False) if t < vocab_size)
