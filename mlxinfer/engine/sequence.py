"""One sequence in the batch engine, from submission to its last chunk (`SequenceState`): its
prompt, options, sampler and text layer, the cache it runs in, where its prefill stands, and the
moves it makes on its own (begun with a cache, a chunk of its prompt prefilled, a token turned
into a chunk, ended and let go). The engine (`batch.BatchGenerator`) decides when each happens.

A request's n choices are n sequences sharing one prompt (`SharedPrompt`): the first admitted
prefills it, the others wait and then begin from copies of its cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import mlx.core as mx

from ..decode.sample import Sampler
from ..decode.sources import Score, Stats, Token, scored_prefill
from ..decode.speculative import PredictedOutput, SpeculativeDecoder
from ..models.prompt_cache import PromptCache, chunk_end
from ..models.vision import Embedded
from ..text.constrain import Constraint
from ..text.reasoning import Reasoning
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolPlan
from .decoders import speculative_source
from .options import GenerationOptions
from .pool import PromptCachePool, prefix_copy
from .prepared import Prepared, cache_options
from .prompt import ImagePrompt
from .runtime import context_limit
from .text_stream import Chunk, TextStream, read_tool_calls

# Most tokens one engine step decodes speculatively, so a new request waits at most this long to be admitted.
SPECULATIVE_BURST = 16
SHARED = "speculative decoding paused while other sequences were decoded in the same batch"

@dataclass(eq=False)
class SharedPrompt:
    """The prompt of a request's n choices: the first of them admitted prefills it (`runner`);
    the rest wait until `cache` holds a copy of the prefilled prompt (and `scores` its scores,
    when they were asked for) and start from copies of that. Should the runner end before its
    prompt is in, the next choice admitted runs it."""

    runner: SequenceState | None = None
    cache: PromptCache | None = None
    scores: list[Score] | None = None

    def ready(self) -> bool:
        """Whether a waiting choice may start now: from the prompt's copy, or as its runner."""
        return self.cache is not None or self.runner is None or self.runner.cache is None

# A scored chunk also runs the LM head over every position and a log-softmax and a top-k over the
# vocabulary: 512 scored tokens of the demo model (a 49k vocabulary) took 2.5x as long as 512 plain
# ones. So it counts this many times its tokens against a step's budget and is cut that much
# shorter, and a stream waiting on it waits no longer than for one plain chunk.
SCORED_COST = 4


@dataclass(eq=False)
class SequenceState:
    """One sequence in the engine, from submission to its last chunk."""

    uid: int
    prompt: list[int]
    options: GenerationOptions
    sampler: Sampler
    stats: Stats
    submitted: float
    cache: PromptCache | None = None
    text: TextStream | None = None
    todo: list[int] = field(default_factory=list)  # prompt tokens the cache still lacks
    prefilled: int = 0  # of todo[:-1]
    next_input: mx.array | None = None  # [1]: the token the next decode step runs
    speculative: SpeculativeDecoder | None = None  # drafts while this sequence is alone
    constraint: Constraint | None = None  # its response format or tool-call grammar, when it has one
    tools: ToolPlan | None = None  # what its tools are and how its calls are read
    reply: list[str] = field(default_factory=list)  # its text so far, kept only when it has tools
    own_cache: PromptCache | None = None  # the caller's cache (reused across calls), instead of the pool's or a new one
    scores: list[Score] | None = None  # its prompt's scores so far, when it asked for them (prompt_logprobs)
    reasoning: Reasoning | None = None  # how its reply splits into thinking and answer
    index: int = 0  # which of its request's choices it is
    shared: SharedPrompt | None = None  # with n > 1: the prompt it shares with the other choices, until it starts
    predicted: tuple[int, ...] | None = None  # the prediction it drafts from while alone
    images: ImagePrompt | None = None  # its prompt's images and cache keys, when it has images
    embedded: Embedded | None = None  # its whole prompt's inputs with the images in (while it prefills)
    start: int = 0  # where `todo` starts in the prompt
    group: int = 0  # the request it belongs to (its choices, or the prompts one client sent together)
    pausing: bool = False  # it gives its slot to another request after this step (`fairness`)

    @classmethod
    def of(cls, uid: int, p: Prepared, index: int, shared: SharedPrompt | None, group: int,
           cache: PromptCache | None = None) -> SequenceState:
        """Choice `index` of the prepared request, submitted now: its own sampler (seeded for
        the choice) and constraint; `cache`, the caller's, to run in."""
        return cls(uid, p.ids, p.options, Sampler(p.sampling.for_choice(index), p.ids), Stats(prompt_tokens=len(p.ids)),
                   time.perf_counter(), tools=p.tools, constraint=p.constraints[index], own_cache=cache,
                   reasoning=p.reasoning, index=index, shared=shared, predicted=p.predicted, images=p.images,
                   group=group)

    @property
    def cache_options(self) -> dict[str, Any]:
        return cache_options(self.options)

    @property
    def keys(self) -> list[int]:
        """What its cache lists for the prompt: the ids, each image's tokens as the image's key."""
        return list(self.images.keys) if self.images is not None else self.prompt

    @property
    def prompt_pending(self) -> bool:
        """Whether prompt tokens before the last are still to run (the first decode step runs the last)."""
        return self.prefilled < len(self.todo) - 1

    def begin(self, model, tokenizer: Tokenizer, pool: PromptCachePool | None) -> int:
        """Give the admitted sequence its cache (`_take_cache`) and text layer, and its drafter
        when it asked for one; returns how many tokens it may generate."""
        self._take_cache(model, pool)
        limit = context_limit(model, self.cache, len(self.prompt), self.options.max_tokens)
        self.text = self.text_layer(tokenizer, self.cache, limit)
        self.start = len(self.prompt) - len(self.cache.prepare(self.keys))
        self.todo = self.prompt[self.start :]
        self.stats.prefill_tokens = len(self.todo)
        if model.image_token_id is not None:  # positions after the prompt follow its images (M-RoPE)
            # images wholly in the reused prefix are not encoded again: their K/V are in the cache
            self.embedded = (model.embedded(self.prompt, self.images.pixels, self.start)
                             if self.images is not None else None)
            self.cache.set_position_delta(self.embedded.position_delta if self.embedded is not None else 0)
        o = self.options
        if o.draft_model is not None or o.prompt_lookup or self.predicted is not None:
            # its own draft cache, never one shared by sequences
            drafting = o if self.own_cache is not None else replace(o, draft_cache=None)
            prediction = PredictedOutput(self.predicted, len(self.prompt)) if self.predicted is not None else None
            self.speculative = speculative_source(model, self.cache, self.sampler, self.todo[-1], limit, drafting,
                                                  self.stats, self.constraint, prediction)
        return limit

    def _take_cache(self, model, pool: PromptCachePool | None) -> None:
        """The caller's cache, or from the pool when one shares its prefix, or a new one. A prompt
        to be scored runs whole: positions a cache already held were never scored. A choice whose
        prompt another choice prefilled starts from a copy of that cache (and its scores), with
        only its last token to run; the first choice to begin runs the prompt for the others."""
        opts, shared = self.cache_options, self.shared
        scored = self.options.prompt_logprobs is not None
        self.scores = [] if scored else None
        if shared is not None and shared.cache is not None:
            self.cache = prefix_copy(shared.cache, len(shared.cache.tokens))
            self.scores = list(shared.scores) if scored else None
            self.shared = None  # once every waiting choice has started, nothing holds the copy
        elif self.own_cache is not None:
            self.cache = self.own_cache
            self.cache.use_adapter(self.options.adapter)
            if scored:
                self.cache.reset()
        elif pool is not None and not scored:
            self.cache = pool.fetch(model, self.keys, self.options.adapter, **opts)
        else:
            self.cache = PromptCache.for_model(model, self.options.adapter, **opts)
        if self.shared is not None:  # no copy of the prompt yet: this choice runs it for those that wait
            shared.runner = self

    def text_layer(self, tokenizer: Tokenizer, cache: PromptCache, limit: int) -> TextStream:
        """Its text layer; time to first token counts from submission, the wait for a slot included."""
        return TextStream(tokenizer, self.options, self.stats, limit, cache, start=self.submitted,
                          reasoning=self.reasoning, index=self.index)

    def cost(self, chunk: list[int]) -> int:
        """What `chunk` costs against a step's prefill budget, in plain prompt tokens."""
        return len(chunk) * (SCORED_COST if self.scores is not None else 1)

    def next_chunk(self) -> list[int]:
        """The next prefill chunk of its prompt, cut where a lone generation cuts it: `prefill_step`
        tokens on (a scored prompt: that many tokens' `cost`), before the last prompt token (the
        first decode step runs it), never inside an image that attends both ways."""
        begin = self.prefilled
        step = self.options.prefill_step if self.scores is None else max(1, self.options.prefill_step // SCORED_COST)
        end = min(begin + step, len(self.todo) - 1)
        if self.embedded is not None:
            end = min(chunk_end(self.start + begin, self.start + end, self.embedded.bidirectional) - self.start,
                      len(self.todo) - 1)
        return self.todo[begin:end]

    def prefill(self, model, chunk: list[int]) -> None:
        """Run `chunk` (its `next_chunk`) into its cache: with its images' inputs where it has
        images, scored where its prompt is to be scored; timed on its stats."""
        began = time.perf_counter()
        if self.embedded is not None:
            at = self.start + self.prefilled  # in the whole prompt
            self.cache.prefill(model, chunk, len(chunk), self.embedded.slice(at, at + len(chunk)),
                               self.images.keys[at : at + len(chunk)])
        elif self.scores is None:
            self.cache.prefill(model, chunk, len(chunk))
        else:
            following = self.todo[self.prefilled + 1 : self.prefilled + 1 + len(chunk)]
            self.scores += scored_prefill(model, self.cache, chunk, following, self.options.prompt_logprobs)
        # each evaluates the chunk before returning, so this is its own time
        self.stats.prefill_chunks.append((len(chunk), began - self.submitted, time.perf_counter() - began))
        self.prefilled += len(chunk)

    def prompt_done(self) -> None:
        """Its prompt is in the cache: its inputs (images in) are not held through decoding, and
        the choices waiting on its prompt may begin from copies of it."""
        self.embedded = None
        if self.shared is not None:
            self.shared.cache, self.shared.scores = prefix_copy(self.cache, len(self.cache.tokens)), self.scores
            self.shared = None

    def burst(self) -> Iterator[Token]:
        """One burst of speculative decoding (a draft-and-verify round, or plain tokens) while it
        is alone in the engine. Read to its end, its cache then holds everything but its next
        input again; a sequence that ended midway (its caller stops reading) needs none."""
        spec = self.speculative
        spec.last = int(self.next_input.item())
        yield from spec.burst(min(self.text.limit - self.text.generated, SPECULATIVE_BURST))
        self.next_input = mx.array([spec.last])

    def pause_drafting(self, shared: bool) -> None:
        """It is decoded in a batched step: its speculative phase is interrupted, so the time spent
        there is not its rate; `shared`: others were in the step (its stats note says so)."""
        self.speculative.pause()
        if shared:
            self.stats.note = SHARED

    def chunk_of(self, token: Token) -> Chunk:
        """Its chunk for `token`; a last one carries the tool calls its reply made."""
        chunk = self.text.emit(token)
        if self.tools is not None:
            self.reply.append(chunk.text)
            if chunk.finish_reason:
                return read_tool_calls(chunk, "".join(self.reply), self.tools, self.text.addressed)
        return chunk

    def failed(self, error: Exception) -> Chunk:
        """Its last chunk, finish_reason "error" with `error` in one line; its cache is dropped, not pooled."""
        self.stats.finish_reason = "error"
        message = " ".join(str(error).split())  # one line, whatever the exception held
        chunk = Chunk("", None, None, "error", self.stats, error=f"{type(error).__name__}: {message}",
                      index=self.index)
        self.drop()
        return chunk

    def cancelled(self, tokenizer: Tokenizer) -> Chunk:
        """Its last chunk, finish_reason "cancelled" (from a text layer of its own if it never
        began); its cache is freed: a cancelled sequence's K/V are not worth pooling."""
        chunk = (self.text or self.text_layer(tokenizer, PromptCache([]), 0)).end("cancelled")
        self.drop()
        return chunk

    def release(self, model, pool: PromptCachePool | None) -> None:
        """It finished: hand its cache to the pool (it covers prompt and reply), or drop it."""
        if pool is not None and self.cache is not None and self.own_cache is None:
            pool.store(self.cache, model, **self.cache_options)
        self.drop()

    def drop(self) -> None:
        """Let go of what it holds while running: its cache, drafter and grammar."""
        self.cache = self.speculative = self.constraint = None
