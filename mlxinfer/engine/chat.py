"""ChatSession: a conversation with a model, what the REPL and on-device apps share.

It owns the messages, renders them with the model's chat template, and keeps one
KV cache for the whole conversation. Its options are one typed `Request` (its
prompt left empty), which each turn fills with the whole conversation rendered and
runs on the engine with the same `PromptCache`, whose `prepare` keeps the
longest common prefix, so a turn prefills only what is new: the reply's last
token (never fed back), the template's end-of-turn tokens and the new message.

Replies stay as the token ids the model generated (a `Transcript`): encoding a
reply's text again can give other ids (a model may spell " Paris" as " Par" + "is"),
and everything after the first difference would then be prefilled again each turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..models.prompt_cache import PromptCache
from ..models.vision import check_takes_images
from .prompt_file import load_prompt_cache, save_prompt_cache
from ..base.checks import is_integer
from ..base.errors import InvalidOptionError, MlxinferError, SessionFileError, TokenizerError
from ..base.files import replacing, write_problem
from .batch import BatchGenerator
from .generate import stream_request
from .prepared import CACHE_OPTIONS
from .request import Request
from ..decode.sources import Stats
from .prompt import with_tools
from .text_stream import Chunk
from ..text.images import load_image
from ..text.reasoning import reasoning_for
from ..text.tokenizer import Tokenizer
from ..text.tools import plan as plan_tools

FORMAT = "mlxinfer-chat"
VERSION = 2  # 2: the settings as a typed request (`Request.to_json`); 1 (keyword options) is still read
Message = dict[str, str]
Mark = tuple[int, int] | None


@dataclass
class Transcript:
    """The conversation as the model saw it, up to the end of the last reply: token ids,
    the text they stand for, and where each exchange ended as (ids, characters), or None
    where that point is not a prefix of `tokens` (ids unknown: Nones always come first)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    ends: list[Mark] = field(default_factory=list)

    def undo(self) -> Transcript:
        """Back to the end of the exchange before the last."""
        ends = self.ends[:-1]
        mark = ends[-1] if ends else (0, 0)
        if mark is None:
            return Transcript(ends=ends)
        return Transcript(self.tokens[: mark[0]], self.text[: mark[1]], ends)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "text": self.text, "ends": self.ends}


class ChatSession:
    """A multi-turn chat over one model and one reused KV cache.

    `send(text)` streams the reply as `Chunk`s and keeps it in `messages`; stopping
    early (closing the iterator, Ctrl-C) keeps what was said so far. Options are
    those of `stream_generate` (temperature, top_p, max_tokens, max_kv_size, ...);
    the cache options are fixed when the session starts.
    """

    def __init__(self, model, tokenizer: Tokenizer, system: str | None = None, draft_model=None,
                 engine: BatchGenerator | None = None, **options: Any):
        if tokenizer.chat_template is None:
            raise TokenizerError("this model has no chat template, so it cannot chat; use a chat (instruct) model")
        self.model, self.tokenizer = model, tokenizer
        self.system = system
        self.draft_model = draft_model
        self.settings = _settings(options, model, draft_model)  # the request each turn makes, less its prompt
        self.engine = engine
        self.cache = self._engine().new_cache(**self.cache_options)
        self.draft_cache = PromptCache.for_model(draft_model, **self.cache_options) if draft_model else None
        self.stats: Stats | None = None
        self.cache_restored = False
        self._turns: list[Message] = []
        self._transcript = Transcript()
        self._streaming: Iterator[Chunk] | None = None

    @property
    def options(self) -> dict[str, Any]:
        """Every option the turns use, as keyword options."""
        return self.settings.keywords()

    @property
    def cache_options(self) -> dict[str, Any]:
        o = self.settings.options
        return {k: getattr(o, k) for k in CACHE_OPTIONS if getattr(o, k) is not None}

    @property
    def messages(self) -> list[Message]:
        """The conversation as chat messages, the system prompt first when there is one."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [dict(m) for m in self._turns]

    @property
    def reply(self) -> str | None:
        """The last assistant reply (partial if it was interrupted)."""
        return self._turns[-1]["content"] if self._turns else None

    def set_option(self, name: str, value: Any) -> None:
        """Change a generation option for the next turns (validated now, not at the next send)."""
        if name in CACHE_OPTIONS:
            raise InvalidOptionError(f"{name} is fixed when the session starts; start a new session to change it")
        self.settings = _settings({**self.options, name: value}, self.model, self.draft_model)

    def send(self, text: str, images: Sequence[Any] = ()) -> Iterator[Chunk]:
        """Stream the reply to `text`, with `images` (PIL images, paths, bytes or data: URLs; loaded
        now, so a bad one fails here) shown before it. Consume the iterator; the reply is kept when
        it ends or stops early. A turn that fails or stops before its first token (the context is
        full, Ctrl-C during the prefill) leaves no trace."""
        self._close_stream()
        if images:
            check_takes_images(self.model)  # before any is loaded
        loaded = [load_image(i) for i in images]
        self._streaming = self._turn(text, loaded)
        return self._streaming

    @property
    def has_images(self) -> bool:
        """Whether a message of the conversation holds an image."""
        return any(isinstance(m["content"], list) for m in self._turns)

    def _turn(self, text: str, images: list[Any]) -> Iterator[Chunk]:
        content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]
        user = {"role": "user", "content": content if images else text}
        self._turns.append(user)
        pieces: list[str] = []
        thoughts: list[str] = []
        ids: list[int] = []
        prompt: list[int] = []
        rendered = ""
        started = False
        try:
            if self.has_images:  # the engine renders them, expanding each image's placeholder
                request = self._engine().request(self.messages, **self.options)
            else:
                rendered = self._render(add_generation_prompt=True)
                prompt = self._tokens_for(rendered)
                request = dataclasses.replace(self.settings, prompt=tuple(prompt))
            if self.draft_model is not None:
                request = dataclasses.replace(request, options=dataclasses.replace(
                    request.options, draft_model=self.draft_model, draft_cache=self.draft_cache))
            eos = set(self.tokenizer.eos_token_ids)
            engine = self._engine()
            for chunk in stream_request(engine, request, self.cache, kept=self.engine is not None):
                pieces.append(chunk.text)
                thoughts.append(chunk.reasoning)
                if chunk.token is not None and not (chunk.finish_reason == "stop" and chunk.token in eos):
                    ids.append(chunk.token)
                self.stats = chunk.stats
                started = True
                yield chunk
        finally:  # errors, KeyboardInterrupt and GeneratorExit too: keep what was said, if anything
            if not started:
                self._turns.remove(user)
            else:
                self._keep_reply(prompt, rendered, ids, "".join(pieces), "".join(thoughts))
            self._streaming = None

    def _keep_reply(self, prompt: list[int], rendered: str, ids: list[int], reply: str, thinking: str) -> None:
        """Keep the reply as a message (a thinking model's thoughts under `reasoning_content`,
        which templates read; Qwen3's drops them from later turns) and, when the message says
        all its ids said, the ids as the transcript."""
        message = {"role": "assistant", "content": reply}
        self._turns.append({**message, "reasoning_content": thinking} if thinking else message)
        t = self._transcript
        if self.has_images:  # its ids hold the images' expanded tokens, which a render does not
            self._transcript = Transcript(ends=[None] * (len(t.ends) + 1))
            return
        ends = t.ends if prompt[: len(t.tokens)] == t.tokens else [None] * len(t.ends)
        said = self.tokenizer.decode(ids)
        split = reasoning_for(self.tokenizer, rendered) if self.settings.options.split_reasoning else None
        if (split.split(said) if split is not None else ("", said)) != (thinking, reply):
            # cut at a stop string, or a character held back
            self._transcript = Transcript(ends=[None] * (len(ends) + 1))
            return
        tokens, text = prompt + ids, rendered + said
        self._transcript = Transcript(tokens, text, [*ends, (len(tokens), len(text))])

    def undo(self) -> bool:
        """Drop the last exchange and roll the cache back to exactly the rest of the
        conversation (while an image is left in it, the next turn trims the cache to what the
        two share, as any prompt does); False when there is nothing to undo."""
        self._close_stream()
        if not self._turns:
            return False
        del self._turns[-2:]
        self.stats = None
        self._transcript = self._transcript.undo()
        if not self.has_images:
            self._sync_cache(self._tokens_for(self._render(add_generation_prompt=False)))
        return True

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty the cache."""
        self._close_stream()
        self._turns.clear()
        self._transcript = Transcript()
        self._sync_cache([])
        self.stats = None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the conversation as JSON at `path` and the KV cache beside it
        (`<name>.kv.safetensors`), so `load` resumes without prefilling again."""
        self._close_stream()
        _whole_model(self.model, "saving")
        if self.has_images:
            raise SessionFileError("a chat with images cannot be saved yet; /reset and chat without them to save")
        path = Path(path).expanduser()
        kv_path = path.with_suffix(".kv.safetensors")
        data = {
            "format": FORMAT,
            "version": VERSION,
            "system": self.system,
            "messages": self._turns,
            "transcript": self._transcript.as_dict(),
            "request": self.settings.to_json(),
            "kv_cache": kv_path.name,
        }
        meta = {"model": model_fingerprint(self.model), "cache_options": json.dumps(self.cache_options, sort_keys=True)}
        try:  # both files are written under temporary names first: a failure leaves neither
            with replacing(path) as tmp, replacing(kv_path, suffix=".safetensors") as kv_tmp:
                save_prompt_cache(kv_tmp, self.cache, meta)
                tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        except (OSError, RuntimeError) as e:
            why = write_problem(e) if isinstance(e, OSError) else _reason(e)
            raise SessionFileError(f"cannot write the session to '{path}' ({why}); choose a writable path") from None
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model, tokenizer: Tokenizer, draft_model=None,
             engine: BatchGenerator | None = None, **options: Any) -> ChatSession:
        """A session saved by `save`, continued with `model`. Its KV cache is reused when it
        was made by the same model with the same cache options (`cache_restored`); otherwise
        the conversation is prefilled again on the next turn. `options` override the saved ones."""
        _whole_model(model, "loading")
        path = Path(path).expanduser()
        data = _read_session(path)
        session = cls(model, tokenizer, data.get("system"), draft_model, engine, **{**_saved_options(data, path), **options})
        session._turns = data["messages"]
        exchanges = len(session._turns) // 2
        session._transcript = _read_transcript(data.get("transcript"), exchanges, model.config.vocab_size)
        cache = _read_cache(path.parent / data["kv_cache"], model)
        fits = {"model": model_fingerprint(model), "cache_options": json.dumps(session.cache_options, sort_keys=True)}
        if cache is not None and all(cache.metadata.get(k) == v for k, v in fits.items()):
            session.cache = cache
            session.cache_restored = True
        return session

    def _render(self, add_generation_prompt: bool) -> str:
        messages = self.messages
        if not messages:
            return ""
        o = self.settings.options
        tools = plan_tools(self.tokenizer, o.tools, o.tool_choice, o.parallel_tool_calls) if o.tools else None
        messages, extra = with_tools(self.tokenizer, messages, tools)  # as stream_generate shows them
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **(o.chat_template_kwargs or {}), **extra)

    def _tokens_for(self, rendered: str) -> list[int]:
        """Ids for a render of the conversation: the transcript's ids for the part it covers,
        then the rest encoded, provided the rest encodes alone as it does in context (it
        starts at a special token such as end-of-turn)."""
        whole = self.tokenizer.encode(rendered, add_special_tokens=False) if rendered else []
        t = self._transcript
        if t.text and rendered.startswith(t.text):
            rest = self.tokenizer.encode(rendered[len(t.text) :], add_special_tokens=False)
            if whole[len(whole) - len(rest) :] == rest:
                return t.tokens + rest
        return whole

    def _sync_cache(self, tokens: list[int]) -> None:
        """Make the cache hold exactly `tokens`: keep the common prefix, prefill the rest."""
        self._engine().fill(self.cache, tokens)

    def _engine(self) -> BatchGenerator:
        """The engine that runs the session's work: `engine` when given (rank 0's `Replica` of a
        model sharded across ranks, which keeps a twin of the cache on every rank), else a fresh
        one-sequence engine each time, since a Ctrl-C may stop one mid-step."""
        return self.engine or BatchGenerator(self.model, self.tokenizer, max_batch=1,
                                             prefill_step=self.settings.options.prefill_step)

    def _close_stream(self) -> None:
        if self._streaming is not None:
            self._streaming.close()


def model_fingerprint(model) -> str:
    """Identifies a model's config, dtypes and weights well enough to refuse a cache made by another."""
    params = tree_flatten(model.parameters())
    h = hashlib.sha256(json.dumps(model.config.raw, sort_keys=True, default=str).encode())
    h.update(",".join(sorted({str(p.dtype) for _, p in params})).encode())
    for _, p in params[:4]:
        h.update(np.array(p.reshape(-1)[:64].astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


def _settings(options: dict[str, Any], model, draft_model) -> Request:
    """The typed request for `options`, checked as the engine will check it (with the draft
    model, which the settings leave out: it is a loaded object, never written out)."""
    if draft_model is not None:
        Request.of("", model.config.vocab_size, **options, draft_model=draft_model)
    return Request.of("", model.config.vocab_size, **options)


def _saved_options(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The options a session file holds: version 2's typed request, or version 1's keyword
    options (their `logit_bias` keys back to ints: JSON object keys are strings)."""
    if data["version"] == 1:
        out = dict(data["options"])
        bias = out.get("logit_bias")
        if isinstance(bias, dict):
            out["logit_bias"] = {int(k) if k.isascii() and k.isdigit() else k: v for k, v in bias.items()}
        return out
    try:
        return Request.from_json(data["request"]).keywords()
    except InvalidOptionError:  # a value out of range: the error names it
        raise
    except (KeyError, TypeError, ValueError, AttributeError):
        raise SessionFileError(f"'{path}' is damaged (its request settings do not read back); save the chat again") \
            from None


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e).splitlines()[0]


def _read_session(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SessionFileError(f"no saved chat at '{path}'; check the path")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
        raise SessionFileError(f"cannot read '{path}' ({_reason(e)}); is it a chat saved with /save?") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SessionFileError(f"'{path}' is not a chat saved by mlxinfer; save one with /save FILE")
    if data.get("version") not in (1, VERSION):
        raise SessionFileError(f"'{path}' has session format version {data.get('version')}; this mlxinfer reads 1 to "
                               f"{VERSION}")
    messages = data.get("messages")
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") == ("user", "assistant")[i % 2] and isinstance(m.get("content"), str)
        for i, m in enumerate(messages)
    ) and len(messages) % 2 == 0
    settings = data.get("options" if data["version"] == 1 else "request")
    if not ok or not isinstance(settings, dict) or not isinstance(data.get("kv_cache"), str):
        raise SessionFileError(f"'{path}' is damaged (messages, options or kv_cache missing); save the chat again")
    if not isinstance(data.get("system", 0), (str, type(None))):
        raise SessionFileError(f"'{path}' is damaged (its system prompt is missing or not a string); save the chat again")
    kv = data["kv_cache"]
    if Path(kv).name != kv or kv in ("", ".", ".."):  # only a file beside the session, never a path elsewhere
        raise SessionFileError(f"'{path}' names kv_cache '{kv[:80]}', not a file beside it; save the chat again")
    return data


def _read_transcript(data: Any, exchanges: int, vocab_size: int) -> Transcript:
    """The saved transcript if it holds together: token ids of this model's vocabulary (they
    are fed to it), and per exchange an (ids, characters) end inside them, unknown ones (None)
    first, the last at the very end. A damaged one only costs a prefill (the conversation is
    encoded afresh), so it is dropped rather than refused."""
    fresh = Transcript(ends=[None] * exchanges)
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        return fresh
    tokens, text, ends = data.get("tokens"), data["text"], data.get("ends")
    if not isinstance(tokens, list) or not all(is_integer(t) and 0 <= t < vocab_size for t in tokens):
        return fresh
    if not isinstance(ends, list) or len(ends) != exchanges:
        return fresh
    marks = [e for e in ends if e is not None]
    pairs = [tuple(e) for e in marks if isinstance(e, list) and len(e) == 2 and all(is_integer(x) for x in e)]
    if len(pairs) != len(marks) or ends[len(ends) - len(marks) :] != marks:
        return fresh
    bounded = all(0 <= a[0] <= b[0] and 0 <= a[1] <= b[1] for a, b in zip([(0, 0), *pairs], pairs))
    if not bounded or (pairs[-1] if pairs else (0, 0)) != (len(tokens), len(text)):
        return fresh
    return Transcript(tokens, text, [None] * (len(ends) - len(pairs)) + pairs)


def _read_cache(path: Path, model) -> PromptCache | None:
    """The saved cache if it is readable and fits `model`, else None: the conversation alone
    still resumes, at the cost of a prefill."""
    if not path.is_file():
        return None
    try:
        cache = load_prompt_cache(path)
        cache.check_fits(model)
    except MlxinferError:
        return None
    return cache if all(c.offset == len(cache.tokens) for c in cache.caches) else None


def _whole_model(model, doing: str) -> None:
    """A saved session's KV cache is one process's; a sharded model's is spread over the ranks."""
    if getattr(model, "shard", None) is not None:
        raise InvalidOptionError(f"{doing} a session is not supported while the model is sharded across ranks "
                                 "(each holds part of the KV cache); chat on one machine to save or load sessions")
