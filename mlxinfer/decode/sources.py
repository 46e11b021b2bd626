"""Token sources: what produces a sequence's tokens, below the text layer.

Plain decoding (here), speculative decoding (`speculative`) and batched decoding
(`batch`) are peers: each yields `Token`s — the id, its log-probability, the whole
log-probability row (for top-k logprobs, read only when asked for) and whether a
drafter proposed it. Streaming text, stop strings, EOS, limits and timing live one
layer up (`generate`), shared by all of them.

A source starts from a cache that holds the context but its last token, and is
given that token: the next forward pass runs it and yields what follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx

from ..models.prompt_cache import PromptCache
from ..text.constrain import Constraint, masked
from ..base.errors import SamplingError
from ..kernels.cpu_logsumexp import logsumexp
from .sample import NO_TOKEN, Sampler, finite


@dataclass
class Stats:
    """Numbers for one generation, updated as it runs: the text layer times it, the
    token source counts what it prefilled and drafted."""

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
    note: str = ""
    # each prefill chunk as it ran: (tokens, seconds from submission to its start, seconds it took); the
    # prompt's last token is not in one: it runs with the first decode step, which makes the first token
    prefill_chunks: list[tuple[int, float, float]] = field(default_factory=list)

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
class Token:
    """One generated token as every source yields it."""

    id: int
    logprob: float
    logprobs: mx.array  # log-probabilities [V] of the step that chose it (lazy)
    drafted: bool = False


def chosen_logprobs(logits: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Log-probabilities [B] of `tokens` [B] under `logits` [B, V], and the whole rows
    [B, V] — lazily: the rows cost a pass over the vocabulary and are evaluated only
    when someone reads them (top-k logprobs). The logits are read as the sampler reads
    them (`finite`), so a drawn token's log-probability is finite; masked-out tokens
    are -inf in the rows."""
    logits = finite(logits)
    rows = logits - logsumexp(logits)
    return mx.take_along_axis(rows, mx.maximum(tokens, 0)[:, None], axis=-1)[:, 0], rows


# The log-probability reported for a token the model gives no chance at all (-inf, which JSON
# cannot carry): float32's lowest finite value, still below every real log-probability.
LOWEST_LOGPROB = float(mx.finfo(mx.float32).min)


@dataclass(frozen=True)
class Score:
    """A prompt token's log-probability given the tokens before it, and the `top` most likely
    tokens at its position with theirs (best first)."""

    logprob: float
    top_logprobs: list[tuple[int, float]]


def scored_prefill(model, cache: PromptCache, tokens: Sequence[int], following: Sequence[int],
                   top: int) -> list[Score]:
    """Prefill one chunk of a prompt and score what follows each of its tokens (`following[i]`,
    the prompt's next token): a plain prefill never runs the LM head, this one runs it for
    every position, takes the float32 log-softmax over the whole vocabulary (as evaluators
    compute a log-likelihood) and reads the chosen and the `top` best entries of each row."""
    logits = finite(cache.run(model, tokens).astype(mx.float32))
    rows = logits - logsumexp(logits)
    chosen = mx.take_along_axis(rows, mx.array([int(t) for t in following])[:, None], axis=-1)[:, 0]
    k = min(top, rows.shape[-1])
    best = mx.argpartition(-rows, k - 1, axis=-1)[:, :k] if k else mx.zeros((len(tokens), 0), mx.int32)
    values = mx.take_along_axis(rows, best, axis=-1)
    mx.eval(chosen, best, values, [c.arrays() for c in cache.caches])
    return [Score(lp if lp >= LOWEST_LOGPROB else LOWEST_LOGPROB,  # -inf and NaN (an empty row) alike
                  sorted(((t, v) for t, v in zip(ids, vs) if math.isfinite(v)), key=lambda e: (-e[1], e[0])))
            for lp, ids, vs in zip(chosen.tolist(), best.tolist(), values.tolist())]


def drawn(token: int) -> int:
    """A token id as a sampler drew it; `NO_TOKEN` (the step's distribution was empty) is
    raised as the error that ends the sequence, so it never reaches a tokenizer or grammar."""
    if token == NO_TOKEN:
        raise SamplingError("the sampling distribution is empty: every token's logit is -inf or NaN (the model's "
                            "logits overflowed, or the response format allows no token); the sequence ends here")
    return token


@dataclass
class _Step:
    """One decode step's lazily computed outputs."""

    token: mx.array  # [1]
    logprob: mx.array  # [1]
    logprobs: mx.array  # [1, V], never evaluated unless read


class PlainDecoder:
    """Up to `count` tokens, one forward pass each, pipelined as mlx-lm does: the next
    step's graph is queued before the current token is read, so the device never waits
    on Python. The cache holds the context but its last token before and after (a step
    is only queued when another token may follow)."""

    def __init__(self, model, cache: PromptCache, sampler: Sampler, last: int, count: int):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.last, self.count = last, count

    def _step(self, token: mx.array) -> _Step:
        logits = self.cache.run(self.model, token)[-1:]
        token = self.sampler(logits)
        return _Step(token, *chosen_logprobs(logits, token))

    def __iter__(self) -> Iterator[Token]:
        if self.count <= 0:
            return
        step = self._step(mx.array([self.last]))
        mx.async_eval(step.token, step.logprob)
        for i in range(self.count):
            nxt = None
            if i + 1 < self.count:
                nxt = self._step(step.token)
                mx.async_eval(nxt.token, nxt.logprob)
            yield Token(drawn(step.token.item()), step.logprob.item(), step.logprobs[0])
            if nxt is None:
                return
            step = nxt


class ConstrainedDecoder:
    """Up to `count` tokens held to a `Constraint`: each step's logits are masked to the
    tokens the grammar allows before the sampler sees them (so every filter and penalty
    works on the legal set), and log-probabilities are those of the masked distribution.
    A step's mask needs the token just drawn but its forward pass does not, so the pass
    is started first and the grammar's CPU work (which releases the GIL) runs beside it."""

    def __init__(self, model, cache: PromptCache, sampler: Sampler, constraint: Constraint, last: int, count: int):
        self.model, self.cache, self.sampler, self.constraint = model, cache, sampler, constraint
        self.last, self.count = last, count

    def __iter__(self) -> Iterator[Token]:
        if self.count <= 0:
            return
        logits = self.cache.run(self.model, mx.array([self.last]))[-1:]
        mx.async_eval(logits)
        for i in range(self.count):
            step = masked(logits, self.constraint.mask())
            token = self.sampler(step)
            chosen, logprobs = chosen_logprobs(step, token)
            mx.async_eval(token, chosen)
            if i + 1 < self.count:  # the next pass needs this token's value only once it runs
                logits = self.cache.run(self.model, token)[-1:]
                mx.async_eval(logits)
            self.last = drawn(token.item())
            self.constraint.accept(self.last)
            yield Token(self.last, chosen.item(), logprobs[0])
