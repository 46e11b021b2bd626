"""The chat REPL: a thin terminal layer over `ChatSession`.

On a terminal, input comes from prompt_toolkit (line editing, history kept across
sessions, multi-line input with Alt-Enter, pasting, or a block between \"\"\" marks);
piped input is read line by line. Ctrl-C during a reply stops it and keeps what was
said; at the prompt it clears the line; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from ..engine.chat import ChatSession
from ..text.constrain import typed_format
from ..text.tools import describe_call
from ..text.reasoning import SWITCH, tags_for, thinking_switch
from ..base.errors import InvalidOptionError, MlxinferError
from ..text.images import load_image
from ..models.vision import check_takes_images
from .terminal import CYAN, DIM, paint, size, stats_line, typed_text

PROMPT = ">>> "
BLOCK = '"""'
HELP = [
    ("/help", "show this help"),
    ("/reset", "forget the conversation (the system prompt stays)"),
    ("/system TEXT", "set the system prompt (no TEXT: show it)"),
    ("/set NAME VALUE", "change temp, top_p, top_k, min_p or max_tokens (no NAME: show them)"),
    ("/format KIND [X]", "hold replies to: json [SCHEMA|FILE], regex PATTERN, lark GRAMMAR|FILE, off"),
    ("/think on|off", "let a thinking model think before it answers, or not (no argument: show which)"),
    ("/image FILE", "show an image with the next message (repeatable; a vision-language model)"),
    ("/stats", "numbers for the last reply and the cache"),
    ("/undo", "drop the last exchange and roll the cache back"),
    ("/save FILE", "save the conversation and its KV cache"),
    ("/load FILE", "resume a saved conversation"),
    ("/exit", "quit (Ctrl-D works too)"),
]
# Around a reply's thinking, so it reads apart from the answer without colour too (as Ollama shows it).
THINKING, THOUGHT = "Thinking...\n", "\n...done thinking.\n\n"
# /set names -> (option name, type)
SETTINGS: dict[str, tuple[str, type]] = {
    "temp": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "max_tokens": ("max_tokens", int),
}


class LineReader(Protocol):
    def read(self, prompt: str) -> str | None:
        """The next message or command; None at end of input. Ctrl-C raises KeyboardInterrupt."""


def open_block(text: str) -> bool:
    """Inside a \"\"\" block that has not been closed yet."""
    s = text.strip()
    return s.startswith(BLOCK) and not (len(s) >= 2 * len(BLOCK) and s.endswith(BLOCK))


def unwrap(text: str) -> str:
    """A \"\"\" block's contents; any other text as it is."""
    s = text.strip()
    if s.startswith(BLOCK) and s.endswith(BLOCK) and len(s) >= 2 * len(BLOCK):
        return s[len(BLOCK) : -len(BLOCK)].strip("\n")
    return text


def private_file(path: Path) -> None:
    """Create `path` (and its folder) readable by its owner only, or make an existing one
    so: the chat history holds everything typed, which is nobody else's business."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
    os.chmod(path, 0o600)


class TerminalReader:
    """prompt_toolkit input: editing, history in `history_file`, multi-line input."""

    def __init__(self, history_file: Path):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.application.current import get_app
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        keys = KeyBindings()

        @keys.add("escape", "enter")
        def _newline(event) -> None:
            event.current_buffer.insert_text("\n")

        @keys.add("enter", filter=Condition(lambda: open_block(get_app().current_buffer.text)))
        def _block_newline(event) -> None:
            event.current_buffer.insert_text("\n")

        private_file(history_file)
        self.session = PromptSession(
            history=FileHistory(str(history_file)),
            key_bindings=keys,
            prompt_continuation=lambda width, line, wrap: "." * (width - 1) + " ",
        )

    def read(self, prompt: str) -> str | None:
        try:
            return unwrap(self.session.prompt(prompt))
        except EOFError:
            return None


class StreamReader:
    """Lines from a pipe or file; a \"\"\" block spans lines as on a terminal."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def read(self, prompt: str) -> str | None:
        text = self.stream.readline()
        if not text:
            return None
        while open_block(text):
            more = self.stream.readline()
            if not more:
                break
            text += more
        return unwrap(text.rstrip("\n"))


class Repl:
    """Reads messages and slash commands, streams replies, prints stats after each."""

    def __init__(self, session: ChatSession, reader: LineReader, out: TextIO, color: bool = False,
                 verbose: bool = False, images: Sequence[str] = ()):
        self.session, self.reader, self.out = session, reader, out
        self.color, self.verbose = color, verbose
        self.images: list[Any] = []  # loaded by /image (or --image), shown with the next message
        for path in images:
            self.image(path)
        self.commands: dict[str, Callable[[str], bool | None]] = {
            "help": self.help, "reset": self.reset, "system": self.system, "set": self.set, "stats": self.stats,
            "format": self.format, "think": self.think, "image": self.image,
            "undo": self.undo, "save": self.save, "load": self.load, "exit": self.exit, "quit": self.exit,
        }

    def run(self) -> None:
        """The edge of the chat: whatever a line leads to, a failure is one line and the
        conversation goes on. Only input that cannot be read at all ends it."""
        while True:
            try:
                line = self.reader.read(PROMPT)
            except KeyboardInterrupt:  # at the prompt: the line is dropped, the session goes on
                continue
            except (OSError, UnicodeError) as e:  # reading again would fail again
                self.fail(e)
                break
            if line is None:
                break
            try:
                if self.handle(typed_text(line)) is False:
                    break
            except KeyboardInterrupt:
                self.note("[interrupted]")
            except Exception as e:  # the one place every failure of a line is caught
                self.fail(e)

    def fail(self, e: Exception) -> None:
        """One line for `e` (with its traceback first under --verbose)."""
        if self.verbose:
            traceback.print_exc(file=self.out)
        self.say(f"error: {describe(e)}")

    def handle(self, line: str) -> bool | None:
        """One input line; False means quit."""
        if not line.strip():
            return None
        if line.startswith("/"):
            name, _, arg = line[1:].strip().partition(" ")
            command = self.commands.get(name)
            if command is None:
                self.say(f"unknown command /{name}; type /help for the list")
                return None
            return command(arg.strip())
        self.reply(line)
        return None

    def reply(self, text: str) -> None:
        before = len(self.session.messages)
        chunks = self.session.send(text, self.images)
        self.images = []
        interrupted = False
        calls = []
        thinking = False  # inside the thinking shown so far
        try:
            for chunk in chunks:
                if chunk.reasoning:
                    self.write(paint(("" if thinking else THINKING) + chunk.reasoning, DIM, self.color))
                    thinking = True
                if chunk.text and thinking:
                    self.write(paint(THOUGHT, DIM, self.color))
                    thinking = False
                self.write(paint(chunk.text, CYAN, self.color) if chunk.drafted else chunk.text)
                calls = chunk.tool_calls or calls
        except KeyboardInterrupt:
            interrupted = True
        finally:
            chunks.close()
        self.write("\n")
        kept = len(self.session.messages) > before
        if interrupted:
            self.note("[interrupted; the partial reply is kept]" if kept else "[interrupted]")
        for call in calls:
            self.say(f"tool call: {describe_call(call)}")
        if kept:
            self.note(self.stats_line())

    def stats_line(self) -> str:
        stats = self.session.stats
        return stats_line(stats, len(self.session.cache.tokens), self.session.cache.nbytes)

    def help(self, _: str) -> None:
        for name, what in HELP:
            self.say(f"  {name:<16} {what}")
        self.say(f'  Alt-Enter starts a new line; text between {BLOCK} marks is one message.')

    def image(self, arg: str) -> None:
        """Load an image now (a bad one fails here, in one line) for the next message."""
        if not arg:
            raise InvalidOptionError("/image needs a file, e.g. /image photo.png")
        check_takes_images(self.session.model)
        self.images.append(load_image(Path(arg).expanduser()))
        self.note(f"[image {len(self.images)} attached to the next message: {Path(arg).name}]")

    def reset(self, _: str) -> None:
        self.session.reset()
        self.say("conversation cleared")

    def system(self, text: str) -> None:
        if not text:
            self.say(f"system prompt: {self.session.system!r}" if self.session.system else
                     "no system prompt (the template's default applies); set one with /system TEXT")
            return
        self.session.system = text
        self.say("system prompt set; it applies from the next reply")

    def set(self, arg: str) -> None:
        if not arg:
            options = self.session.options
            self.say("  ".join(f"{k}={options.get(name, '-')}" for k, (name, _) in SETTINGS.items()))
            return
        key, _, value = arg.partition(" ")
        if key not in SETTINGS:
            raise InvalidOptionError(f"unknown setting '{key}'; choose one of {', '.join(SETTINGS)}")
        name, kind = SETTINGS[key]
        try:
            parsed = kind(value.strip())
        except ValueError:
            raise InvalidOptionError(f"{key} needs {'an integer' if kind is int else 'a number'}, got '{value.strip()}'") \
                from None
        self.session.set_option(name, parsed)
        self.say(f"{key} = {parsed}")

    def format(self, arg: str) -> None:
        if not arg:
            current = self.session.options.get("response_format")
            self.say(f"format: {json.dumps(current) if current else 'free text'}; "
                     "/format json [SCHEMA|FILE], regex PATTERN, lark GRAMMAR|FILE or off")
            return
        kind, _, value = arg.partition(" ")
        spec = typed_format(kind, value)
        self.session.set_option("response_format", spec)
        self.say("replies are free text again" if spec is None else f"replies are held to {kind}"
                 + (f" {value.strip()}" if value.strip() else " (any JSON object)" if kind == "json" else ""))

    def think(self, arg: str) -> None:
        tokenizer = self.session.tokenizer
        kwargs = self.session.options.get("chat_template_kwargs") or {}
        if not arg:
            on = kwargs.get(SWITCH, True) if tags_for(tokenizer) is not None else None
            self.say("this model does not think" if on is None else
                     f"thinking is {'on' if on else 'off'}; /think on|off switches it")
            return
        if arg not in ("on", "off"):
            raise InvalidOptionError(f"/think takes on or off, got '{arg}'")
        self.session.set_option("chat_template_kwargs", {**kwargs, **thinking_switch(tokenizer, arg == "on")})
        self.say(f"thinking {arg} from the next reply")

    def stats(self, _: str) -> None:
        s, cache = self.session.stats, self.session.cache
        turns = len(self.session.messages)
        self.say(f"conversation: {turns} messages; cache {len(cache.tokens)} tokens, {size(cache.nbytes)}")
        if s is None:
            self.say("no reply yet")
            return
        self.say(f"last reply: {s.prompt_tokens} prompt tokens ({s.prefill_tokens} prefilled), "
                 f"{s.generated_tokens} generated, finish {s.finish_reason or 'interrupted'}")
        self.say(f"  TTFT {s.ttft * 1000:.1f} ms, prefill {s.prefill_tps:.1f} tok/s, decode {s.decode_tps:.1f} tok/s, "
                 f"peak memory {size(s.peak_memory)}")
        if getattr(s, "drafted", 0):
            self.say(f"  speculation: {s.accepted} of {s.drafted} drafted tokens accepted "
                     f"({s.accepted / s.drafted:.0%}) in {s.rounds} rounds"
                     + (f", {s.speedup:.2f}x plain decoding measured alongside" if s.speedup else ""))

    def undo(self, _: str) -> None:
        if self.session.undo():
            self.say(f"dropped the last exchange; cache {len(self.session.cache.tokens)} tokens")
        else:
            self.say("nothing to undo")

    def save(self, arg: str) -> None:
        if not arg:
            raise InvalidOptionError("/save needs a file name, e.g. /save chat.json")
        path = self.session.save(arg)
        self.say(f"saved {len(self.session.messages)} messages and {len(self.session.cache.tokens)} cached tokens "
                 f"to {path}")

    def load(self, arg: str) -> None:
        if not arg:
            raise InvalidOptionError("/load needs a file name, e.g. /load chat.json")
        old = self.session
        self.session = ChatSession.load(arg, old.model, old.tokenizer, old.draft_model, old.engine)
        cache = (f"cache restored ({len(self.session.cache.tokens)} tokens)" if self.session.cache_restored else
                 "no usable cache for this model; the conversation is read again on the next reply")
        self.say(f"loaded {len(self.session.messages)} messages; {cache}")

    def exit(self, _: str) -> bool:
        return False

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def say(self, text: str) -> None:
        self.write(text + "\n")

    def note(self, text: str) -> None:
        self.say(paint(text, DIM, self.color))


def describe(e: Exception) -> str:
    """An error as the one line the REPL shows: ours carry their own message; the system's
    get the file and the reason; anything else is named as the bug it is."""
    if isinstance(e, MlxinferError):
        return str(e)
    if isinstance(e, OSError):
        return f"'{e.filename}': {e.strerror}" if e.filename else e.strerror or str(e)
    if isinstance(e, UnicodeError):
        return f"text that is not valid UTF-8 ({e})"
    first = (str(e).splitlines() or [""])[0]
    return f"unexpected {type(e).__name__}: {first} (a bug in mlxinfer; --verbose shows where)"


def run_repl(session: ChatSession, history_file: Path, color: bool, verbose: bool, images: Sequence[str] = ()) -> None:
    """A terminal gets prompt_toolkit; anything else is read line by line."""
    stdin, out = sys.stdin, sys.stdout
    if isinstance(stdin, io.TextIOWrapper):  # bytes that are not UTF-8 reach typed_text, which replaces them
        stdin.reconfigure(errors="surrogateescape")
    interactive = stdin.isatty() and out.isatty()
    reader: LineReader = TerminalReader(history_file) if interactive else StreamReader(stdin)
    repl = Repl(session, reader, out, color, verbose, images)
    if interactive:
        repl.note("/help for commands, Alt-Enter for a new line, Ctrl-C stops a reply, Ctrl-D quits")
    with contextlib.suppress(BrokenPipeError):
        repl.run()
