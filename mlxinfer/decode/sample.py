"""Sampling: composable filters on logits, and a seeded sampler built from a config.

Each filter maps logits [B, V] to logits with excluded tokens at -inf, so they
compose in any order and the distribution after filtering is simply softmax.
Order (as transformers applies them): penalties and bias, temperature, top-k,
top-p, min-p.

Every option is bounded where float32 would overflow (see `SamplingConfig`), and
rows that are not finite anyway (the model's own logits) are drawn from as
`kernels.sampling.finite` reads them: a row with nothing to draw from gives
`NO_TOKEN`, which the token sources turn into an error for that sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .. import kernels
from ..base.checks import integer, number, token_ids
from ..base.errors import InvalidOptionError
from ..kernels.sampling import NEG_INF, NO_TOKEN, Filter, SamplingParams, empty_rows, finite, warp_chain

SEED_MAX = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed
# The step between the seeds of a request's choices: 2^64 over the golden ratio (splitmix64's
# increment), so the choices of nearby seeds (seed 5 choice 1, seed 6 choice 0) do not coincide.
CHOICE_SEED_STEP = 0x9E3779B97F4A7C15
# A temperature this low already picks the argmax (ask for 0 instead); at the maximum a model's
# logits, which span tens, are nearly flat already (OpenAI allows 0..2).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0
# OpenAI's ranges: presence and frequency penalties in [-2, 2]; at most 300 biases, each in
# [-100, 100] (-100 already bans a token, +100 forces it).
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT, LOGIT_BIAS_ENTRIES = 100.0, 300
# Repetition multiplies or divides a seen token's logit: CTRL uses 1.2, llama.cpp defaults to
# 1.1; a factor past 100 either way only amplifies float32 logits towards overflow.
REPETITION_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_window: int = 64
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        """Types and ranges, so a bad value fails here and not inside MLX (token ids in
        `logit_bias` need the model's vocabulary: `check_vocab`)."""
        number("temperature", self.temperature, f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
               lambda x: x == 0 or MIN_TEMPERATURE <= x <= MAX_TEMPERATURE)
        number("top_p", self.top_p, "in (0, 1]", lambda x: 0 < x <= 1)
        integer("top_k", self.top_k, 0)
        number("min_p", self.min_p, "in [0, 1)", lambda x: 0 <= x < 1)
        low, high = REPETITION_RANGE
        number("repetition_penalty", self.repetition_penalty, f"in [{low:g}, {high:g}]", lambda x: low <= x <= high)
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, getattr(self, name), f"in [{-PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]",
                   lambda x: abs(x) <= PENALTY_LIMIT)
        integer("penalty_window", self.penalty_window, 1)
        if self.seed is not None:
            integer("seed", self.seed, 0, SEED_MAX)
        if not isinstance(self.logit_bias, dict):
            raise InvalidOptionError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        if len(self.logit_bias) > LOGIT_BIAS_ENTRIES:
            raise InvalidOptionError(f"logit_bias has {len(self.logit_bias)} entries; at most {LOGIT_BIAS_ENTRIES} "
                                     "are allowed")
        for token, bias in self.logit_bias.items():
            integer("a logit_bias key (a token id)", token, 0)
            number(f"logit_bias[{token}]", bias, f"in [{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
                   lambda x: abs(x) <= LOGIT_BIAS_LIMIT)

    def check_vocab(self, vocab_size: int) -> None:
        """Every `logit_bias` key is a token id of a model with `vocab_size` tokens."""
        token_ids(self.logit_bias, vocab_size, "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, index: int) -> SamplingConfig:
        """The config of choice `index` of a request with n choices: with seed s it draws with
        `choice_seed(s, index)` (choice 0 with s itself, so n=1 and the first of n agree);
        without a seed every choice draws from the shared random state, so each differs."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=choice_seed(self.seed, index))

    @property
    def warp(self) -> SamplingParams:
        """What the fused sampling kernel applies after penalties and bias."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0)


def choice_seed(seed: int, index: int) -> int:
    """The seed choice `index` draws with when the request's seed is `seed`:
    (seed + index * 0x9E3779B97F4A7C15) mod 2^64."""
    return (seed + index * CHOICE_SEED_STEP) % (SEED_MAX + 1)


def penalties(history: mx.array, repetition: float, presence: float, frequency: float) -> Filter:
    """Penalise tokens in `history` [B, n]: repetition divides positive logits and
    multiplies negative ones (CTRL); presence and frequency subtract (OpenAI)."""

    def apply(logits: mx.array) -> mx.array:
        B, V = logits.shape
        counts = mx.zeros((B, V), mx.float32)
        counts = counts.at[mx.arange(B)[:, None], history].add(1.0)
        seen = counts > 0
        if repetition != 1:
            scaled = mx.where(logits > 0, logits / repetition, logits * repetition)
            logits = mx.where(seen, scaled, logits)
        return logits - presence * seen - frequency * counts

    return apply


def logit_bias(bias: dict[int, float]) -> Filter:
    ids = mx.array(list(bias.keys()))
    values = mx.array(list(bias.values()), mx.float32)
    return lambda logits: logits.at[:, ids].add(values.astype(logits.dtype))


def adjustments(config: SamplingConfig, history: mx.array | None = None) -> list[Filter]:
    """Penalties over the recent-token history, and the logit bias."""
    chain: list[Filter] = []
    if config.penalised and history is not None and history.size:
        chain.append(penalties(history, config.repetition_penalty, config.presence_penalty, config.frequency_penalty))
    if config.logit_bias:
        chain.append(logit_bias(config.logit_bias))
    return chain


def warpers(config: SamplingConfig) -> list[Filter]:
    """Temperature and the truncation filters (none when greedy)."""
    return [] if config.greedy else warp_chain(config.warp)


def apply_filters(logits: mx.array, chain: Sequence[Filter]) -> mx.array:
    logits = logits.astype(mx.float32)
    for f in chain:
        logits = f(logits)
    return logits


def greedy(logits: mx.array) -> mx.array:
    """Tokens [B]: each row's argmax (the first +inf where there is one; NaN never wins), or
    `NO_TOKEN` for a row with nothing to choose."""
    logits = mx.where(mx.isnan(logits), NEG_INF, logits)  # argmax already takes the first +inf
    best = logits.argmax(axis=-1)
    top = mx.take_along_axis(logits, best[:, None], axis=-1)[:, 0]  # every pass over the row costs per token
    return mx.where(top == NEG_INF, NO_TOKEN, best.astype(mx.int32))


def filtered_probs(logits: mx.array, config: SamplingConfig, history: mx.array | None = None) -> mx.array:
    """The distribution a sampler draws from (one-hot at the argmax when greedy); all zero
    for a row with nothing to draw from."""
    adjusted = finite(apply_filters(logits, adjustments(config, history)))
    if config.greedy:
        return (mx.arange(adjusted.shape[-1]) == greedy(adjusted)[:, None]).astype(mx.float32)
    probs = mx.softmax(apply_filters(adjusted, warpers(config)), axis=-1, precise=True)
    return mx.where(empty_rows(adjusted)[:, None], 0.0, probs)


class Sampler:
    """Draws next tokens from logits under a config; the same seed gives the same tokens.

    It owns the penalty history: the last `penalty_window` tokens of the context it was
    started with plus every token it drew or was told about (`accept`), so penalties see
    the same window whichever token source drives it. One sampler serves one sequence.

    Penalties and bias change with the history every step and stay eager ops;
    temperature, the truncation filters and the draw are one fused step
    (`kernels.sample`: a Metal kernel, or its compiled reference)."""

    def __init__(self, config: SamplingConfig, context: Sequence[int] = ()):
        self.config = config
        self._key = mx.random.key(config.seed) if config.seed is not None else None
        self._history = mx.array(list(context[-config.penalty_window :]), mx.uint32)

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that changes the logits: a draw is the argmax, whoever's rows sit beside it."""
        return self.config.greedy and not self.config.penalised and not self.config.logit_bias

    def next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, sub = mx.random.split(self._key)
        return sub

    def _window(self, following: Sequence[int] | mx.array = ()) -> mx.array | None:
        """The history [1, n] a penalty sees, extended by `following` (tokens not yet accepted)."""
        if not self.config.penalised:
            return None
        history = self._history
        if len(following):
            extra = following if isinstance(following, mx.array) else mx.array(list(following), mx.uint32)
            history = mx.concatenate([history, extra.astype(mx.uint32)])
        return history[-self.config.penalty_window :][None]

    def accept(self, tokens: Sequence[int] | mx.array) -> None:
        """Tokens emitted without this sampler's draw (accepted drafts) join the history."""
        if self.config.penalised and len(tokens):
            self._history = self._window(tokens)[0]

    def distribution(self, logits: mx.array, following: Sequence[int] | mx.array = ()) -> mx.array:
        """The distribution [1, V] a draw would use, after the history and `following`."""
        return filtered_probs(logits, self.config, self._window(following))

    def distributions(self, logits: mx.array, following: Sequence[int]) -> mx.array:
        """Distributions [n, V] for n consecutive positions, position i seeing the history
        and `following[:i]` (speculative verification)."""
        if not self.config.penalised:
            return filtered_probs(logits, self.config)
        rows = [self.distribution(logits[i : i + 1], following[:i]) for i in range(logits.shape[0])]
        return mx.concatenate(rows, axis=0)

    def __call__(self, logits: mx.array) -> mx.array:
        """Tokens [B] for logits [B, V] (B is 1 when penalised: the history is one sequence's);
        `NO_TOKEN` for a row with nothing to draw from (`decode.drawn` reports it)."""
        logits = apply_filters(logits, adjustments(self.config, self._window()))
        if self.config.greedy:
            token = greedy(logits)
        else:
            u = mx.random.uniform(shape=logits.shape[:1], key=self.next_key())
            token = kernels.sample(logits, u, self.config.warp)
        self.accept(mx.maximum(token, 0))  # NO_TOKEN ends the sequence; as an index it would scatter out of range
        return token
