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
from typing import Iterator, Protocol, Sequence

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import kernels
from ..models.prompt_cache import PromptCache
from ..text.constrain import Constraint, masked
from .sources import NO_TOKEN, ConstrainedDecoder, PlainDecoder, Stats, Token, chosen_logprobs, drawn
from ..base.errors import InvalidOptionError
from .sample import Sampler


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], mx.array | None]:
        """Up to k tokens to follow `context`, and their draft distributions [n, V]
        (None for a deterministic drafter)."""


def verify(p: mx.array, drafts: Sequence[int], q: mx.array | None, sampler: Sampler) -> tuple[int, int]:
    """How many drafts the target accepts, and the token it emits after them.

    p: target distributions [k+1, V] (position i scores draft i; row k is the
    bonus); q: draft distributions [k, V], or None for one-hot drafts.
    """
    u = mx.random.uniform(shape=(len(drafts) + 1,), key=sampler.next_key())
    n, token = kernels.verify(p, drafts, q, u).tolist()
    if p[n].max().item() <= 0:  # the target's distribution there is empty: no token was chosen
        token = NO_TOKEN
    return n, drawn(token)


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


class PredictedOutput:
    """Drafts from the output the caller expects (OpenAI's Predicted Outputs: the file an
    edit rewrites, say), followed through it as the reply goes. Before the reply's first
    token the prediction's beginning is proposed; after it, what follows the place in the
    prediction where the reply's last n tokens occur, n from `max_ngram` down to 1. A reply
    runs through its prediction in order, so the place chosen is the first at or after
    where the reply was last found (the cursor), else the last one before it. Short matches
    are ambiguous (code repeats `=`, `(`, ` None` everywhere), so one shorter than
    `max_ngram` counts only within `reach` tokens after the cursor: that is where a reply
    rejoins its prediction after a small edit (a renamed variable); after a larger one it
    is found again by a full-length match. Where the reply departs from the prediction
    nothing matches and tokens are decoded plainly. `prompt_tokens`: where the reply
    starts in the context."""

    def __init__(self, predicted: Sequence[int], prompt_tokens: int, max_ngram: int = 4, reach: int = 32):
        self.ids = np.asarray(predicted, dtype=np.int64)
        self.start, self.max_ngram, self.reach = prompt_tokens, max_ngram, reach
        self.cursor = 0  # where in the prediction the reply was last found to end

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        reply = np.asarray(context[self.start :], dtype=np.int64)
        if not len(reply):
            return self.ids[:k].tolist(), None
        for n in range(min(self.max_ngram, len(reply), len(self.ids)), 0, -1):
            windows = sliding_window_view(self.ids, n)
            ends = np.flatnonzero((windows == reply[-n:]).all(axis=1)) + n
            if n < self.max_ngram:
                ends = ends[(ends >= self.cursor) & (ends <= self.cursor + self.reach)]
            if len(ends):
                ahead = ends[ends >= self.cursor]
                self.cursor = int(ahead[0] if len(ahead) else ends[-1])
                return self.ids[self.cursor : self.cursor + k].tolist(), None
        return [], None


class DraftModel:
    """A small model sharing the target's vocabulary, with its own cache kept in
    step with the accepted tokens (trimmed back on rejection). It draws with the
    target's sampler (its filters, penalty history and random stream) and, under a
    constraint, from its distribution masked to the legal tokens: a draft is then
    always legal and q is the distribution it was really drawn from, which the
    rejection sampling needs to stay exact."""

    def __init__(self, model, target, sampler: Sampler, cache: PromptCache, constraint: Constraint | None = None):
        if model.config.vocab_size != target.config.vocab_size:
            raise InvalidOptionError(
                f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from the target's "
                f"({target.config.vocab_size}); use a draft from the same model family and tokenizer"
            )
        self.model, self.sampler, self.cache, self.constraint = model, sampler, cache, constraint

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], mx.array]:
        logits = self.cache.run(self.model, self.cache.prepare(context))[-1:]
        tokens, probs = [], []
        for i in range(k):
            if self.constraint is not None:
                logits = masked(logits, self.constraint.mask())
            q = self.sampler.distribution(logits, mx.concatenate(tokens) if tokens else ())
            token = mx.random.categorical(mx.log(q), key=self.sampler.next_key())
            tokens.append(token)
            probs.append(q)
            if self.constraint is not None:
                self.constraint.accept(token.item())
            if i + 1 < k:
                logits = self.cache.run(self.model, token)[-1:]
        if self.constraint is not None:
            self.constraint.rollback(len(tokens))
        drafted = mx.concatenate(tokens)
        q_all = mx.concatenate(probs, axis=0)
        mx.eval(drafted, q_all)
        return drafted.tolist(), q_all


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


def make_drafter(model, sampler: Sampler, draft_model=None, draft_cache: PromptCache | None = None,
                 constraint: Constraint | None = None, **cache_options) -> Drafter:
    """A draft model (with `draft_cache`, or a new cache with `cache_options`), else prompt lookup."""
    if draft_model is None:
        return PromptLookup()
    cache = draft_cache or PromptCache.for_model(draft_model, **cache_options)
    return DraftModel(draft_model, model, sampler, cache, constraint)


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

    def estimate(self, mode: str, tokens: int, seconds: float) -> float:
        """The rate `record` would keep for `mode` if the phase ended now."""
        rate = tokens / max(seconds, 1e-9)
        return rate if mode not in self.rates else 0.5 * (self.rates[mode] + rate)

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        if self._queue and self._queue[0] == mode:
            self._queue.pop(0)
        self.rates[mode] = self.estimate(mode, tokens, seconds)


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
# A prediction is meant to be the output itself: its drafts may run longer.
PREDICTION_DRAFT = 16


def drafting_context(tokens: Sequence[int], image_token_id: int | None) -> list[int]:
    """The context as a drafter reads it. After a prompt with images the cache lists each image's
    tokens as the image's key (negative: never a token id), which no drafter can embed or propose;
    a drafter sees the image placeholder id there instead, the prompt's text as it was rendered."""
    if image_token_id is None:
        return list(tokens)
    return [t if t >= 0 else image_token_id for t in tokens]


class SpeculativeDecoder:
    """Up to `count` tokens by drafting and verifying, switching to plain pipelined
    decoding whenever that measures faster (`ModeChooser`). Like every token source it
    starts from a cache holding the context but its `last` token, and keeps it so.
    Counts drafted/accepted tokens, rounds and the plain rate in `stats`."""

    def __init__(self, model, cache: PromptCache, sampler: Sampler, drafter: Drafter, last: int, count: int,
                 stats: Stats, max_draft: int, chooser: ModeChooser | None = None,
                 constraint: Constraint | None = None):
        self.model, self.cache, self.sampler, self.drafter = model, cache, sampler, drafter
        self.constraint = constraint
        self.last, self.count, self.stats = last, count, stats
        self.length = DraftLength(max_draft)
        self.chooser = chooser or ModeChooser()
        self._phase: _Phase | None = None
        self._judged = False

    def _plain(self, count: int) -> Iterator[Token]:
        if self.constraint is not None:
            source = ConstrainedDecoder(self.model, self.cache, self.sampler, self.constraint, self.last, count)
        else:
            source = PlainDecoder(self.model, self.cache, self.sampler, self.last, count)
        for token in source:
            self.last = token.id
            yield token

    def _round(self, remaining: int) -> Iterator[Token]:
        """One round: draft, verify in a single forward pass, roll back, emit; with
        nothing to draft, a short burst of plain decoding instead."""
        k = min(self.length.next(), remaining - 1)
        context = [*drafting_context(self.cache.tokens, self.model.image_token_id), self.last]
        drafts, q = self.drafter.propose(context, k) if k > 0 else ([], None)
        if self.constraint is not None:  # a draft the grammar forbids would be rejected: cut it before verifying
            legal = self.constraint.valid_prefix(drafts)
            drafts, q = drafts[:legal], (q[:legal] if q is not None else None)
        if not drafts:
            burst = min(max(self.length.paused, PLAIN_BURST), remaining)
            self.length.skip(burst)
            yield from self._plain(burst)
            return
        logits = self.cache.run(self.model, [self.last, *drafts])
        if self.constraint is not None:
            logits = masked(logits, self._masks(drafts))
        n, token = verify(self.sampler.distributions(logits, drafts), drafts, q, self.sampler)
        self.cache.trim(len(drafts) - n)
        chosen = [*drafts[:n], token]
        self.sampler.accept(chosen)
        if self.constraint is not None:
            for t in chosen:
                self.constraint.accept(t)
        self.stats.drafted += len(drafts)
        self.stats.accepted += n
        self.stats.rounds += 1
        self.length.update(len(drafts), n)
        chosen_lp, logprobs = chosen_logprobs(logits[: n + 1], mx.array(chosen))
        values = chosen_lp.tolist()
        self.last = token
        for i, (t, lp) in enumerate(zip(chosen, values)):
            yield Token(t, lp, logprobs[i], drafted=i < n)

    def _masks(self, drafts: Sequence[int]) -> mx.array:
        """The legal tokens [k+1, V] after each prefix of the drafts (the grammar is walked
        forward through them, then back)."""
        rows = []
        for t in drafts:
            rows.append(self.constraint.allowed())
            self.constraint.accept(t)
        rows.append(self.constraint.allowed())
        self.constraint.rollback(len(drafts))
        return mx.array(np.stack(rows))

    def __iter__(self) -> Iterator[Token]:
        produced = 0
        while produced < self.count:
            for token in self.burst(self.count - produced):
                produced += 1
                yield token
        self.pause(record=True)

    def burst(self, remaining: int) -> Iterator[Token]:
        """The next stretch of at most `remaining` tokens, ending where the cache holds the
        context but `self.last`: a draft-and-verify round, or the plain decoding of the
        current plain phase. The chooser's phases run across bursts, so a caller that
        decodes this sequence some other way in between (the batch engine, when other
        sequences join) calls `pause` first and the next burst starts a fresh phase."""
        if not self._judged:
            self._judged = True
            if isinstance(self.drafter, DraftModel) and not draft_can_win(self.drafter.model, self.model):
                self.chooser.give_up()
        if self._phase is None:
            self._phase = _Phase(*self.chooser.next_phase(), time.perf_counter())
        phase = self._phase
        if phase.mode == "plain":
            tokens = self._plain(min(phase.budget - phase.done, remaining))
        else:
            tokens = self._round(remaining)
        for token in tokens:
            phase.done += 1
            if phase.mode == "plain":  # so the stats of a last token include the phase it ends
                self.stats.plain_tps = self.chooser.estimate("plain", phase.done, time.perf_counter() - phase.start)
            yield token
        if phase.done >= phase.budget:
            self.pause(record=True)

    def pause(self, record: bool = False) -> None:
        """End the current phase, keeping its measured rate only when `record` (a phase
        interrupted by other work has no meaningful rate)."""
        phase, self._phase = self._phase, None
        if phase is not None and record and phase.done:
            self.chooser.record(phase.mode, phase.done, time.perf_counter() - phase.start)
            self.stats.plain_tps = self.chooser.rates.get("plain", 0.0)


@dataclass
class _Phase:
    """A stretch of one mode the chooser asked for: `budget` tokens, `done` so far, since `start`."""

    mode: str
    budget: int
    start: float
    done: int = 0
