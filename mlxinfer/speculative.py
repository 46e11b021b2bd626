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
    k = len(drafts)
    x = mx.array(list(drafts), mx.int32)
    px = mx.take_along_axis(p[:k], x[:, None], axis=-1)[:, 0]
    qx = mx.ones_like(px) if q is None else mx.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=sampler.next_key())
    accepted = mx.cumprod((u < px / qx).astype(mx.int32))
    n = int(accepted.sum().item())
    if n == k:
        residual = p[k]
    else:
        draft_row = mx.zeros_like(p[n]).at[drafts[n]].add(1.0) if q is None else q[n]
        residual = mx.maximum(p[n] - draft_row, 0.0)
        residual = mx.where(residual.sum() > 0, residual, p[n])
    token = mx.random.categorical(mx.log(residual), key=sampler.next_key())
    return n, int(token.item())


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
    """Adapts k to the running acceptance: grow after a fully accepted round,
    shrink after a poor one, and pause drafting while even k=1 mostly fails, so a
    bad drafter costs little more than plain decoding."""

    def __init__(self, k_max: int, k_min: int = 1, pause: int = 8):
        self.k_max, self.k_min, self.pause = k_max, k_min, pause
        self.k = min(4, k_max)
        self.rate = 1.0
        self.paused = 0

    def next(self) -> int:
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.rate = 0.8 * self.rate + 0.2 * accepted / proposed
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif accepted < proposed / 2:
            self.k = max(self.k - 1, self.k_min)
        if self.k == self.k_min and self.rate < 0.25:
            self.paused, self.rate = self.pause, 0.5


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
    the faster mode runs for `period` tokens, then the other is probed again; each
    time the same mode wins again its period doubles, so a loser costs ever less."""

    def __init__(self, probe: int = 6, period: int = 32, max_period: int = 512):
        self.probe, self.period, self.max_period = probe, period, max_period
        self.rates: dict[str, float] = {}
        self._queue = ["speculate", "plain"]
        self._last_best: str | None = None

    def next_phase(self) -> tuple[str, int]:
        if self._queue:
            return self._queue[0], self.probe
        best = max(self.rates, key=self.rates.get)
        if best == self._last_best:
            self.period = min(2 * self.period, self.max_period)
        self._last_best = best
        self._queue = ["plain" if best == "speculate" else "speculate"]
        return best, self.period

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        if self._queue and self._queue[0] == mode:
            self._queue.pop(0)
        rate = tokens / max(seconds, 1e-9)
        self.rates[mode] = rate if mode not in self.rates else 0.5 * (self.rates[mode] + rate)


def speculate_once(gen, drafter: Drafter, length: DraftLength) -> list:
    """One round: draft, verify in a single forward pass, roll back, emit. The
    cache holds the context but its last token before and after."""
    config, stats = gen.sampling, gen.stats
    context = gen.prompt + gen.generated
    k = min(length.next(), gen.limit - len(gen.generated) - 1)
    drafts, q = drafter.propose(context, k) if k > 0 else ([], None)
    fed = [context[-1], *drafts]
    logits = gen.model(mx.array(fed)[None], cache=gen.cache.caches)[0]
    gen.cache.feed(fed)
    p = position_probs(logits, config, context[-config.penalty_window :], drafts)
    n, token = verify(p, drafts, q, gen.sampler)
    gen.cache.trim(len(drafts) - n)
    if drafts:
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
    length = DraftLength(gen.options.num_draft_tokens)
    chooser = chooser or ModeChooser()
    todo = gen.begin()
    if gen.limit <= 0:
        yield gen.emit_nothing()
        return
    gen.prefill_body(todo[:-1])
    while True:
        mode, budget = chooser.next_phase()
        start, produced = time.perf_counter(), 0
        while produced < budget:
            batch = gen.plain_tokens(budget) if mode == "plain" else speculate_once(gen, drafter, length)
            for chunk in batch:
                produced += 1
                yield chunk
                if chunk.finish_reason:
                    return
        chooser.record(mode, produced, time.perf_counter() - start)
