"""Constrained decoding: output held to a JSON Schema, a regular expression or a Lark
grammar, token by token.

The grammar engine is llguidance (an Earley parser over the model's own vocabulary, the
one llama.cpp and others use): it is given our tokenizer (its `tokenizers` JSON, so every
token's bytes, byte-fallback pieces and special tokens are what our tokenizer means by
them) and tells, before each step, which tokens may come next. The token source masks
the logits with that set before any sampling filter, so sampling follows the model's own
distribution restricted to legal tokens; EOS is legal exactly when the output is complete.

The native compiler must not take the process down or stall it: what reaches it is
first bounded in Python (`grammar_checks`: size, depth, rules; rules that can never
complete are refused), then compiled in a worker process (`grammar_worker.py`) under a
time limit, with this model's tokenizer and the first token mask computed, where a crash
or a parser limit costs that request only. A grammar the worker accepted is then
compiled here (the same work on a larger stack); both steps are cached.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np

from ..base.errors import InvalidOptionError, MlxinferError
from .grammar_checks import MAX_DEPTH, check_depth, check_lark, check_schema, check_size
from .tokenizer import Tokenizer

FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
# JSON on one line with json.dumps' spacing: free whitespace lets a sampled reply drift into
# blank lines until max_tokens cuts it, and this is how most models write JSON anyway.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_bridges_lock = threading.Lock()
COMPILE_SECONDS = 10.0  # a grammar taking longer (in the worker) is refused
START_SECONDS = 120.0  # starting the worker, or loading a tokenizer into it (~1 s for a 150K vocabulary)
# llguidance's parser limits (its defaults, pinned): the same in the worker and here, so a
# grammar the worker accepted does not trip them on its first step here; errors come
# without the parser's state and grammar dump (they reach clients and logs).
PARSER_LIMITS = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                 "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000,
                 "verbose_errors": False}


def _llg():
    """llguidance, imported where it is used (its Rust extension loads in ~50 ms)."""
    import llguidance

    return llguidance


@dataclass(frozen=True)
class Format:
    """A response format compiled to llguidance's grammar (`kind`: what the user asked
    for; `what`: how a message names it)."""

    kind: str
    grammar: str
    what: str


def one_line(message: str, width: int = 200) -> str:
    """llguidance's multi-line diagnostics as one line: the headline and its `error:` detail,
    each cut to `width` characters (a headline can quote a whole 64 KiB regex)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(line if len(line) <= width else line[: width - 1] + "…" for line in kept) or "invalid"


def response_format(spec: Mapping[str, Any] | None) -> Format | None:
    """OpenAI's `response_format` (plus `{"type": "regex", "pattern"}` and `{"type":
    "grammar", "lark"}`) as a grammar; None for plain text. What llguidance cannot enforce
    (an unknown format, an unimplemented schema keyword, a bad regex), what is over a
    limit, and what can never complete are refused here. Safe from any thread."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or spec.get("type") not in FORMATS:
        kind = spec.get("type") if isinstance(spec, Mapping) else type(spec).__name__
        raise InvalidOptionError(f"response_format type {kind!r} is not supported; use one of {', '.join(FORMATS)}")
    inner = spec.get("json_schema")
    if spec["type"] == "json_schema" and isinstance(inner, Mapping):
        check_depth(inner.get("schema"), "response_format json_schema")
    check_depth(dict(spec), "response_format", MAX_DEPTH + 2)  # {"json_schema": {"schema": ...}}; json.dumps recurses
    return _compile(json.dumps(dict(spec), sort_keys=True))


@lru_cache(maxsize=64)
def _compile(spec_json: str) -> Format | None:
    spec = json.loads(spec_json)
    kind = spec["type"]
    what = f"response_format {kind}"
    matcher = _llg().LLMatcher
    if kind == "text":
        return None
    if kind == "json_object":
        grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    elif kind == "json_schema":
        inner = spec.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidOptionError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        check_schema(schema, what)
        grammar = matcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    elif kind == "regex":
        if not isinstance(spec.get("pattern"), str):
            raise InvalidOptionError('response_format regex needs {"pattern": "..."}')
        check_size(spec["pattern"], what)
        grammar = matcher.grammar_from_regex(spec["pattern"])
    else:
        if not isinstance(spec.get("lark"), str):
            raise InvalidOptionError('response_format grammar needs {"lark": "..."}')
        check_lark(spec["lark"], what)
        grammar = matcher.grammar_from_lark(spec["lark"])
    return _validated(Format(kind, grammar, what))


def json_answer(spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema a `json_schema` or `json_object` response_format holds a reply to
    (None for none or text); a tool-call grammar offers it as the alternative to a call."""
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        return dict(spec["json_schema"]["schema"])
    return None


def _validated(fmt: Format) -> Format:
    """`fmt` once the worker has compiled it (without a tokenizer: that comes with `Constraint`)."""
    error = _COMPILER.check(fmt.grammar, fmt.what)["error"]
    if error:
        raise InvalidOptionError(f"{fmt.what} cannot be enforced: {one_line(error)}")
    return fmt


def typed_format(kind: str, value: str = "") -> dict[str, Any] | None:
    """A response_format from what a user typed (CLI options, the REPL's /format):
    `json` (any JSON object), `json SCHEMA` (inline JSON or a file holding it), `regex
    PATTERN`, `lark GRAMMAR` (inline or a file), `off` (None). Checked here, so a bad
    one fails when it is set."""
    value = value.strip()
    if kind == "off":
        return None
    if kind == "json":
        spec = {"type": "json_schema", "json_schema": {"name": "schema", "schema": _json_or_file(value)}} if value \
            else {"type": "json_object"}
    elif kind == "regex" and value:
        spec = {"type": "regex", "pattern": value}
    elif kind == "lark" and value:
        spec = {"type": "grammar", "lark": _text_or_file(value)}
    else:
        raise InvalidOptionError(f"unknown format {(kind + ' ' + value).strip()!r}; use json [SCHEMA|FILE], "
                                 "regex PATTERN, lark GRAMMAR|FILE or off")
    response_format(spec)
    return spec


def _text_or_file(value: str) -> str:
    path = Path(value).expanduser()
    if "\n" not in value and len(value) < 4096 and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidOptionError(f"cannot read {value}: {e}; pass a readable UTF-8 file") from None
    return value


def _json_or_file(value: str) -> Any:
    text = _text_or_file(value)
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidOptionError("the JSON schema is nested too deep to read; simplify it") from None
    except json.JSONDecodeError as e:
        raise InvalidOptionError(f"the JSON schema is not valid JSON ({e}); pass inline JSON or a file holding it") \
            from None
    if not isinstance(schema, dict):
        raise InvalidOptionError("a JSON schema must be a JSON object, e.g. {\"type\": \"object\"}")
    return schema


@lru_cache(maxsize=64)
def compiled_lark(lark: str, what: str) -> Format:
    """A Lark grammar of ours (e.g. tool calls, its parts already checked), compiled and checked once."""
    return _validated(Format(what, _llg().LLMatcher.grammar_from_lark(lark), f"the {what} grammar"))


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int):
    """llguidance's view of our tokenizer for a model with `vocab_size` logits, built once
    per tokenizer (about a second for a 150K vocabulary). Logit rows past the tokenizer's
    vocabulary (padding) belong to no token and are never allowed."""
    with _bridges_lock:
        per_size = _bridges.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            eos = list(tokenizer.eos_token_ids) or None
            per_size[vocab_size] = _llg().LLTokenizer(tokenizer.backend.to_str(), n_vocab=max(vocab_size,
                                                      tokenizer.vocab_size), eos_token=eos)
        return per_size[vocab_size]


class _WorkerGone(Exception):
    """The worker died (a signal: the grammar crashed it) or was killed past its time."""


class _CompilerProcess:
    """The grammar worker (`grammar_worker.py`) from this side: started on first use,
    started again after it died or was killed, one request at a time (thread-safe)."""

    def __init__(self, script: Path = Path(__file__).with_name("grammar_worker.py"), seconds: float = COMPILE_SECONDS):
        self.script, self.seconds = script, seconds
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = 0  # the pid that started it: a forked child starts its own
        self._pending = b""
        self._tokenizers: set[str] = set()
        self._unanswered = 0  # tokenizers sent whose answers are still to be read
        self._proven: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._fatal: OrderedDict[tuple[str, str | None], str] = OrderedDict()  # grammars that killed the worker

    def check(self, grammar: str, what: str, tokenizer: Tokenizer | None = None, vocab_size: int = 0) -> dict:
        """The worker's verdict on `grammar` ({"error", "empty"}), with `tokenizer` when given."""
        key = None if tokenizer is None else _tokenizer_key(tokenizer, vocab_size)
        with self._lock:
            if (grammar, key) in self._fatal:  # it crashed or stalled the worker once: not again
                raise InvalidOptionError(f"{what} {self._fatal[grammar, key]}; simplify it")
            for _ in range(2):  # again when the worker had dropped the tokenizer to make room for others
                self._send_tokenizer(tokenizer, vocab_size)
                try:
                    while self._unanswered:  # tokenizers sent ahead: their answers come first
                        self._ask(None, START_SECONDS)
                        self._unanswered -= 1
                except _WorkerGone as e:
                    raise MlxinferError(f"the grammar compiler cannot load this model's tokenizer (it {e})") from None
                try:
                    reply = self._ask({"grammar": grammar, "tokenizer": key}, self.seconds)
                except _WorkerGone as e:
                    self._fatal[grammar, key] = str(e)
                    while len(self._fatal) > 256:
                        self._fatal.popitem(last=False)
                    raise InvalidOptionError(f"{what} {e}; simplify it") from None
                if not reply.get("unknown_tokenizer"):
                    return reply
                self._tokenizers.discard(key)
            raise MlxinferError("the grammar compiler keeps dropping this model's tokenizer")

    def prove(self, fmt: Format, tokenizer: Tokenizer, vocab_size: int) -> None:
        """Refuse `fmt` unless the worker matched it with this tokenizer and computed its
        first mask (once per pair). A tokenizer new to the worker is sent first, and this
        process builds its own view of it while the worker builds the same."""
        key = (fmt.grammar, _tokenizer_key(tokenizer, vocab_size))
        with self._lock:
            if key in self._proven:
                self._proven.move_to_end(key)
                return
            self._send_tokenizer(tokenizer, vocab_size)
        grammar_tokenizer(tokenizer, vocab_size)
        reply = self.check(fmt.grammar, fmt.what, tokenizer, vocab_size)
        if reply["error"]:
            raise InvalidOptionError(f"{fmt.what} cannot be enforced: {one_line(reply['error'])}")
        if reply["empty"]:
            raise InvalidOptionError(f"{fmt.what} can never complete: it admits no output at all (look for a rule "
                                     "that only refers to itself, or a pattern that matches nothing)")
        with self._lock:
            self._proven[key] = None
            while len(self._proven) > 256:
                self._proven.popitem(last=False)

    def _start(self) -> None:
        try:
            # its own session: a Ctrl-C at the terminal (a cancelled reply) must not end it too
            self._proc = subprocess.Popen([sys.executable, str(self.script), json.dumps(PARSER_LIMITS)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                          start_new_session=True)
            self._owner, self._pending, self._tokenizers, self._unanswered = os.getpid(), b"", set(), 0
            self._ask(None, START_SECONDS)
        except (OSError, _WorkerGone) as e:
            raise MlxinferError(f"the grammar compiler process did not start ({e}); check that {sys.executable} "
                                "can import llguidance") from None

    def _send_tokenizer(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        """Start the worker if it is not running, and send it `tokenizer` if it lacks it
        (without waiting for its answer). Called with the lock held."""
        if self._proc is None or self._owner != os.getpid():
            self._start()
        key = None if tokenizer is None else _tokenizer_key(tokenizer, vocab_size)
        if key is None or key in self._tokenizers:
            return
        request = {"tokenizer": key, "json": tokenizer.backend.to_str(), "eos": list(tokenizer.eos_token_ids),
                   "n_vocab": max(vocab_size, tokenizer.vocab_size)}
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise MlxinferError(f"the grammar compiler cannot load this model's tokenizer (it ended: "
                                f"{self._stop()})") from None
        self._tokenizers.add(key)
        self._unanswered += 1

    def _ask(self, request: dict | None, seconds: float) -> dict:
        """Send `request` (None: only read) and wait up to `seconds` for the answer."""
        proc = self._proc
        try:
            if request is not None:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
            line = self._read_line(proc, time.monotonic() + seconds)
        except (BrokenPipeError, EOFError):
            raise _WorkerGone(f"crashed the grammar compiler ({self._stop()})") from None
        if line is None:
            self._stop()
            raise _WorkerGone(f"took over {seconds:g} s to compile")
        return json.loads(line)

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> bytes | None:
        fd = proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _stop(self) -> str:
        """Kill the worker (the next request starts another); how it ended, in words."""
        proc, self._proc = self._proc, None
        proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        if code < 0 and -code != signal.SIGKILL:
            return signal.Signals(-code).name
        return f"exit status {code}" if code >= 0 else "killed"

    def close(self) -> None:
        """End the worker at exit (it would also end on its own when its stdin closes)."""
        with self._lock:
            if self._proc is not None and self._owner == os.getpid():
                self._stop()


_COMPILER = _CompilerProcess()
atexit.register(_COMPILER.close)
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_key(tokenizer: Tokenizer, vocab_size: int) -> str:
    """A name for the tokenizer as the worker builds it: its JSON's digest, vocabulary and EOS."""
    with _bridges_lock:
        if tokenizer not in _keys:
            _keys[tokenizer] = hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()[:32]
        return f"{_keys[tokenizer]}:{max(vocab_size, tokenizer.vocab_size)}:{list(tokenizer.eos_token_ids)}"


def _parser_limits():
    return _llg().LLParserLimits(**PARSER_LIMITS)


class Constraint:
    """One sequence's position in its grammar: the tokens allowed next, and the tokens
    taken so far (`accept`, `rollback` for speculative decoding)."""

    def __init__(self, fmt: Format, tokenizer: Tokenizer, vocab_size: int):
        self.format, self.vocab_size = fmt, vocab_size
        _COMPILER.prove(fmt, tokenizer, vocab_size)
        self._matcher = _llg().LLMatcher(grammar_tokenizer(tokenizer, vocab_size), fmt.grammar, log_level=0,
                                         limits=_parser_limits())
        if self._matcher.is_error():
            raise InvalidOptionError(f"{fmt.what} cannot be enforced: {one_line(self._matcher.get_error())}")

    def allowed(self) -> np.ndarray:
        """Booleans [vocab_size]: the tokens that may come next (only EOS once complete)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def mask(self) -> mx.array:
        """`allowed` as an MLX array [1, vocab_size]."""
        return mx.array(self.allowed())[None]

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise InvalidOptionError(f"token {token} breaks {self.format.what}: {one_line(self._matcher.get_error())}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here (nothing is consumed)."""
        return self._matcher.validate_tokens(list(tokens))

    def rollback(self, n: int) -> None:
        if n and not self._matcher.rollback(n):
            raise InvalidOptionError(f"cannot roll the response format back {n} tokens")

    @property
    def complete(self) -> bool:
        """The output so far satisfies the format (it may end here)."""
        return self._matcher.is_accepting()


def masked(logits: mx.array, mask: mx.array) -> mx.array:
    """Logits with the forbidden tokens at -inf: every later filter and the draw see only legal tokens."""
    return mx.where(mask, logits, mx.array(-mx.inf, logits.dtype))
