"""Tokenize, detokenize and render chat templates exactly as transformers' AutoTokenizer does.

The runtime needs only `tokenizers` and `jinja2`; transformers (5.23) is the test oracle. Two of
its behaviours are reproduced here from what it is documented and observed to do:

* For some tokenizer classes (Llama, Gemma, Qwen2, GPT-2) AutoTokenizer does not run
  tokenizer.json verbatim: it keeps the vocabulary, merges, added tokens and post-processor but
  rebuilds the normalizer, pre-tokenizer, decoder and BPE flags the way that class's constructor
  does. Which class applies follows tokenizer_config's `tokenizer_class` and config.json's
  `model_type` (see `_pipeline_class`).
* When tokenizer.json exists, `add_bos_token` / `add_eos_token` in tokenizer_config.json are
  ignored: the file's post-processor alone decides whether BOS/EOS are added.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from . import sandbox
from ..base.errors import ConfigError, ModelNotFoundError, TokenizerError
from ..base.files import read_checkpoint_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_JINJA_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
# Characters (or ids) past which encoding (decoding) goes through the batch call that lets go of the
# GIL: it costs a few microseconds more, which a token's own decode in the streaming loop must not pay.
LONG = 4096

# The special tokens transformers names by attribute; other `*_token` keys are model-specific extras.
_STANDARD_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning arrives under; Qwen templates read the first, gpt-oss the second.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Text <-> ids and chat rendering over a `tokenizers.Tokenizer` and its Hugging Face config."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        clean_up_spaces: bool,
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._clean_up_spaces = clean_up_spaces
        self._chat_template = chat_template
        self.bos_token = special_tokens.get("bos_token")
        self.bos_token_id = self._token_id(self.bos_token)
        self.eos_token = special_tokens.get("eos_token")
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = self._token_id(special_tokens.get("pad_token"))
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @property
    def chat_template(self) -> str | None:
        """The default Jinja chat template, read-only so the compiled copy cannot go stale."""
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        """Base vocabulary plus added tokens: the id range a model's embedding must cover."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The configured `tokenizers.Tokenizer`."""
        return self._backend

    def detokenizer(self) -> StreamingDetokenizer:
        """A stateful decoder the generation loop feeds one token at a time."""
        return StreamingDetokenizer(self.decode, self._byte_fallback_ids)

    @cached_property
    def _byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xAB>` tokens when the model falls back to bytes: the decoder
        joins each run of them before deciding whether it is valid UTF-8."""
        if not getattr(self._backend.model, "byte_fallback", False):
            return frozenset()
        return frozenset(self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) - {None}

    def stream_decode(self, ids: Iterable[int]) -> Iterator[str]:
        """Text pieces for `ids` as soon as each is final; they concatenate to `decode(ids)`."""
        detok = self.detokenizer()
        for token in ids:
            piece = detok.add(token)
            if piece:
                yield piece
        tail = detok.finalize()
        if tail:
            yield tail

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; BOS/EOS come from tokenizer.json's post-processor when `add_special_tokens`.
        A long text is encoded as a batch of one, which lets go of the GIL while the Rust tokenizer
        works (`encode` holds it throughout: megabytes of text would stop every other thread of
        a server, its engine included, for seconds)."""
        if len(text) > LONG:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`, dropping tokens flagged special when `skip_special_tokens` (many ids: as
        a batch of one, letting go of the GIL, as `encode` does)."""
        ids = [int(i) for i in ids]
        text = self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0] if len(ids) > LONG \
            else self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's own text (`decode` of it alone), all in one call that lets go of the GIL."""
        texts = self._backend.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
        return [_clean_up_tokenization(t) for t in texts] if self._clean_up_spaces else texts

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's template; extra kwargs (tools, enable_thinking...) reach it.

        With `tokenize`, the text is encoded without adding BOS/EOS because templates write them.
        """
        template = self._compiled_template
        if not all(isinstance(m, Mapping) for m in messages):
            raise TokenizerError("chat messages must be dicts like {'role': 'user', 'content': '...'}; fix the input")
        variables = {"tools": None, "documents": None, **self._special_tokens, **template_kwargs}
        text = sandbox.render(
            template,
            {"messages": _as_templates_take(messages), "add_generation_prompt": add_generation_prompt, **variables},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (`enable_thinking`,
        `reasoning_effort`, ...): a switch is passed only to a template that has it."""
        if self.chat_template is None:
            return frozenset()
        self._compiled_template  # noqa: B018 - a template that does not compile fails with its own message
        return frozenset(jinja2.meta.find_undeclared_variables(_jinja_env().parse(self.chat_template)))

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; pass a raw prompt instead of chat messages")
        try:
            return _jinja_env().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"chat template does not compile: {_one_line(exc.message)} (line {exc.lineno}); "
                "fix the template or pass a raw prompt"
            ) from exc

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


class StreamingDetokenizer:
    """Turns a token stream into text pieces as soon as they are final.

    Re-decodes a short window (the tokens of the last emitted piece plus the new
    ones) and emits what the new tokens added to it. Holding back while the
    window's text ends in U+FFFD keeps half of a multi-byte character from ever
    being emitted; re-decoding with one token of left context keeps
    SentencePiece's leading-space rule and byte-fallback merges exactly as a
    whole-sequence decode applies them. A run of byte-fallback tokens is held
    until it ends, because the decoder judges the run's validity as a whole. The
    pieces always concatenate to `decode(all ids)`: `finalize` emits whatever is
    still held back.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], byte_ids: frozenset[int] = frozenset()):
        self._decode = decode
        self._byte_ids = byte_ids
        self.ids: list[int] = []
        self.text = ""
        self._start = 0
        self._read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        if token in self._byte_ids:
            return ""
        before = self._decode(self.ids[self._start : self._read])
        window = self._decode(self.ids[self._start :])
        if window.endswith("\ufffd") or not window.startswith(before):
            return ""
        piece = window[len(before) :]
        self._start, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def finalize(self) -> str:
        """Everything not yet emitted (call once the stream ends)."""
        full = self._decode(self.ids)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        return piece



def load_tokenizer_from_dir(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer files in a local model folder (hub ids are resolved by the caller)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ModelNotFoundError(f"tokenizer folder {folder} {what}; pass the folder holding tokenizer.json")
    config = _tokenizer_config(folder)
    backend, byte_level = _read_backend(folder / TOKENIZER_FILE)
    model_config = _read_json(folder / MODEL_CONFIG_FILE)
    model_type = model_config.get("model_type")
    class_name = _pipeline_class(_hub_class(config, model_config), model_type if isinstance(model_type, str) else None,
                                 byte_level)
    family = _FAMILIES.get(class_name or "")
    special_tokens = _named_special_tokens(config, family.defaults if family else {}, folder)
    is_bpe = isinstance(backend.model, tokenizers.models.BPE)
    if family and is_bpe:  # transformers would rebuild other models as an empty-merges BPE; keep them as-is
        family.rebuild(backend, config, special_tokens)
    _mark_special(backend, [*special_tokens.values(), *_extra_special_tokens(config, folder)])
    # transformers' __call__ never truncates or pads unless asked, whatever tokenizer.json says.
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return Tokenizer(
        backend,
        special_tokens,
        _eos_token_ids(backend, special_tokens.get("eos_token"), _read_json(folder / GENERATION_CONFIG_FILE)),
        _chat_template(folder, config),
        # transformers skips this clean-up for BPE models because it corrupts their output.
        clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)) and not is_bpe,
    )


# --- reading the folder -------------------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object file's content, or {} when the optional file is absent."""
    raw = read_checkpoint_file(file.parent, file.name)
    if raw is None:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too-long integers
        raise ConfigError(f"{file} is not valid JSON ({_one_line(exc)}); fix or re-download it") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, not {type(data).__name__}; fix or re-download it")
    return data


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json overriding it where transformers lets it.

    transformers reads special_tokens_map.json only for configs saved without `added_tokens_decoder`.
    """
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    if "added_tokens_decoder" not in config:
        config.update(_read_json(folder / SPECIAL_TOKENS_MAP_FILE))
    return config


def _read_backend(file: Path) -> tuple[tokenizers.Tokenizer, bool]:
    """The parsed tokenizer.json and whether it mentions ByteLevel (transformers checks the raw text)."""
    raw = read_checkpoint_file(file.parent, file.name)
    if raw is None:
        raise TokenizerError(
            f"{file} not found; mlxinfer needs the fast-tokenizer file, "
            "re-save the tokenizer with transformers' save_pretrained to create it"
        )
    try:
        backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for any malformed file
        raise TokenizerError(f"{file} is not a valid tokenizer file ({_one_line(exc)}); re-download it") from exc
    return backend, b'"ByteLevel"' in raw


def _token_text(value: Any, key: str, folder: Path) -> str | None:
    """A special-token entry, written either as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(
        f"{key} in the tokenizer config of {folder} must be a string or {{\"content\": ...}}, "
        f"not {type(value).__name__}; fix the file"
    )


def _is_token_entry(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, Mapping) and isinstance(value.get("content"), str))


def _named_special_tokens(
    config: Mapping[str, Any], defaults: Mapping[str, str | None], folder: Path
) -> dict[str, str]:
    """Named special tokens (bos_token, image_token, ...): the class defaults overridden by the config.

    These are also the special-token variables a chat template sees.
    """
    named: dict[str, str | None] = dict(defaults)
    for key, value in config.items():
        if key in _STANDARD_TOKEN_KEYS or (key.endswith("_token") and _is_token_entry(value)):
            named[key] = _token_text(value, key, folder)
    extras = config.get("extra_special_tokens")
    if isinstance(extras, Mapping):
        named.update({key: _token_text(value, key, folder) for key, value in extras.items()})
    return {key: value for key, value in named.items() if value is not None}


def _extra_special_tokens(config: Mapping[str, Any], folder: Path) -> list[str]:
    """The unnamed special tokens listed under additional_special_tokens / extra_special_tokens."""
    tokens: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        entries = config.get(key)
        if isinstance(entries, list):
            tokens += [text for entry in entries if (text := _token_text(entry, key, folder)) is not None]
    return tokens


def _mark_special(backend: tokenizers.Tokenizer, contents: Iterable[str]) -> None:
    """Flag configured special tokens as special (adding any the vocabulary lacks), as transformers does.

    This decides what `decode(..., skip_special_tokens=True)` drops; existing tokens keep their
    strip/normalization settings.
    """
    added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    updates = []
    for content in dict.fromkeys(contents):
        current = added.get(content)
        if current is None:
            updates.append(AddedToken(content, special=True, normalized=False))
        elif not current.special:
            updates.append(
                AddedToken(
                    content,
                    single_word=current.single_word,
                    lstrip=current.lstrip,
                    rstrip=current.rstrip,
                    normalized=current.normalized,
                    special=True,
                )
            )
    if updates:
        backend.add_special_tokens(updates)


def _eos_token_ids(
    backend: tokenizers.Tokenizer, eos_token: str | None, generation_config: Mapping[str, Any]
) -> list[int]:
    """Every stop id: the tokenizer's eos_token, then generation_config.json's eos_token_id (int or list)."""
    ids = [] if eos_token is None else [backend.token_to_id(eos_token)]
    configured = generation_config.get("eos_token_id")
    ids += configured if isinstance(configured, list) else [configured]
    for i in ids:
        if i is not None and (isinstance(i, bool) or not isinstance(i, int)):
            raise ConfigError(f"eos_token_id in {GENERATION_CONFIG_FILE} must be an int or a list of ints, got {i!r}")
    return list(dict.fromkeys(i for i in ids if i is not None))


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else chat_template.json, else the tokenizer config."""
    jinja_file = folder / CHAT_TEMPLATE_JINJA_FILE
    raw = read_checkpoint_file(folder, jinja_file.name)
    if raw is not None:
        try:  # newlines as text mode reads them, as transformers does
            return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"{jinja_file} is not UTF-8 text ({_one_line(exc)}); fix or re-download it") from None
    template = _read_json(folder / CHAT_TEMPLATE_JSON_FILE).get("chat_template", config.get("chat_template"))
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        entries = [t for t in template if isinstance(t, Mapping) and isinstance(t.get("name"), str)]
        named = {t["name"]: t.get("template") for t in entries}
        if isinstance(named.get("default"), (str, type(None))):
            return named.get("default")
    raise ConfigError(
        f"chat_template in {folder} must be a string or a list of {{\"name\", \"template\"}} dicts; fix the file"
    )


# --- transformers' per-class pipelines ----------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    """A transformers tokenizer class that rebuilds the pipeline instead of trusting tokenizer.json."""

    defaults: Mapping[str, str | None]  # named special tokens the class assumes when the config is silent
    rebuild: Callable[[tokenizers.Tokenizer, Mapping[str, Any], Mapping[str, str]], None]


_BPE_DEFAULTS: dict[str, Any] = {
    "dropout": None,
    "unk_token": None,
    "continuing_subword_prefix": None,
    "end_of_word_suffix": None,
    "fuse_unk": False,
    "byte_fallback": False,
    "ignore_merges": False,
}


def _set_bpe_flags(backend: tokenizers.Tokenizer, **flags: Any) -> None:
    """Give the BPE model exactly the flags the class constructs it with; unnamed ones take BPE defaults."""
    for name, value in {**_BPE_DEFAULTS, **flags}.items():
        setattr(backend.model, name, value)


def _rebuild_llama(backend: tokenizers.Tokenizer, config: Mapping[str, Any], _: Mapping[str, str]) -> None:
    """Metaspace with no normalizer: '▁' is prepended only to the first piece unless `legacy`.

    Legacy-converted tokenizer.json files prepend it in the normalizer, i.e. also after every
    special token, and turn a leading space into '▁▁'; this is where they differ.
    """
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = "never" if not add_prefix_space else "always" if config.get("legacy", False) else "first"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    _set_bpe_flags(backend, fuse_unk=True, byte_fallback=True)


def _rebuild_gemma(backend: tokenizers.Tokenizer, _: Mapping[str, Any], named: Mapping[str, str]) -> None:
    """Spaces become '▁' in the normalizer and pieces split after each one; bytes fall back."""
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _set_bpe_flags(backend, unk_token=named.get("unk_token"), fuse_unk=True, byte_fallback=True)


# Qwen2Tokenizer's pre-tokenization pattern: like GPT-4's but one digit per piece.
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _rebuild_qwen2(backend: tokenizers.Tokenizer, config: Mapping[str, Any], _: Mapping[str, str]) -> None:
    """NFC, then the Qwen2 split pattern, then byte-level mapping without its own regex."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    _set_bpe_flags(backend, continuing_subword_prefix="", end_of_word_suffix="")


def _rebuild_gpt2(backend: tokenizers.Tokenizer, config: Mapping[str, Any], _: Mapping[str, str]) -> None:
    """Plain GPT-2 byte-level BPE: any extra pre-tokenizer (e.g. digit splitting) in the file is dropped."""
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False))
    backend.decoder = decoders.ByteLevel()
    _set_bpe_flags(backend, continuing_subword_prefix="", end_of_word_suffix="")


_FAMILIES: dict[str, _Family] = {
    "LlamaTokenizer": _Family({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, _rebuild_llama),
    "GemmaTokenizer": _Family(
        {
            "unk_token": "<unk>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
        _rebuild_gemma,
    ),
    "Qwen2Tokenizer": _Family(
        {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, _rebuild_qwen2
    ),
    "GPT2Tokenizer": _Family(
        {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}, _rebuild_gpt2
    ),
}

_AS_IS = "TokenizersBackend"  # transformers' plain backend: tokenizer.json used verbatim

# The tokenizer class transformers registers for a config.json model_type (LLM families only).
_CLASS_BY_MODEL_TYPE: dict[str, str] = {
    **dict.fromkeys("gemma gemma2 gemma3 gemma3_text gemma3n gemma3n_text recurrent_gemma".split(), "GemmaTokenizer"),
    **dict.fromkeys(
        "qwen2 qwen2_moe qwen2_vl qwen2_5_vl qwen3 qwen3_moe qwen3_next qwen3_vl qwen3_vl_moe".split(), "Qwen2Tokenizer"
    ),
    **dict.fromkeys("gpt2 gpt_neo gptj codegen opt phi starcoder2 dbrx".split(), "GPT2Tokenizer"),
    **dict.fromkeys(
        (
            "mistral mistral3 ministral ministral3 mixtral pixtral phi3 phimoe granite granitemoe granitemoehybrid "
            "granitemoeshared olmo2 olmo3 internlm2 internlm3 glm glm4 glm4_moe stablelm nemotron jamba ernie4_5 "
            "ernie4_5_moe minimax_m2 persimmon gpt_bigcode arctic llava llava_next smolvlm minicpm3 kimi_linear"
        ).split(),
        _AS_IS,
    ),
}

# model_types whose registered class beats the hub's tokenizer_class (transformers knows it is wrong there).
_MODEL_TYPE_BEATS_HUB_CLASS = frozenset({"qwen2"})


def _hub_class(config: Mapping[str, Any], model_config: Mapping[str, Any]) -> str | None:
    """The declared tokenizer class without its `Fast` suffix (transformers 5 has one class per tokenizer)."""
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    return str(declared).removesuffix("Fast") if declared else None


def _pipeline_class(hub_class: str | None, model_type: str | None, byte_level: bool) -> str | None:
    """The tokenizer class AutoTokenizer builds (its `Fast` suffix dropped); None or unknown means as-is.

    Mirrors transformers 5.23: the hub's tokenizer_class wins unless config.json's model_type is
    registered to the plain backend (tokenizer.json as-is) or is known to carry a wrong class, and
    a Llama class over a byte-level tokenizer.json (Llama 3 style) also keeps the file as-is.
    """
    registered = _CLASS_BY_MODEL_TYPE.get(model_type or "")
    if hub_class is None or model_type in _MODEL_TYPE_BEATS_HUB_CLASS:
        return registered
    if (hub_class == "LlamaTokenizer" and byte_level) or registered == _AS_IS:
        return None
    return hub_class


# --- decoding and chat-template helpers ---------------------------------------------------------


# What transformers' `clean_up_tokenization_spaces` un-spaces, in its order.
_SPACED_PUNCTUATION = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


def _clean_up_tokenization(text: str) -> str:
    """Drop the spaces WordPiece-style decoding puts around punctuation and contractions."""
    for spaced in _SPACED_PUNCTUATION:
        text = text.replace(spaced, spaced.strip(" "))
    return text


def _as_templates_take(messages: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages as transformers hands them to a template: keys whose value is None dropped
    (OpenAI's replies carry `content: null` beside tool calls, which a template may test with
    `in`; transformers' `_normalize_chat_messages`), and the reasoning under every name templates read."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _one_line(value: object) -> str:
    """Collapse whitespace so every error message stays on one line."""
    return " ".join(str(value).split())


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation (e.g. roles that do not alternate)."""
    raise TokenizerError(f"chat template rejected the messages: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    """Templates stamp the current date into system prompts (Llama 3.1+)."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's own tojson HTML-escapes and ignores json.dumps options; templates expect neither."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


@lru_cache(maxsize=1)
def _jinja_env() -> sandbox.BoundedEnvironment:
    """The sandbox and helpers transformers renders chat templates with (templates are untrusted code),
    bounded in time and size."""
    env = sandbox.BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
