"""Rebuild Hugging Face tokenizer files from a GGUF file's `tokenizer.ggml.*` metadata.

llama.cpp keeps the vocabulary, merges, token types and special ids, and names the
pre-tokenizer (`tokenizer.ggml.pre`) instead of storing it; each supported name maps
to the normalizer / split pattern llama.cpp applies for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from mlxinfer.base.errors import TokenizerError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)

_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = _WORDS + r"\p{N}{1,3}" + _REST  # numbers in chunks of up to three digits
_QWEN2_SPLIT = _WORDS + r"\p{N}" + _REST  # one digit per piece
# Qwen3.5: Qwen2's split with combining marks (\p{M}) kept inside words
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE for one `tokenizer.ggml.pre` name."""

    make: Callable[[], pre_tokenizers.PreTokenizer]
    normalizer: Callable[[], normalizers.Normalizer] | None = None
    ignore_merges: bool = False  # whole words found in the vocabulary skip the merges (Llama 3)


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_GPT2 = PreTokenizer(lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
_LLAMA3 = PreTokenizer(_split_then_bytes(_LLAMA3_SPLIT), ignore_merges=True)
_QWEN2 = PreTokenizer(_split_then_bytes(_QWEN2_SPLIT), normalizer=normalizers.NFC)
PRE_TOKENIZERS = {
    "gpt-2": _GPT2,
    "smollm": PreTokenizer(
        lambda: pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _GPT2.make()]
        )
    ),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "lfm2": _LLAMA3,  # llama.cpp runs LFM2's tokenizer as Llama 3's
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": PreTokenizer(_split_then_bytes(_QWEN35_SPLIT), normalizer=normalizers.NFC),
}


def tokenizer_json(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer` (save it as tokenizer.json)."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError("the GGUF file has no vocabulary (tokenizer.ggml.tokens); use a GGUF with its tokenizer")
    if kind == "gpt2":
        tok = _byte_level_bpe(meta)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta)
    else:
        raise TokenizerError(
            f"GGUF tokenizer model '{kind}' is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece)"
        )
    _add_special_tokens(tok, meta)
    tok.post_processor = _post_processor(meta, tok.post_processor)
    return tok


def _vocab(meta: dict[str, Any]) -> dict[str, int]:
    """token -> id; a token listed twice keeps its first id."""
    tokens = meta["tokenizer.ggml.tokens"]
    return {t: i for i, t in reversed(list(enumerate(tokens)))}


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    name = meta.get("tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"GGUF pre-tokenizer '{name}' is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}; "
            "convert the original Hugging Face checkpoint instead"
        )
    pre = PRE_TOKENIZERS[name]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    try:
        model = models.BPE(_vocab(meta), merges, ignore_merges=pre.ignore_merges)
    except Exception as e:  # the tokenizers library raises a bare Exception for a merge of unknown tokens
        raise TokenizerError(f"the GGUF file's tokenizer.ggml.merges do not fit its vocabulary ({e})") from None
    tok = Tokenizer(model)
    if pre.normalizer:
        tok.normalizer = pre.normalizer()
    tok.pre_tokenizer = pre.make()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): GGUF keeps piece scores, not merges. A piece's merges are
    every split into two known pieces, ranked by the merged piece's score (higher merges first)."""
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = _vocab(meta)
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab, merges, unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if prefix else decode)
    return tok


def _add_special_tokens(tok: Tokenizer, meta: dict[str, Any]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so
    both are matched whole before the BPE model sees the text."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def _post_processor(meta: dict[str, Any], base: processors.PostProcessor | None) -> processors.PostProcessor | None:
    """BOS/EOS added to every encoding when the GGUF says llama.cpp adds them."""
    tokens = meta["tokenizer.ggml.tokens"]
    ends = []
    for key, side in (("bos", 0), ("eos", 1)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if meta.get(f"tokenizer.ggml.add_{key}_token") and token_id is not None:
            ends.append((side, tokens[token_id], token_id))
    if not ends:
        return base
    before = [t for side, t, _ in ends if side == 0]
    after = [t for side, t, _ in ends if side == 1]
    template = processors.TemplateProcessing(
        single=[*before, "$A", *after],
        pair=[*before, "$A", *after, *before, "$B:1", *after],
        special_tokens=[(t, i) for _, t, i in ends],
    )
    return processors.Sequence([base, template]) if base else template


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: named special tokens and the chat template.

    The class is the generic fast tokenizer so loaders use tokenizer.json as written
    rather than rebuilding a family's default pre-tokenizer over it."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, "bos"),
        "eos_token": _token(meta, "eos"),
        "unk_token": _token(meta, "unknown"),
        "pad_token": _token(meta, "padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "chat_template": _chat_template(meta),
    }
    return {k: v for k, v in config.items() if v is not None}


def _token(meta: dict[str, Any], key: str) -> str | None:
    tokens = meta["tokenizer.ggml.tokens"]
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[token_id] if token_id is not None and token_id < len(tokens) else None


def _chat_template(meta: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """The default template, or transformers' list form when the file also has named ones."""
    default = meta.get("tokenizer.chat_template")
    names = meta.get("tokenizer.chat_templates") or []
    if not names:
        return default
    named = [{"name": n, "template": meta[f"tokenizer.chat_template.{n}"]} for n in names]
    return ([{"name": "default", "template": default}] if default else []) + named


_SAMPLING = {
    "temperature": "temp",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "penalty_repeat",
}


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: every stop id (eos, end-of-turn, end-of-message) and the
    sampling defaults the file recommends (general.sampling.*)."""
    stops = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(i for i in stops if i is not None))
    config: dict[str, Any] = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    config.update({hf: meta.get(f"general.sampling.{key}") for hf, key in _SAMPLING.items()})
    if config["temperature"] is not None:
        config["do_sample"] = config["temperature"] > 0
    return {k: v for k, v in config.items() if v is not None}
