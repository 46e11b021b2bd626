"""The public ways to generate: `generate` (the whole text), `stream_generate` (chunk by chunk) and
`batch_generate` (many prompts decoded together), each the batch engine with its requests, so a lone
generation and a served one run the same recipe."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import mlx.core as mx

from .batch import BatchGenerator
from ..base.errors import InvalidOptionError
from .options import Prompt
from ..models.prompt_cache import PromptCache
from .request import Request
from .text_stream import Chunk
from ..text.tokenizer import Tokenizer


def stream_generate(model, tokenizer: Tokenizer, prompt: Prompt, prompt_cache: PromptCache | None = None,
                    engine: BatchGenerator | None = None, **options: Any) -> Iterator[Chunk]:
    """Stream a completion chunk by chunk (one chunk per generated token): the engine with
    one request, so a lone generation and a served one run the same recipe.

    Options: max_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, penalty_window, logit_bias, seed, stop,
    ignore_eos, max_kv_size, kv_bits, kv_group_size, prefill_step, logprobs, and
    for speculative decoding draft_model, draft_cache (the draft's PromptCache, to
    reuse across calls), num_draft_tokens, prompt_lookup; response_format holds the
    reply to a JSON Schema, any JSON object, a regex or a Lark grammar (`constrain`);
    tools and tool_choice offer the app's functions (`tools`): a reply that calls them
    ends with finish_reason "tool_calls" and the calls on its last chunk (at most one
    with parallel_tool_calls=False); chat_template_kwargs reach the chat template (e.g.
    {"enable_thinking": False}). A thinking model's thoughts come in `Chunk.reasoning`
    and its answer in `Chunk.text` (split_reasoning=False: all of it as text, tags included).
    With echo the first chunk is the prompt (`Chunk.prompt` holds its tokens), and
    prompt_logprobs scores them (max_tokens=0 scores without generating).
    Pass a `PromptCache` to reuse the longest common prefix across calls (not when scoring the
    prompt: every position of it runs), and an `engine` (a one-sequence `BatchGenerator`, or a
    `replica.Replica` for a model sharded across ranks) to run it there rather than in a fresh
    one. An error ends the stream by raising it (the served engine turns it into an error chunk
    instead).
    """
    kept = engine is not None
    engine = engine if kept else BatchGenerator(model, tokenizer, max_batch=1)
    yield from stream_request(engine, engine.request(prompt, **options), prompt_cache, kept)


def stream_request(engine: BatchGenerator, request: Request, prompt_cache: PromptCache | None = None,
                   kept: bool = True) -> Iterator[Chunk]:
    """A typed request's chunks from `engine`, which runs nothing else meanwhile (what
    `stream_generate` runs once the request is made). When the caller `kept` the engine for
    more requests, leaving early cancels the sequence there."""
    prepared = engine.prepare(request)
    uid = engine.enqueue(prepared, cache=prompt_cache)
    mx.reset_peak_memory()
    steps, ended = engine.stream(), False
    try:
        for _, chunk in steps:
            ended = chunk.finish_reason is not None
            if chunk.finish_reason == "error":
                raise engine.failures[uid]
            yield chunk
    except GeneratorExit:
        steps.close()
        if kept and not ended:
            engine.cancel(uid)
            for _ in engine.stream():
                pass
        raise


def generate(model, tokenizer: Tokenizer, prompt: Prompt, **options: Any) -> str:
    """The whole completion as one string (same options as `stream_generate`)."""
    return "".join(chunk.text for chunk in stream_generate(model, tokenizer, prompt, **options))


def batch_generate(model, tokenizer: Tokenizer, prompts: Sequence[Prompt], max_batch: int = 8,
                   adapters: Sequence[str | None] | None = None, **options: Any) -> list[str]:
    """Complete every prompt (same options as `stream_generate`), decoding up to `max_batch`
    of them together; the texts in the order of `prompts`. `adapters[i]`: the LoRA adapter
    prompt i runs with (None: the model's default); rows of different adapters share each step."""
    if adapters is not None and len(adapters) != len(prompts):
        raise InvalidOptionError(f"adapters has {len(adapters)} entries for {len(prompts)} prompts; give one per prompt")
    engine = BatchGenerator(model, tokenizer, max_batch=max_batch, **options)
    chosen = adapters if adapters is not None else [options.get("adapter")] * len(prompts)
    uids = [engine.submit(p, adapter=a) for p, a in zip(prompts, chosen)]
    texts: dict[int, list[str]] = {uid: [] for uid in uids}
    for uid, chunk in engine.stream():
        texts[uid].append(chunk.text)
    return ["".join(texts[uid]) for uid in uids]
