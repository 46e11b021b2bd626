"""The text layer: one sequence's tokens become `Chunk`s the same way whatever produced them (plain,
speculative or batched decoding): streaming detokenizer, thinking apart from the answer, stop
strings, EOS, limits, tool calls read from the reply, and timing stats."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..models.prompt_cache import PromptCache
from ..decode.sources import Score, Stats, Token
from .options import GenerationOptions
from ..text.reasoning import ChannelSplitter, Reasoning
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolCall, ToolPlan


@dataclass(frozen=True)
class PromptToken:
    """One token of an echoed prompt: its id, the text it adds, and (when the prompt is scored)
    its log-probability given the tokens before it with the most likely tokens there. The first
    token has none: nothing comes before it."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Chunk:
    text: str
    token: int | None
    logprob: float | None
    finish_reason: str | None
    stats: Stats
    top_logprobs: list[tuple[int, float]] | None = None
    drafted: bool = False
    error: str | None = None  # why a sequence ended with finish_reason "error" (batch engine)
    tool_calls: list[ToolCall] | None = None  # on the last chunk of a reply that called tools
    content: str | None = None  # with tool_calls: the reply's text outside the calls
    reasoning: str = ""  # thinking this token added (a reasoning model's <think> part); `text` is the answer only
    stop_sequence: str | None = None  # the stop string that ended the reply (Anthropic's API names it)
    prompt: list[PromptToken] | None = None  # echo: the prompt's tokens, on a first chunk whose `text` is the prompt
    index: int = 0  # which of the request's `n` choices this chunk belongs to


class StopMatcher:
    """Holds back text that might be the start of a stop string, so neither a
    stop string nor a prefix of one that turns out to be one is ever emitted.

    The text so far is the concatenation of every push; a push that completes a
    stop string emits the text before the earliest-starting one and drops the rest.
    An Aho-Corasick automaton over the (non-empty) stop strings reads each character
    once, whatever their number and length: its state is the longest suffix of the
    text that is a prefix of some stop, which is exactly what must be held back.
    Reading n characters costs at most 2n moves (`moves` counts them), so a push
    costs what it brings, not what is held back or how long the stops are. `matched` is the
    stop string the last push hit (the earliest-starting one; of those, the shortest)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._goto: list[dict[str, int]] = [{}]  # trie edges; node 0 is the empty prefix
        self._depth = [0]  # each node's prefix length
        self._ends = [""]  # the longest stop that ends the node's prefix ("": none)
        for stop in self.stops:
            self._insert(stop)
        self._fail = self._failure_links()
        self._longest = max((len(s) for s in self.stops), default=0)
        self._state = 0
        self._held: collections.deque[str] = collections.deque()  # the last `_depth[_state]` characters read,
        self._skip = 0  # in pieces, less the first `_skip` characters of the first piece (already released)
        self.moves = 0
        self.matched: str | None = None

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = self._goto[node][ch] = len(self._goto)
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._ends.append("")
            node = nxt
        self._ends[node] = stop

    def _failure_links(self) -> list[int]:
        """Each node's longest proper suffix that is also a node, breadth first; a node's
        `_ends` also takes the stops that end its suffixes."""
        fail = [0] * len(self._goto)
        queue = collections.deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                link = fail[node]
                while link and ch not in self._goto[link]:
                    link = fail[link]
                fail[child] = self._goto[link].get(ch, 0)
                self._ends[child] = self._ends[child] or self._ends[fail[child]]
                queue.append(child)
        return fail

    def _step(self, state: int, ch: str) -> int:
        goto, fail = self._goto, self._fail
        while True:
            self.moves += 1
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if not state:
                return 0
            state = fail[state]

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.matched = None
        if not self.stops:
            return self.flush() + text, False
        held = self._depth[self._state]
        state, first = self._state, None  # first: where the earliest-starting stop found so far starts
        for i, ch in enumerate(text):
            state = self._step(state, ch)
            if self._ends[state]:
                start = i + 1 - len(self._ends[state])
                if first is None or start < first:
                    first, self.matched = start, self._ends[state]
            if first is not None and i + 1 - first >= self._longest:
                break  # a stop ending later would be longer than the longest to start before `first`
        if first is not None:  # `first` counts from the start of `text`; negative reaches into the held text
            out = self._release(held + first) if first < 0 else self.flush() + text[:first]
            self._held.clear()
            self._skip = self._state = 0
            return out, True
        self._state = state
        if text:
            self._held.append(text)
        return self._release(held + len(text) - self._depth[state]), False

    def _release(self, n: int) -> str:
        """The first n held characters (the rest may still begin a stop); a piece released
        in parts is sliced, never copied whole again."""
        out = []
        while n:
            piece = self._held[0]
            take = min(n, len(piece) - self._skip)
            out.append(piece[self._skip : self._skip + take])
            self._skip += take
            n -= take
            if self._skip == len(piece):
                self._held.popleft()
                self._skip = 0
        return "".join(out)

    def flush(self) -> str:
        out = self._release(self._depth[self._state])
        self._state = 0
        return out


def top_logprobs(logprobs: mx.array, k: int) -> list[tuple[int, float]] | None:
    """The `k` most likely tokens of a step and their log-probabilities (None for k = 0).
    Tokens that could not be drawn (-inf: masked out by a response format) are no
    alternatives, and no JSON can carry their -inf: with fewer legal tokens, fewer entries."""
    if not k:
        return None
    best = mx.argsort(-logprobs)[:k]
    return [(t, lp) for t, lp in zip(best.tolist(), logprobs[best].tolist()) if math.isfinite(lp)]


class TextStream:
    """One sequence's tokens → chunks: streamed text, thinking told apart from the answer
    (`reasoning`: how, for a thinking model), stop strings and tool calls on the answer
    only, EOS, limits, stats. Its time to first token counts from `start` (default: now); its
    chunks carry `index`, the choice it is of a request's n."""

    def __init__(self, tokenizer: Tokenizer, options: GenerationOptions, stats: Stats, limit: int,
                 cache: PromptCache, start: float | None = None, reasoning: Reasoning | None = None,
                 index: int = 0):
        self.options, self.stats, self.limit, self.cache, self.index = options, stats, limit, cache, index
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer()
        self.split = reasoning.splitter() if reasoning is not None else None
        self.stop = StopMatcher(options.stop)
        self.eos = set() if options.ignore_eos else set(tokenizer.eos_token_ids)
        self.generated = 0
        self.start = time.perf_counter() if start is None else start
        self.first_token_at = self.start

    def emit(self, token: Token) -> Chunk:
        stats = self.stats
        self.generated += 1
        n = self.generated
        if n == 1:
            self.first_token_at = time.perf_counter()
            stats.ttft = self.first_token_at - self.start
            stats.prefill_tps = stats.prefill_tokens / max(stats.ttft, 1e-9)
        else:
            stats.decode_tps = (n - 1) / max(time.perf_counter() - self.first_token_at, 1e-9)
        stopped_by_eos = token.id in self.eos
        thinking, answer = ("", "") if stopped_by_eos else self._parts(self.detok.add(token.id))
        text, hit = self.stop.push(answer)
        finish = "stop" if (stopped_by_eos or hit) else ("length" if n >= self.limit else None)
        if finish and not hit:
            more, rest = self._rest()
            thinking, text = thinking + more, text + rest
        stats.generated_tokens = n
        if finish:
            self._finish(finish)
        return Chunk(text, token.id, token.logprob, finish, stats, top_logprobs(token.logprobs, self.options.logprobs),
                     token.drafted, reasoning=thinking, stop_sequence=self.stop.matched, index=self.index)

    @property
    def addressed(self) -> list[tuple[str, str]] | None:
        """(recipient, body) of each message the reply addressed to a tool (harmony's calls,
        kept out of the text); None when the reply is not split (its text holds them)."""
        if self.split is None:
            return None
        return self.split.calls if isinstance(self.split, ChannelSplitter) else []

    def _parts(self, text: str) -> tuple[str, str]:
        """(thinking, answer) in newly decoded text."""
        return self.split.push(text) if self.split is not None else ("", text)

    def _rest(self) -> tuple[str, str]:
        """(thinking, answer) held back at the end of a sequence: by the detokenizer, the
        reasoning split and the stop matcher."""
        thinking, answer = self._parts(self.detok.finalize())
        if self.split is not None:
            more, tail = self.split.flush()
            thinking, answer = thinking + more, answer + tail
        return thinking, self.stop.push(answer)[0] + self.stop.flush()

    def prompt(self, ids: Sequence[int], scores: Sequence[Score] | None = None) -> Chunk:
        """The echoed prompt as one chunk: its text, and each token with the text it adds (the
        pieces join to the text) and, when `scores` (one per token after the first) are given,
        its log-probability and the most likely tokens at its position."""
        detok = self.tokenizer.detokenizer()
        pieces = [detok.add(t) for t in ids]
        pieces[-1] += detok.finalize()
        scored = [None, *scores] if scores is not None else [None] * len(ids)
        tokens = [PromptToken(t, piece, s.logprob if s else None, s.top_logprobs if s else None)
                  for t, piece, s in zip(ids, pieces, scored)]
        return Chunk("".join(pieces), None, None, None, self.stats, prompt=tokens, index=self.index)

    def _finish(self, reason: str) -> None:
        self.stats.finish_reason = reason
        self.stats.cache_bytes = self.cache.nbytes
        self.stats.peak_memory = mx.get_peak_memory()

    def end(self, reason: str) -> Chunk:
        """The last chunk of a sequence that ends without a token of its own: nothing may
        be generated ("length": max_tokens=0 or a full context), or it was cancelled;
        text held back for a possible stop string is released."""
        self._finish(reason)
        thinking, text = self._rest() if self.generated else ("", "")
        return Chunk(text, None, None, reason, self.stats, reasoning=thinking, index=self.index)


def read_tool_calls(chunk: Chunk, reply: str, tools: ToolPlan | None,
                    addressed: list[tuple[str, str]] | None = None) -> Chunk:
    """The last chunk of a reply, with the calls it made (finish_reason "tool_calls"): read
    from its text, or `addressed` to them (`TextStream.addressed`)."""
    if tools is None or chunk.finish_reason not in ("stop", "length"):
        return chunk
    content, calls = tools.parse(reply, addressed)
    if not calls:
        return chunk
    chunk.stats.finish_reason = "tool_calls"
    return dataclasses.replace(chunk, finish_reason="tool_calls", tool_calls=calls, content=content)
