"""Reasoning: a thinking model's thoughts told apart from its answer.

Reasoning models (Qwen3, DeepSeek-R1 distills, SmolLM3) write their thinking between a
pair of tags, `<think>` and `</think>`, before the answer. Every peer (vLLM, llama.cpp,
LM Studio) hands the two out apart; so do we. Whether a reply starts inside the thinking
is read from the prompt: a template like DeepSeek-R1's ends the prompt with an open
`<think>`, so the reply starts in the thinking; Qwen3's lets the model open it itself;
with `enable_thinking=False` Qwen3 writes an empty, closed block into the prompt and the
reply is all answer. The tags themselves belong to neither part, and the newlines around
them are trimmed the way Qwen's template trims them when it renders a reply back
(thinking `strip('\\n')`, answer `lstrip('\\n')`), so a reply kept as its two parts renders
as the model wrote it.

The split is streamed: text that may still turn out to be a tag (or the newlines before
a closing tag) is held back, as `generate.StopMatcher` holds back a possible stop string.
Only a reply that opens its thinking first (or whose prompt opened it) has any: a tag
later in an answer is the answer's text. A model that closes its thinking without having
opened it (older DeepSeek-R1 templates) is not split: telling that apart would mean
holding back the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidOptionError
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Tags:
    """The text a model's thinking starts and ends with (gpt-oss's channels will be another kind)."""

    open: str
    close: str


THINK = Tags("<think>", "</think>")
KNOWN = (THINK,)
# OpenAI's reasoning_effort values; "none" and "minimal" turn thinking off where the template can.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SWITCH = "enable_thinking"  # the template variable Qwen3's and SmolLM3's templates read


def tags_for(tokenizer: Tokenizer) -> Tags | None:
    """The tags of a model whose chat template thinks: one that names the closing tag
    (to cut old thinking out of the history, or to write an empty block when thinking is off)."""
    template = tokenizer.chat_template or ""
    return next((tags for tags in KNOWN if tags.close in template), None)


@dataclass(frozen=True)
class Reasoning:
    """How a reply's thinking is told apart: its tags, and whether the prompt left it open."""

    tags: Tags
    inside: bool

    def splitter(self) -> Splitter:
        return Splitter(self.tags, self.inside)

    def split(self, text: str) -> tuple[str, str]:
        """A whole reply as (thinking, answer)."""
        splitter = self.splitter()
        first, rest = splitter.push(text), splitter.flush()
        return first[0] + rest[0], first[1] + rest[1]


def reasoning_for(tokenizer: Tokenizer, prompt: str) -> Reasoning | None:
    """The split for a reply to `prompt` (its text, or at least its end), or None when the
    model's template does not think."""
    tags = tags_for(tokenizer)
    if tags is None:
        return None
    return Reasoning(tags, prompt.rstrip().endswith(tags.open))


_START, _THINKING, _ANSWER = "start", "thinking", "answer"
# Blank space a reply may open with before its opening tag; more, and the reply is all answer
# (a bound keeps the start's checks from growing with a pathological run of blanks).
MAX_LEAD = 64


class Splitter:
    """Text pieces in, (thinking, answer) pieces out, as soon as each is certain.

    At the start of a reply (`inside` False) text is held while it may still be the
    opening tag after a little blank space; then everything goes to the answer unless the
    tag came. In the thinking, a possible start of the closing tag and the run of newlines
    before it are held (the run as a count: holding costs the same however long it is).
    Newlines opening each part are dropped."""

    def __init__(self, tags: Tags, inside: bool):
        self.tags = tags
        self.state = _THINKING if inside else _START
        self._held = ""  # text not yet known to be thinking or answer (short, but for a reply's opening blanks)
        self._newlines = 0  # in the thinking: newlines held until it is known whether the closing tag follows
        self._leading = True  # the current part has shown nothing yet: its newlines are dropped

    def push(self, text: str) -> tuple[str, str]:
        """Returns (thinking, answer) that `text` made certain."""
        self._held += text
        thinking = answer = ""
        if self.state == _START:
            start = self._held.lstrip()
            if start.startswith(self.tags.open):
                self.state, self._held = _THINKING, start[len(self.tags.open):]
            elif self.tags.open.startswith(start) and len(self._held) - len(start) <= MAX_LEAD:
                return "", ""
            else:
                self.state, self._leading = _ANSWER, False  # no thinking: the answer is as written
        if self.state == _THINKING:
            thinking = self._thinking()
        if self.state == _ANSWER:
            answer, self._held = self._part(self._held), ""
        return thinking, answer

    def _thinking(self) -> str:
        """The thinking now certain; at the closing tag, the switch to the answer."""
        before, found, after = self._held.partition(self.tags.close)
        if found:
            self.state, self._held = _ANSWER, after
            out = self._part(self._run(before.rstrip("\n")))
            self._newlines, self._leading = 0, True
            return out
        sure = before[: len(before) - _tag_prefix(before, self.tags.close)]
        self._held = before[len(sure):]
        text = sure.rstrip("\n")
        if not text:
            self._newlines += len(sure)
            return ""
        out = self._part(self._run(text))
        self._newlines = len(sure) - len(text)
        return out

    def _run(self, text: str) -> str:
        """`text` after the newlines held before it (none when it is empty: they ended the thinking)."""
        return "\n" * self._newlines + text if text else ""

    def _part(self, text: str) -> str:
        if self._leading:
            text = text.lstrip("\n")
            self._leading = not text
        return text

    def flush(self) -> tuple[str, str]:
        """What is still held once the reply has ended: a start that never became the tag is
        answer; thinking that never closed ends without its trailing newlines."""
        held, self._held = self._held, ""
        if self.state == _THINKING:
            out = self._part(self._run(held.rstrip("\n")))
            self._newlines = 0
            return out, ""
        if self.state == _START:
            self.state, self._leading = _ANSWER, False
        return "", self._part(held)


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def thinking_switch(tokenizer: Tokenizer, on: bool) -> dict[str, bool]:
    """Template kwargs that turn thinking on or off (`--think`, `/think`), for a template
    that has the switch; asked of one without it, an error saying so."""
    if tags_for(tokenizer) is None:
        raise InvalidOptionError("this model's chat template does not think, so there is no thinking to turn "
                                 f"{'on' if on else 'off'}")
    if SWITCH not in tokenizer.template_variables:
        raise InvalidOptionError(f"this model's chat template has no switch for thinking ({SWITCH}); it thinks as "
                                 "it was trained to")
    return {SWITCH: on}


def effort_kwargs(tokenizer: Tokenizer, effort: str | None) -> dict[str, object]:
    """Template kwargs for OpenAI's `reasoning_effort` (also Responses' `reasoning.effort` and
    Anthropic's `thinking`): "none" and "minimal" turn thinking off where the template has the
    switch, the other levels turn it on; a template that reads `reasoning_effort` itself
    (gpt-oss) gets it as well. Beyond that a level is a no-op: a thinking model here thinks
    as long as it needs to (max_tokens bounds it)."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise InvalidOptionError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    variables = tokenizer.template_variables
    out: dict[str, object] = {"reasoning_effort": effort} if "reasoning_effort" in variables else {}
    if SWITCH in variables and tags_for(tokenizer) is not None:
        out[SWITCH] = effort not in ("none", "minimal")
    return out
