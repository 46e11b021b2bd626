"""Speculative decoding: a cheap drafter proposes tokens, the target model scores
them all in one forward pass, and exact rejection sampling keeps the output
distribution identical to the target's (Leviathan et al. 2023; Chen et al. 2023).

Accept draft token x with probability min(1, p(x)/q(x)); at the first rejection
draw from the normalised residual max(0, p - q); if all k are accepted draw a
bonus token from p. p and q are the target's and drafter's distributions after
the same sampling filters. Greedy decoding is the special case where p and q
are one-hot, and a deterministic drafter (prompt lookup) has one-hot q.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from . import kernels
from .cache import PromptCache
from .errors import InvalidOptionError
from .sample import Sampler, SamplingConfig, filtered_probs


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], mx.array | None]:
        """Up to k tokens to follow `context`, and their draft distributions [n, V]
        (None for a deterministic drafter)."""


def position_probs(logits: mx.array, config: SamplingConfig, history: Sequence[int], drafts: Sequence[int]) -> mx.array:
    """Filtered distributions [n, V] for consecutive positions; with penalties each
    position sees the history up to itself."""
    if not config.penalised:
        return filtered_probs(logits, config)
    w = config.penalty_window
    rows = [
        filtered_probs(logits[i : i + 1], config, mx.array((list(history) + list(drafts[:i]))[-w:])[None])
        for i in range(logits.shape[0])
    ]
    return mx.concatenate(rows, axis=0)


def verify(p: mx.array, drafts: Sequence[int], q: mx.array | None, sampler: Sampler) -> tuple[int, int]:
    """How many drafts the target accepts, and the token it emits after them.

    p: target distributions [k+1, V] (position i scores draft i; row k is the
    bonus); q: draft distributions [k, V], or None for one-hot drafts.
    """
    u = mx.random.uniform(shape=(len(drafts) + 1,), key=sampler.next_key())
    n, token = kernels.verify(p, drafts, q, u).tolist()
    return n, token


@dataclass
class PromptLookup:
    """Propose what followed the most recent earlier occurrence of the context's
    last n tokens (n from `max_ngram` down to `min_ngram`). Free to run, and a
    large win whenever the output copies its input: edits, summaries, code, RAG."""

    max_ngram: int = 4
    min_ngram: int = 1

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        ids = np.asarray(context)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ids) <= n:
                continue
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                return ids[start : start + k].tolist(), None
        return [], None


class DraftModel:
    """A small model sharing the target's vocabulary, with its own cache kept in
    step with the accepted tokens (trimmed back on rejection)."""

    def __init__(self, model, target, config: SamplingConfig, sampler: Sampler, cache: PromptCache):
        if model.config.vocab_size != target.config.vocab_size:
            raise InvalidOptionError(
                f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from the target's "
                f"({target.config.vocab_size}); use a draft from the same model family and tokenizer"
            )
        self.model, self.config, self.sampler = model, config, sampler
        self.cache = cache

    def _logits(self, tokens: mx.array) -> mx.array:
        return self.model(tokens[None], cache=self.cache.caches)[0, -1:]

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], mx.array]:
        todo = self.cache.prepare(context)
        logits = self._logits(mx.array(todo))
        tokens, probs = [], []
        window = mx.array(list(context[-self.config.penalty_window :]))
        for i in range(k):
            history = None
            if self.config.penalised:
                history = mx.concatenate([window, *tokens])[-self.config.penalty_window :][None]
            q = filtered_probs(logits, self.config, history)
            token = mx.random.categorical(mx.log(q), key=self.sampler.next_key())
            tokens.append(token)
            probs.append(q)
            if i + 1 < k:
                logits = self._logits(token)
        drafted = mx.concatenate(tokens)
        q_all = mx.concatenate(probs, axis=0)
        mx.eval(drafted, q_all)
        ids = drafted.tolist()
        self.cache.feed(todo + ids[:-1])
        return ids, q_all


class DraftLength:
    """Adapts k to the drafter's luck: a fully accepted round doubles k, a round
    with nothing accepted halves it (verifying k+1 tokens costs far less than
    k+1 steps, so long drafts are cheap to try and shrink fast when they fail),
    and after two empty rounds in a row drafting pauses for a number of tokens
    that doubles with each failed retry, so a useless drafter costs almost
    nothing over plain decoding."""

    def __init__(self, k_max: int, k_min: int = 1, pause: int = 8, max_pause: int = 256):
        self.k_max, self.k_min = k_max, k_min
        self.min_pause, self.max_pause = pause, max_pause
        self.k = min(4, k_max)
        self.pause = pause
        self.paused = 0
        self.misses = 0

    def next(self) -> int:
        """The draft length for the next round; 0 while paused."""
        return 0 if self.paused else self.k

    def skip(self, tokens: int) -> None:
        """`tokens` were decoded without drafting."""
        self.paused = max(0, self.paused - tokens)

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        if accepted == proposed:
            self.k = min(2 * self.k, self.k_max)
        elif not accepted:
            self.k = max(self.k // 2, self.k_min)
        if accepted:
            self.misses, self.pause = 0, self.min_pause
            return
        self.misses += 1
        if self.misses >= 2:
            self.paused, self.misses = self.pause, 0
            self.pause = min(2 * self.pause, self.max_pause)


def make_drafter(gen) -> Drafter:
    o = gen.options
    if o.prompt_lookup:
        return PromptLookup()
    cache = o.draft_cache or PromptCache.for_model(
        o.draft_model, max_kv_size=o.max_kv_size, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size
    )
    return DraftModel(o.draft_model, gen.model, gen.sampling, gen.sampler, cache)


class ModeChooser:
    """Speculate only while it beats plain decoding. Both throughputs are measured
    on this very generation (a verification pass over k+1 tokens is far from free
    on a CPU, and a drafter's luck changes with the text): after a probe of each,
    the faster mode runs for a period, then the other is probed again. Each time
    the same mode wins again its period doubles, and the period is at least long
    enough that re-probing the loser costs under `overhead` of the time, so a
    drafter far slower than plain decoding is barely tried again."""

    def __init__(self, probe: int = 6, period: int = 32, max_period: int = 1024, overhead: float = 0.05):
        self.probe, self.period, self.max_period, self.overhead = probe, period, max_period, overhead
        self.rates: dict[str, float] = {}
        self._queue = ["speculate", "plain"]
        self._last_best: str | None = None
        self.plain_only = False

    def give_up(self) -> None:
        """Decode plainly from now on (speculation cannot win)."""
        self.plain_only, self._queue = True, []

    def next_phase(self) -> tuple[str, int]:
        if self.plain_only:
            return "plain", self.max_period
        if self._queue:
            return self._queue[0], self.probe
        best = max(self.rates, key=self.rates.get)
        other = "plain" if best == "speculate" else "speculate"
        if best == self._last_best:
            self.period = min(2 * self.period, self.max_period)
        self._last_best = best
        self._queue = [other]
        probe_cost = self.probe * (self.rates[best] / self.rates[other] - 1)  # in best-mode token times
        return best, max(self.period, min(round(probe_cost / self.overhead), self.max_period))

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        if self._queue and self._queue[0] == mode:
            self._queue.pop(0)
        rate = tokens / max(seconds, 1e-9)
        self.rates[mode] = rate if mode not in self.rates else 0.5 * (self.rates[mode] + rate)


def step_seconds(model, x: mx.array) -> float:
    """Wall time of one forward pass over `x`."""
    start = time.perf_counter()
    mx.eval(model(x))
    return time.perf_counter() - start


HOPELESS_DRAFT = 1.5
MIN_JUDGED_STEP = 0.005


def draft_can_win(draft, target, min_seconds: float = 0.01, max_rounds: int = 20) -> bool:
    """A round of k drafts costs k draft steps plus a verification that costs at
    least one target step, and yields at most k+1 tokens: if a draft step is no
    cheaper than a target step, speculation cannot beat plain decoding (e.g. a
    4-bit draft of an f32 target on MLX's CPU backend, whose quantized matmuls are
    slower than BLAS). Single-token steps of both are timed interleaved, best of
    at least three and of `min_seconds` (the first is a warm-up). Only a draft
    clearly slower (by `HOPELESS_DRAFT`) than a target step long enough to time
    reliably (`MIN_JUDGED_STEP`; shorter ones are at the scale of scheduler noise
    and cheap to probe anyway) is ruled out; the chooser judges the rest."""
    x = mx.array([[0]])
    draft_s = target_s = float("inf")
    start = time.perf_counter()
    for i in range(max_rounds):
        draft_s = min(draft_s, step_seconds(draft, x))
        target_s = min(target_s, step_seconds(target, x))
        if i >= 2 and time.perf_counter() - start >= min_seconds:
            break
    return target_s < MIN_JUDGED_STEP or draft_s < HOPELESS_DRAFT * target_s


PLAIN_BURST = 4
# Default most tokens per draft. A lookup draft is free, and verifying 8 tokens
# costs under twice one decode step (memory-bound on every backend); a model
# draft pays per token, so it starts shorter.
LOOKUP_DRAFT, MODEL_DRAFT = 8, 4


def speculate_once(gen, drafter: Drafter, length: DraftLength) -> Iterable:
    """One round: draft, verify in a single forward pass, roll back, emit; with
    nothing to draft, a short burst of pipelined plain decoding instead. The
    cache holds the context but its last token before and after."""
    config, stats = gen.sampling, gen.stats
    context = gen.prompt + gen.generated
    k = min(length.next(), gen.limit - len(gen.generated) - 1)
    drafts, q = drafter.propose(context, k) if k > 0 else ([], None)
    if not drafts:
        burst = max(length.paused, PLAIN_BURST)
        length.skip(burst)
        return gen.plain_tokens(burst)
    fed = [context[-1], *drafts]
    logits = gen.model(mx.array(fed)[None], cache=gen.cache.caches)[0]
    gen.cache.feed(fed)
    p = position_probs(logits, config, context[-config.penalty_window :], drafts)
    n, token = verify(p, drafts, q, gen.sampler)
    gen.cache.trim(len(drafts) - n)
    stats.drafted += len(drafts)
    stats.accepted += n
    stats.rounds += 1
    length.update(len(drafts), n)
    logprobs = logits[: n + 1] - mx.logsumexp(logits[: n + 1], axis=-1, keepdims=True)
    chosen = [*drafts[:n], token]
    values = mx.take_along_axis(logprobs, mx.array(chosen)[:, None], axis=-1)[:, 0].tolist()
    chunks = []
    for i, (t, lp) in enumerate(zip(chosen, values)):
        chunks.append(gen.emit(t, lp, logprobs[i], drafted=i < n))
        if chunks[-1].finish_reason:
            break
    return chunks


def speculative_run(gen, chooser: ModeChooser | None = None) -> Iterator:
    """The generation loop with drafting, switching to plain pipelined decoding
    whenever that measures faster."""
    drafter = make_drafter(gen)
    length = DraftLength(gen.options.num_draft_tokens or (LOOKUP_DRAFT if gen.options.prompt_lookup else MODEL_DRAFT))
    chooser = chooser or ModeChooser()
    todo = gen.begin()
    if gen.limit <= 0:
        yield gen.emit_nothing()
        return
    gen.prefill_body(todo[:-1])
    if isinstance(drafter, DraftModel) and not draft_can_win(drafter.model, gen.model):
        chooser.give_up()
    while True:
        mode, budget = chooser.next_phase()
        start, produced, finished = time.perf_counter(), 0, False
        while produced < budget and not finished:
            batch = gen.plain_tokens(budget) if mode == "plain" else speculate_once(gen, drafter, length)
            for chunk in batch:
                produced += 1
                if chunk.finish_reason:  # measured before the last chunk leaves, so its stats include it
                    finished = True
                    break
                yield chunk
        chooser.record(mode, produced, time.perf_counter() - start)
        gen.stats.plain_tps = chooser.rates.get("plain", 0.0)
        if finished:
            yield chunk
            return
