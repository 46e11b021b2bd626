"""Streaming detokenization: the pieces always concatenate to `decode(all ids)`,
and no piece ends inside a multi-byte character. Property-tested on every real
tokenizer the tests fetch (byte-level BPE and SentencePiece with byte fallback)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REAL_TOKENIZERS, real_tokenizer
from mlxinfer.text.tokenizer import load_tokenizer_from_dir

TEXTS = [
    "Hello, world! 👋🏽 Ça va? 你好，世界。こんにちは",
    "e\u0301 a\u0308 n\u0303 — combining marks; ﬁ ligature; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n\treturn x ** 2  # 🐍\n\n\n",
    "  leading and trailing spaces   ",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag, 🏳️‍🌈 rainbow",
    "Émoji at the end 🎉",
]


@pytest.fixture(scope="module", params=REAL_TOKENIZERS)
def tok(request):
    return load_tokenizer_from_dir(real_tokenizer(request.param))


def check(tok, ids: list[int]) -> None:
    pieces = list(tok.stream_decode(ids))
    assert "".join(pieces) == tok.decode(ids)
    for p in pieces[:-1]:
        assert p, "empty piece emitted"


@pytest.mark.parametrize("text", TEXTS)
def test_real_text(tok, text):
    check(tok, tok.encode(text))
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True) if tok.chat_template else []
    check(tok, ids)


def test_never_emits_half_a_character(tok):
    ids = tok.encode("中文🎉 naïve 🇫🇷")
    detok = tok.detokenizer()
    for i in ids:
        assert "\ufffd" not in detok.add(i)
    detok.finalize()
    assert detok.text == tok.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_sequences(tok, data):
    vocab = tok.vocab_size
    special = sorted(tok.special_ids) or [0]
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(special), st.integers(0, min(600, vocab - 1)))
    check(tok, data.draw(st.lists(token, max_size=40)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60))
def test_random_text(tok, text):
    check(tok, tok.encode(text, add_special_tokens=False))
