"""Constrained decoding against oracles nobody here wrote: the `jsonschema` package
validates every JSON reply, `re.fullmatch` every regex reply, numpy recomputes the
greedy choice over the legal tokens from the model's own logits, and scipy's chi-square
compares sampled first tokens with the model's distribution renormalised over them.
The legal set in those last two comes from the tokenizer's own decoding, not llguidance."""

from __future__ import annotations

import json
import re
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from conftest import REAL_TOKENIZERS, real_tokenizer
from mlxinfer.models.cache import make_cache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.text.constrain import grammar_tokenizer
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.text.tokenizer import load_tokenizer_from_dir

jsonschema = pytest.importorskip("jsonschema")
scipy_stats = pytest.importorskip("scipy.stats")

TEXTS = ["Hello, world!", "  two  spaces\n\ttab", "naïve café 日本語 🤖", "def f(x):\n    return x**2  # ok",
         '{"a": [1, 2.5e-3, null], "b": "\\u00e9"}', "x" * 40, "\n\n\n", "émoji 👋🏽 mix 123456789"]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


# --- the tokenizer bridge ---

@pytest.mark.parametrize("name", REAL_TOKENIZERS)
def test_grammar_tokenizer_sees_our_tokens_bytes(name):
    """Every token our tokenizer produces means the same bytes to the grammar engine."""
    tok = load_tokenizer_from_dir(real_tokenizer(name))
    ll = grammar_tokenizer(tok, tok.vocab_size)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        got = ll.decode_bytes(ids)
        # SentencePiece encoders add a dummy-prefix space that decoding drops
        assert got in (text.encode(), b" " + text.encode()), (name, text, got)
        assert tok.decode(ll.tokenize_str(text)).lstrip(" ") == text.lstrip(" ")
    for eos in tok.eos_token_ids:
        assert ll.is_special_token(eos)


# --- formats on a real model: every reply valid ---

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "boolean"}]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 2}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -5, "maximum": 5},
                                      "ratio": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "enum": [7, 9]}},
     "required": ["kind", "lives"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    from mlxinfer.convert import convert

    folder = tmp_path_factory.mktemp("smollm2") / "model"
    convert(smollm2_gguf, folder)
    return mlxinfer.load(folder)


@pytest.fixture(scope="module")
def smollm2_cache(smollm2) -> PromptCache:
    """One prompt cache for the real model's runs of the same prompt: each prefills only what
    differs from the last (a reused cache gives what a fresh one does, tests/test_pool.py)."""
    return PromptCache(make_cache(smollm2[0]))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_replies_validate(smollm2, smollm2_cache, index):
    model, tok = smollm2
    schema = SCHEMAS[index]
    messages = [{"role": "user", "content": "Reply with JSON only."}]
    for seed in range(3):
        chunks = list(mlxinfer.stream_generate(model, tok, messages, smollm2_cache, max_tokens=96, temperature=1.0,
                                               seed=seed, response_format=schema_format(schema)))
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason == "stop", (schema, seed, text)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_regex_and_lark_on_a_real_model(smollm2, smollm2_cache):
    model, tok = smollm2
    ask = [{"role": "user", "content": "Say something."}]
    for seed in range(3):
        person = [{"role": "user", "content": "Give a JSON object with a person's name and age."}]
        # free-form JSON has no bound on its strings and numbers: at 1.0 this small model can ramble on in one
        chunks = list(mlxinfer.stream_generate(model, tok, person, smollm2_cache, max_tokens=200, temperature=0.7,
                                               seed=seed, response_format={"type": "json_object"}))
        assert chunks[-1].finish_reason == "stop"
        assert isinstance(json.loads("".join(c.text for c in chunks)), dict)
        pattern = r"(yes|no), [0-9]{1,3} (apples|pears)"
        text = mlxinfer.generate(model, tok, ask, prompt_cache=smollm2_cache, max_tokens=32, temperature=1.0, seed=seed,
                                 response_format={"type": "regex", "pattern": pattern})
        assert re.fullmatch(pattern, text), text
        lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,5}/'
        text = mlxinfer.generate(model, tok, ask, prompt_cache=smollm2_cache, max_tokens=32, temperature=1.0, seed=seed,
                                 response_format={"type": "grammar", "lark": lark})
        assert re.fullmatch(r"\([a-z]{1,5}(,[a-z]{1,5})*\)", text), text


# --- exactness on the tiny model ---

LOWER = re.compile(r"[a-z]+")


def lowercase_tokens(tok, vocab_size: int) -> np.ndarray:
    """Token ids whose text is one or more lowercase letters (the legal set of /[a-z]+/)."""
    return np.array([i for i in range(min(vocab_size, tok.vocab_size)) if LOWER.fullmatch(tok.decode([i]))])


def assert_follows(counts: Counter, legal: np.ndarray, p: np.ndarray, n: int) -> None:
    """`n` draws counted in `counts` come only from `legal` and follow `p` over it (chi-square)."""
    assert set(counts) <= set(legal.tolist())
    expected = n * p
    big = expected >= 5  # chi-square needs expected counts of at least 5: the rest form one bin
    observed = np.array([counts.get(int(t), 0) for t in legal])
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert scipy_stats.chisquare(obs[keep], exp[keep]).pvalue > 1e-3


def test_greedy_is_argmax_over_the_legal_tokens(loaded):
    model, tok = loaded
    prompt = tok.encode("the quick brown fox")
    out = list(mlxinfer.stream_generate(model, tok, prompt, max_tokens=12, temperature=0.0,
                                        response_format={"type": "regex", "pattern": "[a-z]+"}))
    legal = lowercase_tokens(tok, model.config.vocab_size)
    eos = np.array(tok.eos_token_ids)
    ids = list(prompt)
    for step, chunk in enumerate(c for c in out if c.token is not None):
        logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))
        allowed = np.concatenate([legal, eos]) if step else legal  # EOS once the match is non-empty
        assert chunk.token == allowed[np.argmax(logits[allowed])], f"step {step}"
        ids.append(chunk.token)


def test_sampled_first_token_follows_the_renormalised_distribution(loaded):
    model, tok = loaded
    prompt = tok.encode("once upon a")
    legal = lowercase_tokens(tok, model.config.vocab_size)
    logits = np.array(model(mx.array([prompt]))[0, -1].astype(mx.float64))[legal] / 1.5
    p = np.exp(logits - logits.max())
    p /= p.sum()
    n = 1500
    counts = Counter(next(iter(mlxinfer.stream_generate(
        model, tok, prompt, max_tokens=1, temperature=1.5, seed=s,
        response_format={"type": "regex", "pattern": "[a-z]+"}))).token for s in range(n))
    assert_follows(counts, legal, p, n)


def test_length_cut_leaves_an_incomplete_reply(loaded):
    model, tok = loaded
    chunks = list(mlxinfer.stream_generate(model, tok, "x", max_tokens=3,
                                           response_format=schema_format({"type": "array", "minItems": 5})))
    assert chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks).startswith("[")


@pytest.mark.parametrize("fmt, fact", [
    ({"type": "xml"}, "'xml' is not supported"),
    ({"type": "json_schema"}, "json_schema"),
    (schema_format({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (schema_format({"not": {"type": "string"}}), "not"),
    (schema_format({"type": "string", "format": "uri-template"}), "uri-template"),
    ({"type": "regex", "pattern": "a(b"}, "unclosed group"),
    ({"type": "grammar", "lark": "start: foo"}, "foo"),
    ("json", "not supported"),
])
def test_what_cannot_be_enforced_is_refused(loaded, fmt, fact):
    model, tok = loaded
    with pytest.raises(InvalidOptionError) as e:
        mlxinfer.generate(model, tok, "x", max_tokens=2, response_format=fmt)
    assert fact in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ignore_eos_is_refused_with_a_format(loaded):
    model, tok = loaded
    with pytest.raises(InvalidOptionError, match="ignore_eos"):
        mlxinfer.generate(model, tok, "x", response_format={"type": "json_object"}, ignore_eos=True)


def test_text_format_is_no_constraint(loaded):
    model, tok = loaded
    plain = mlxinfer.generate(model, tok, "hello", max_tokens=8, temperature=0.0)
    assert mlxinfer.generate(model, tok, "hello", max_tokens=8, temperature=0.0,
                             response_format={"type": "text"}) == plain


def test_bridge_is_built_once_per_tokenizer(loaded):
    model, tok = loaded
    assert grammar_tokenizer(tok, model.config.vocab_size) is grammar_tokenizer(tok, model.config.vocab_size)


# --- speculative decoding under a constraint: same outputs, same distribution ---

@pytest.fixture(scope="module")
def other_draft(hf_checkpoint):
    """A smaller model with other weights: its drafts are often rejected."""
    return mlxinfer.load(hf_checkpoint("llama", head_dim=32, num_hidden_layers=1, seed=7), dtype="float32")[0]


@pytest.mark.parametrize("drafter", ["prompt_lookup", "other_draft", "self_draft"])
def test_speculative_greedy_under_a_constraint_equals_plain(loaded, other_draft, drafter):
    model, tok = loaded
    option = {"prompt_lookup": dict(prompt_lookup=True), "other_draft": dict(draft_model=other_draft),
              "self_draft": dict(draft_model=model)}[drafter]
    fmt = {"type": "regex", "pattern": "([a-z]+ ){2,12}"}
    prompt = tok.encode("the cat the cat the cat sat on the mat the cat")
    plain = list(mlxinfer.stream_generate(model, tok, prompt, max_tokens=40, response_format=fmt))
    spec = list(mlxinfer.stream_generate(model, tok, prompt, max_tokens=40, response_format=fmt, **option))
    assert [c.token for c in spec] == [c.token for c in plain]
    assert spec[-1].stats.rounds > 0
    assert re.fullmatch(r"([a-z]+ ){2,12}", "".join(c.text for c in spec)) or spec[-1].finish_reason == "length"


def test_speculative_sampling_under_a_constraint_keeps_the_distribution(loaded, other_draft):
    """The first token of a draft-model round: drafted from the draft's masked distribution,
    verified against the target's masked one; it must follow the target's."""
    model, tok = loaded
    prompt = tok.encode("once upon a")
    legal = lowercase_tokens(tok, model.config.vocab_size)
    logits = np.array(model(mx.array([prompt]))[0, -1].astype(mx.float64))[legal]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    n = 800
    counts = Counter(next(iter(mlxinfer.stream_generate(
        model, tok, prompt, max_tokens=3, temperature=1.0, seed=s, draft_model=other_draft,
        response_format={"type": "regex", "pattern": "[a-z]+"}))).token for s in range(n))
    assert_follows(counts, legal, p, n)


# --- batched decoding: one matcher per sequence ---

def test_batched_constrained_sequences_equal_their_solo_runs(loaded):
    model, tok = loaded
    items = [
        (tok.encode("the quick brown fox"), dict(max_tokens=12, response_format={"type": "regex", "pattern": "[a-z ]+"})),
        (tok.encode("hello"), dict(max_tokens=10)),
        (tok.encode("once upon a time"), dict(max_tokens=16, temperature=1.0, seed=5,
                                              response_format={"type": "regex", "pattern": "[0-9]{2,6}"})),
        (tok.encode("x y z"), dict(max_tokens=12, response_format={"type": "grammar",
                                                                   "lark": 'start: ("ab" | "c")+'})),
    ]
    engine = mlxinfer.BatchGenerator(model, tok)
    uids = [engine.submit(ids, **opts) for ids, opts in items]
    got: dict[int, list] = {u: [] for u in uids}
    for uid, chunk in engine.stream():
        got[uid].append(chunk)
    assert engine.stats.max_batch_seen == len(items)
    for (ids, opts), uid in zip(items, uids):
        want = list(mlxinfer.stream_generate(model, tok, ids, **opts))
        assert [c.token for c in got[uid]] == [c.token for c in want], opts
        assert [c.finish_reason for c in got[uid]] == [c.finish_reason for c in want]
    assert re.fullmatch("[0-9]{2,6}", "".join(c.text for c in got[uids[2]]))


def test_chat_session_holds_every_reply_to_its_format(loaded):
    model, tok = loaded
    fmt = {"type": "regex", "pattern": "[a-z]{3,6}"}
    session = mlxinfer.ChatSession(model, tok, response_format=fmt, max_tokens=10)
    first = "".join(c.text for c in session.send("hello"))
    assert first == mlxinfer.generate(model, tok, [{"role": "user", "content": "hello"}], max_tokens=10,
                                      response_format=fmt)
    second = "".join(c.text for c in session.send("more"))
    assert re.fullmatch("[a-z]{3,6}", first) and re.fullmatch("[a-z]{3,6}", second)
    session.set_option("response_format", None)
    with pytest.raises(InvalidOptionError, match="uniqueItems"):
        session.set_option("response_format", schema_format({"type": "array", "uniqueItems": True}))
