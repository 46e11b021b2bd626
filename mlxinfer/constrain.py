"""Constrained decoding: output held to a JSON Schema, a regular expression or a Lark
grammar, token by token.

The grammar engine is llguidance (an Earley parser over the model's own vocabulary, the
one llama.cpp and others use): it is given our tokenizer (its `tokenizers` JSON, so every
token's bytes, byte-fallback pieces and special tokens are what our tokenizer means by
them) and tells, before each step, which tokens may come next. The token source masks
the logits with that set before any sampling filter, so sampling follows the model's own
distribution restricted to legal tokens; EOS is legal exactly when the output is complete.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np

from .errors import InvalidOptionError
from .tokenizer import Tokenizer

FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
# JSON on one line with json.dumps' spacing: free whitespace lets a sampled reply drift into
# blank lines until max_tokens cuts it, and this is how most models write JSON anyway.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _llg():
    """llguidance, imported where it is used (its Rust extension loads in ~50 ms)."""
    import llguidance

    return llguidance


@dataclass(frozen=True)
class Format:
    """A response format compiled to llguidance's grammar (`kind`: what the user asked for)."""

    kind: str
    grammar: str


def one_line(message: str) -> str:
    """llguidance's multi-line diagnostics as one line: the headline and its `error:` detail."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    detail = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + detail) if lines else "invalid"


def response_format(spec: Mapping[str, Any] | None) -> Format | None:
    """OpenAI's `response_format` (plus `{"type": "regex", "pattern"}` and `{"type":
    "grammar", "lark"}`) as a grammar; None for plain text. What llguidance cannot enforce
    (an unknown format, an unimplemented schema keyword, a bad regex) is refused here."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or spec.get("type") not in FORMATS:
        kind = spec.get("type") if isinstance(spec, Mapping) else type(spec).__name__
        raise InvalidOptionError(f"response_format type {kind!r} is not supported; use one of {', '.join(FORMATS)}")
    return _compile(json.dumps(dict(spec), sort_keys=True))


@lru_cache(maxsize=64)
def _compile(spec_json: str) -> Format | None:
    spec = json.loads(spec_json)
    kind = spec["type"]
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
        grammar = matcher.grammar_from_json_schema(dict(schema), defaults=JSON_LAYOUT)
    elif kind == "regex":
        if not isinstance(spec.get("pattern"), str):
            raise InvalidOptionError('response_format regex needs {"pattern": "..."}')
        grammar = matcher.grammar_from_regex(spec["pattern"])
    else:
        if not isinstance(spec.get("lark"), str):
            raise InvalidOptionError('response_format grammar needs {"lark": "..."}')
        grammar = matcher.grammar_from_lark(spec["lark"])
    is_error, messages = matcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidOptionError(f"response_format {kind} cannot be enforced: {one_line(messages[0])}")
    return Format(kind, grammar)


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
    except json.JSONDecodeError as e:
        raise InvalidOptionError(f"the JSON schema is not valid JSON ({e}); pass inline JSON or a file holding it") \
            from None
    if not isinstance(schema, dict):
        raise InvalidOptionError("a JSON schema must be a JSON object, e.g. {\"type\": \"object\"}")
    return schema


@lru_cache(maxsize=64)
def compiled_lark(lark: str, what: str) -> Format:
    """A Lark grammar of ours (e.g. tool calls), compiled and checked once."""
    matcher = _llg().LLMatcher
    grammar = matcher.grammar_from_lark(lark)
    is_error, messages = matcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidOptionError(f"the {what} cannot be enforced: {one_line(messages[0])}")
    return Format(what, grammar)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int):
    """llguidance's view of our tokenizer for a model with `vocab_size` logits, built once
    per tokenizer (about a second for a 150K vocabulary). Logit rows past the tokenizer's
    vocabulary (padding) belong to no token and are never allowed."""
    per_size = _bridges.setdefault(tokenizer, {})
    if vocab_size not in per_size:
        eos = list(tokenizer.eos_token_ids) or None
        per_size[vocab_size] = _llg().LLTokenizer(tokenizer.backend.to_str(), n_vocab=max(vocab_size,
                                                  tokenizer.vocab_size), eos_token=eos)
    return per_size[vocab_size]


class Constraint:
    """One sequence's position in its grammar: the tokens allowed next, and the tokens
    taken so far (`accept`, `rollback` for speculative decoding)."""

    def __init__(self, fmt: Format, tokenizer: Tokenizer, vocab_size: int):
        self.format, self.vocab_size = fmt, vocab_size
        self._matcher = _llg().LLMatcher(grammar_tokenizer(tokenizer, vocab_size), fmt.grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidOptionError(f"response_format cannot be enforced: {one_line(self._matcher.get_error())}")

    def allowed(self) -> np.ndarray:
        """Booleans [vocab_size]: the tokens that may come next (only EOS once complete)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def mask(self) -> mx.array:
        """`allowed` as an MLX array [1, vocab_size]."""
        return mx.array(self.allowed())[None]

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise InvalidOptionError(f"token {token} breaks the response format: {self._matcher.get_error()}")

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
