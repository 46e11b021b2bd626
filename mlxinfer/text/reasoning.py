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
a closing tag) is held back, as `engine.text_stream.StopMatcher` holds back a possible stop string.
Only a reply that opens its thinking first (or whose prompt opened it) has any: a tag
later in an answer is the answer's text. A model that closes its thinking without having
opened it (older DeepSeek-R1 templates) is not split: telling that apart would mean
holding back the whole reply.

gpt-oss speaks OpenAI's harmony format instead: a reply is a run of messages, each a header
naming its channel and a body, `<|channel|>analysis<|message|>...<|end|>` then
`<|start|>assistant<|channel|>final<|message|>...` (`<|return|>`, an end of sequence, closes
the reply). The `analysis` channel is the thinking; `final`, and `commentary` (what the model
tells the user around tool calls), the answer; the headers and end markers belong to neither
(`ChannelSplitter`). A message whose header names a recipient (`to=functions.get_weather`,
after the channel or before it: `<|channel|>commentary to=functions.get_weather
<|constrain|>json<|message|>{...}<|call|>`) is a tool call: addressed to the tool, not the user,
so its body is neither part; the splitter keeps it with its recipient for `tools` to read.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base.errors import InvalidOptionError
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Tags:
    """The text a model's thinking starts and ends with."""

    open: str
    close: str

    @property
    def marker(self) -> str:
        """What a chat template that thinks this way holds (the closing tag, to cut old thinking
        out of the history or to write an empty block when thinking is off)."""
        return self.close

    def opened_by(self, prompt: str) -> bool:
        """Whether a reply to `prompt` starts inside the thinking."""
        return prompt.rstrip().endswith(self.open)

    def splitter(self, inside: bool) -> Splitter:
        return Splitter(self, inside)


@dataclass(frozen=True)
class Channels:
    """Harmony's markup: a message's header (`<|start|>assistant<|channel|>NAME`, any recipient
    or content type after the name) runs up to `message`; its body up to one of `ends`, or up
    to the next header where a model leaves out `<|end|>`."""

    start: str = "<|start|>"
    channel: str = "<|channel|>"
    message: str = "<|message|>"
    ends: tuple[str, ...] = ("<|end|>", "<|return|>", "<|call|>")
    thinking: str = "analysis"
    recipient: str = "to="  # a header's recipient follows this (a reply's first header may open with it)

    @property
    def marker(self) -> str:
        return self.channel

    def opened_by(self, prompt: str) -> bool:
        return prompt.endswith(f"{self.channel}{self.thinking}{self.message}")

    def splitter(self, inside: bool) -> ChannelSplitter:
        return ChannelSplitter(self, inside)


THINK = Tags("<think>", "</think>")
HARMONY = Channels()
KNOWN: tuple[Tags | Channels, ...] = (THINK, HARMONY)
# OpenAI's reasoning_effort values; "none" and "minimal" turn thinking off where the template can.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SWITCH = "enable_thinking"  # the template variable Qwen3's and SmolLM3's templates read


def tags_for(tokenizer: Tokenizer) -> Tags | Channels | None:
    """How a model whose chat template thinks marks its thinking (the template holds the marker)."""
    template = tokenizer.chat_template or ""
    return next((tags for tags in KNOWN if tags.marker in template), None)


@dataclass(frozen=True)
class Reasoning:
    """How a reply's thinking is told apart: its tags, and whether the prompt left it open."""

    tags: Tags | Channels
    inside: bool

    def splitter(self) -> Splitter | ChannelSplitter:
        return self.tags.splitter(self.inside)

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
    return Reasoning(tags, tags.opened_by(prompt))


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


# Longest header held while waiting for its `<|message|>`; past it the text is the answer (a
# header is a role, a recipient and a content type: a few dozen characters).
MAX_HEADER = 256


class ChannelSplitter:
    """Harmony text pieces in, (thinking, answer) pieces out, as soon as each is certain.

    Between messages text is held while it is, or may become, a header; at its `<|message|>`
    the header routes the body: one addressed to a recipient to `calls` (whole, once it ends:
    a call is read only complete), `analysis` to the thinking, any other channel to the answer.
    A body goes out as it comes except an end that may still be a marker arriving. Text that
    cannot be a header (a model answering without channels) is answer as written."""

    def __init__(self, channels: Channels, inside: bool):
        self.c = channels
        self.channel: str | None = channels.thinking if inside else None  # None: between messages
        self.recipient = ""  # the current message's recipient ("": the user)
        self.calls: list[tuple[str, str]] = []  # (recipient, body) of each addressed message, in order
        self._call = ""  # the body of the addressed message being read
        self._held = ""
        self._bounds = (*channels.ends, channels.start, channels.channel)  # what ends a body
        # what a header opens with; the reply's first may open with its recipient, the prompt
        # having written `<|start|>assistant` (the template renders a call back that way)
        self._opens = (channels.start, channels.channel) + (() if inside else (" " + channels.recipient,))

    def push(self, text: str) -> tuple[str, str]:
        """Returns (thinking, answer) that `text` made certain."""
        self._held += text
        out = ["", ""]
        while self._held:
            if self.channel is None and not self._header():
                break
            if self.channel is not None and not self._body(out):
                break
        return out[0], out[1]

    def _header(self) -> bool:
        """Reads a complete header (True: a body starts), or holds a possible one (False)."""
        head, found, rest = self._held.partition(self.c.message)
        if found and head.startswith(self._opens):
            self.channel, self.recipient = _named(head, self.c.channel), _named(head, self.c.recipient)
            self._held = rest
            self._opens = self._opens[:2]
            return True
        if len(head) <= MAX_HEADER and not found and any(head.startswith(m) or m.startswith(head)
                                                         for m in self._opens):
            return False
        self.channel, self._opens = "", self._opens[:2]  # not a header: an answer without channels
        return True

    def _body(self, out: list[str]) -> bool:
        """Routes the body text now certain; True when the body ended (a header may follow)."""
        at, bound = min(((self._held.find(b), b) for b in self._bounds if b in self._held), default=(-1, ""))
        if at >= 0:
            text, rest = self._held[:at], self._held[at:]
            self._held = rest[len(bound):] if bound in self.c.ends else rest
        else:
            keep = max(_tag_prefix(self._held, b) for b in self._bounds)
            text, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        if self.recipient:
            self._call += text
        else:
            out[0 if self.channel == self.c.thinking else 1] += text
        if at >= 0:
            self._end()
        return at >= 0

    def _end(self) -> None:
        """The message ended: an addressed one is a complete call."""
        if self.recipient:
            self.calls.append((self.recipient, self._call))
        self.channel, self.recipient, self._call = None, "", ""

    def flush(self) -> tuple[str, str]:
        """What is still held once the reply has ended: an unfinished header is dropped (markup,
        not text); what only looked like the start of one, or like a marker at the end of a body,
        is text after all. An addressed message ends with the reply (its `<|call|>` ends both)."""
        held, self._held = self._held, ""
        if self.channel is None:
            return "", "" if held.startswith(self._opens) else held
        if self.recipient:
            self._call += held
            self._end()
            return "", ""
        return (held, "") if self.channel == self.c.thinking else ("", held)


def _named(header: str, marker: str) -> str:
    """The word after `marker` in a header: its channel after `<|channel|>`, its recipient
    after `to=` (none: the answer's channel; the user)."""
    _, found, after = header.partition(marker)
    words = after.replace("<|", " <|").split()
    return words[0] if found and words and not words[0].startswith("<|") else ""


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
