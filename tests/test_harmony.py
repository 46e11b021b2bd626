"""gpt-oss's harmony format: a reply's `analysis` channel is its reasoning, its `final` channel
the answer, in the engine, the batch and the server's `reasoning_content`; `reasoning_effort`
reaches the chat template as its `reasoning_effort` variable.

The chat template is gpt-oss's own, as llama.cpp ships it (`models/templates/` in the
llama-cpp-python sdist, which the GGUF tests fetch too); no gpt-oss tokenizer is at hand, so a
small BPE is trained here with harmony's special tokens. The oracles: prompts rendered by
transformers' `apply_chat_template` on the same files, and replies (forced into channels by a
grammar over those special tokens) cut at the markers by a regular expression."""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import CORPUS, VOCAB, fetch_sdist
from hypothesis import given
from hypothesis import strategies as st
from test_models_gpt_oss import CONFIG
from test_reasoning import parts, raw_reply

import mlxinfer
from mlxinfer.batch import BatchGenerator, stream_generate
from mlxinfer.reasoning import HARMONY, effort_kwargs

LLAMA_CPP = "llama-cpp-python==0.3.36"
TEMPLATE = "vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"
# o200k_harmony's special tokens (tiktoken's openai_public lists them)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
            "<|end|>", "<|message|>", "<|call|>"]
ID = {t: i for i, t in enumerate(SPECIALS)}  # the trainer numbers special tokens first, in order
ASK = [{"role": "user", "content": "What is two plus two?"}]
WORDS = "/[a-z]{3,8}( [a-z]{2,8}){1,3}/"


def t(name: str) -> str:
    """A special token in a Lark grammar, by id (so it is sampled as that token, never spelled out)."""
    return f"<[{ID[name]}]>"


# analysis then final, as gpt-oss answers after `<|start|>assistant`
THINKING = {"type": "grammar", "lark": (
    f'start: {t("<|channel|>")} "analysis" {t("<|message|>")} {WORDS} {t("<|end|>")} '
    f'{t("<|start|>")} "assistant" {t("<|channel|>")} "final" {t("<|message|>")} {WORDS}')}
MESSAGE = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>(\w+).*?<\|message\|>(.*?)(?:<\|end\|>|\Z)", re.S)


def by_hand(raw: str) -> tuple[str, str]:
    """(reasoning, answer) of a harmony reply: the analysis bodies, and the other channels' bodies."""
    messages = MESSAGE.findall(raw)
    return ("".join(body for ch, body in messages if ch == "analysis"),
            "".join(body for ch, body in messages if ch != "analysis"))


# --- the splitter on its own ---

BODY = st.text(st.sampled_from(list("ab <|>/\n")), max_size=12).filter(lambda b: "<|" not in b)
HEADERS = {"analysis": "<|channel|>analysis", "final": "<|channel|>final",
           "commentary": "<|channel|>commentary to=functions.add <|constrain|>json"}


@given(st.lists(st.tuples(st.sampled_from(sorted(HEADERS)), BODY), min_size=1, max_size=4), st.data())
def test_streamed_channels_join_to_the_reply_cut_by_hand(messages, data):
    raw = "<|end|>".join(("<|start|>assistant" if i else "") + HEADERS[ch] + "<|message|>" + body
                         for i, (ch, body) in enumerate(messages))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    splitter, reasoning, answer = HARMONY.splitter(False), [], []
    for start, end in zip([0, *cuts], [*cuts, len(raw)]):
        r, a = splitter.push(raw[start:end])
        reasoning.append(r)
        answer.append(a)
    rest = splitter.flush()
    assert ("".join(reasoning) + rest[0], "".join(answer) + rest[1]) == by_hand(raw)


def test_text_without_channels_is_the_answer():
    for text in ("a plain answer", "<b>bold</b>", "<|sta", "x<|end|>"):
        splitter = HARMONY.splitter(False)
        first, rest = splitter.push(text), splitter.flush()
        assert (first[0] + rest[0], first[1] + rest[1]) == ("", text.replace("<|end|>", ""))
    inside = HARMONY.splitter(True)  # a prompt that opened the analysis channel
    assert inside.push("thought<|end|><|start|>assistant<|channel|>final<|message|>ok") == ("thought", "ok")


# --- a random gpt-oss with the real template ---

def gpt_oss_template() -> str:
    """gpt-oss's chat template (OpenAI's, as llama.cpp keeps it) out of the llama-cpp-python sdist."""
    sdist = fetch_sdist(LLAMA_CPP)
    with tarfile.open(sdist) as tar:
        return tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/{TEMPLATE}").read().decode()


def harmony_tokenizer(folder: Path, template: str) -> None:
    """A byte-level BPE whose special tokens are harmony's, with gpt-oss's template and ends of reply."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}))
    # gpt-oss ends a reply at <|return|> or <|call|>; <|end|> only ends a message
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ID["<|return|>"], ID["<|call|>"]], "pad_token_id": ID["<|endoftext|>"]}))


@pytest.fixture(scope="module")
def folder(hf_checkpoint, tmp_path_factory) -> Path:
    template = gpt_oss_template()
    out = tmp_path_factory.mktemp("harmony") / "model"
    shutil.copytree(hf_checkpoint("gpt_oss", **CONFIG), out)
    harmony_tokenizer(out, template)
    return out


@pytest.fixture(scope="module")
def model(folder):
    return mlxinfer.load(folder, dtype="float32")


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_analysis_is_the_reasoning_and_final_the_answer(model):
    m, tok = model
    raw = raw_reply(model, ASK, max_tokens=60, response_format=THINKING)
    assert raw.startswith("<|channel|>analysis<|message|>") and "<|channel|>final<|message|>" in raw
    reasoning, answer = by_hand(raw)
    assert reasoning and answer
    chunks = list(stream_generate(m, tok, ASK, temperature=0.0, max_tokens=60, response_format=THINKING))
    assert parts(chunks) == (reasoning, answer)
    assert not any("<|" in c.reasoning + c.text for c in chunks)  # no marker reaches either part

    engine = BatchGenerator(m, tok, max_batch=2)  # the batched engine splits the same way, side by side
    uids = [engine.submit(ASK, temperature=0.0, max_tokens=60, response_format=THINKING) for _ in range(2)]
    got: dict[int, list] = {uid: [] for uid in uids}
    for uid, chunk in engine.stream():
        got[uid].append(chunk)
    assert all(parts(got[uid]) == (reasoning, answer) for uid in uids)


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_reaches_the_template(model, hf_tokenizer, effort):
    m, tok = model
    assert effort_kwargs(tok, effort) == {"reasoning_effort": effort}  # no enable_thinking switch to set
    expected = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                                reasoning_effort=effort, return_dict=False)
    assert f"Reasoning: {effort}" in hf_tokenizer.decode(expected)
    cache = mlxinfer.PromptCache.for_model(m)
    list(stream_generate(m, tok, ASK, prompt_cache=cache, max_tokens=1,
                         chat_template_kwargs=effort_kwargs(tok, effort)))
    assert cache.tokens[: len(expected)] == list(expected)


# --- the server, with the official openai client ---

@pytest.fixture(scope="module")
def client(folder):
    from serving import Server

    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    server = Server(["-m", str(folder), "--dtype", "float32"])
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_server_reasoning_content_and_effort(client, model, hf_tokenizer):
    reasoning, answer = by_hand(raw_reply(model, ASK, max_tokens=60, response_format=THINKING))
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=60, response_format=THINKING)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    events = list(client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=60,
                                                 response_format=THINKING, stream=True))
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == answer
    for effort in ("low", "high"):
        expected = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                                    reasoning_effort=effort, return_dict=False)
        r = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, reasoning_effort=effort)
        assert r.usage.prompt_tokens == len(expected), effort
