"""Reasoning: a thinking model's thoughts told apart from its answer.

A tiny random-weight Qwen3 with the real Qwen3 tokenizer and template is made to think by a
Lark grammar (`<think>` words `</think>` words, the tags as their own tokens), so its replies
have both parts. The oracle is the reply generated without the split (the raw text, tags
included), cut by hand at the tags; the prompts the engine renders are checked against
transformers' `apply_chat_template` on the same tokenizer files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlxinfer
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.engine.generate import stream_generate
from mlxinfer.engine.chat import ChatSession
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.text.reasoning import THINK, Splitter, effort_kwargs, thinking_switch
from mlxinfer.cli.terminal import DIM

ROOT = Path(__file__).resolve().parents[1]
THINK_ID, END_THINK_ID = 151667, 151668  # Qwen3's <think> and </think>
WORDS = "/[a-z]{3,8}( [a-z]{2,8}){1,3}/"
# A reply that thinks, then answers: the tags are Qwen3's own tokens, the words free.
THINKING = {"type": "grammar", "lark": f'start: <[{THINK_ID}]> "\\n" {WORDS} "\\n" <[{END_THINK_ID}]> "\\n\\n" {WORDS}'}
ASK = [{"role": "user", "content": "What is two plus two?"}]


def by_hand(raw: str, inside: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a raw reply, cut at the tags: the thinking between them without
    its surrounding newlines, the answer after them without its leading ones (Qwen3's template
    cuts a reply it renders back the same way)."""
    text = "<think>" + raw if inside else raw
    if not text.lstrip().startswith("<think>"):
        return "", text
    before, closed, after = text.lstrip()[len("<think>"):].partition("</think>")
    return before.strip("\n"), after.lstrip("\n") if closed else ""


# --- the splitter on its own ---

PIECES = ["<think>", "</think>", "<", "</", "think", ">", "\n", "\n\n", "a", "b c", " "]


@given(st.lists(st.sampled_from(PIECES), max_size=24), st.booleans(), st.data())
def test_streamed_parts_join_to_the_reply_cut_by_hand(pieces, inside, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    splitter, thinking, answer = Splitter(THINK, inside), [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        parts = splitter.push(text[start:end])
        thinking.append(parts[0])
        answer.append(parts[1])
    rest = splitter.flush()
    assert ("".join(thinking) + rest[0], "".join(answer) + rest[1]) == by_hand(text, inside)


# --- a thinking Qwen3 ---

@pytest.fixture(scope="module")
def thinker(hf_checkpoint, qwen3_tokenizer, tmp_path_factory) -> Path:
    """A random-weight Qwen3 with the real Qwen3 tokenizer and chat template."""
    src = hf_checkpoint("qwen3", vocab_size=151936, tie_word_embeddings=True, head_dim=32,
                        max_position_embeddings=1024)
    folder = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(src, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def r1(thinker, tmp_path_factory) -> Path:
    """The same model under a DeepSeek-R1-style template: the prompt ends inside an opened <think>."""
    folder = tmp_path_factory.mktemp("r1") / "model"
    shutil.copytree(thinker, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    assert template.count("'<|im_start|>assistant\\n' }}") == 1
    config["chat_template"] = template.replace("'<|im_start|>assistant\\n' }}", "'<|im_start|>assistant\\n<think>\\n' }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def model(thinker):
    return mlxinfer.load(thinker, dtype="float32")


@pytest.fixture(scope="module")
def hf_tokenizer(thinker):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinker)


def parts(chunks) -> tuple[str, str]:
    return "".join(c.reasoning for c in chunks), "".join(c.text for c in chunks)


def test_thinking_and_answer_split_as_the_raw_reply_cut_by_hand(model):
    m, tok = model
    raw = "".join(c.text for c in stream_generate(m, tok, ASK, temperature=0.0, max_tokens=80,
                                                  response_format=THINKING, split_reasoning=False))
    assert raw.startswith("<think>\n") and "\n</think>\n\n" in raw  # the grammar made it think
    chunks = list(stream_generate(m, tok, ASK, temperature=0.0, max_tokens=80, response_format=THINKING))
    thinking, answer = by_hand(raw)
    assert thinking and answer
    assert parts(chunks) == (thinking, answer)
    # no piece of a tag ever reaches either part; each token's chunk says which part it added to
    assert not any("<" in c.reasoning or "<" in c.text or ">" in c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"

    engine = BatchGenerator(m, tok, max_batch=2)  # the batched engine splits the same way, side by side
    uids = [engine.submit(ASK, temperature=0.0, max_tokens=80, response_format=THINKING) for _ in range(2)]
    got: dict[int, list] = {uid: [] for uid in uids}
    for uid, chunk in engine.stream():
        got[uid].append(chunk)
    assert all(parts(got[uid]) == (thinking, answer) for uid in uids)


def test_stop_strings_apply_to_the_answer_only(model):
    m, tok = model
    whole = list(stream_generate(m, tok, ASK, temperature=0.0, max_tokens=80, response_format=THINKING))
    thinking, answer = parts(whole)
    word, last = thinking.split()[0], answer.split()[-1]
    stopped = list(stream_generate(m, tok, ASK, temperature=0.0, max_tokens=80, response_format=THINKING,
                                   stop=[word, last]))
    # the thinking holds a stop string yet runs whole; the answer is cut before the first it holds
    cut = min(i for i in (answer.find(word), answer.find(last)) if i >= 0)
    assert parts(stopped) == (thinking, answer[:cut])
    assert stopped[-1].finish_reason == "stop"


def test_enable_thinking_false_renders_transformers_empty_block(model, hf_tokenizer):
    m, tok = model
    expected = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                                enable_thinking=False, return_dict=False)
    assert tok.decode(expected).endswith("<think>\n\n</think>\n\n")
    cache = mlxinfer.PromptCache.for_model(m)
    chunks = list(stream_generate(m, tok, ASK, prompt_cache=cache, temperature=0.0, max_tokens=6,
                                  chat_template_kwargs={"enable_thinking": False}))
    assert chunks[-1].stats.prompt_tokens == len(expected) and cache.tokens[: len(expected)] == list(expected)
    raw = "".join(c.text for c in stream_generate(m, tok, ASK, temperature=0.0, max_tokens=6,
                                                  chat_template_kwargs={"enable_thinking": False},
                                                  split_reasoning=False))
    assert parts(chunks) == ("", raw)  # the prompt closed the thinking: the reply is all answer


def test_a_prompt_that_opens_the_thinking_starts_the_reply_in_it(r1):
    m, tok = mlxinfer.load(r1, dtype="float32")
    assert tok.apply_chat_template(ASK).endswith("<think>\n")
    rest = {"type": "grammar", "lark": f'start: {WORDS} "\\n" <[{END_THINK_ID}]> "\\n\\n" {WORDS}'}
    for fmt in (rest, None):  # thinking that closes, and thinking that runs to max_tokens
        raw = "".join(c.text for c in stream_generate(m, tok, ASK, temperature=0.0, max_tokens=30,
                                                      response_format=fmt, split_reasoning=False))
        chunks = list(stream_generate(m, tok, ASK, temperature=0.0, max_tokens=30, response_format=fmt))
        assert parts(chunks) == by_hand(raw, inside=True)
        assert parts(chunks)[0]


def test_chat_session_keeps_the_thinking_apart_and_renders_the_next_turn_as_transformers(model, hf_tokenizer):
    m, tok = model
    session = ChatSession(m, tok, temperature=0.0, max_tokens=80, response_format=THINKING)
    chunks = list(session.send("What is two plus two?"))
    thinking, answer = parts(chunks)
    assert thinking and session.reply == answer
    assert session.messages[-1] == {"role": "assistant", "content": answer, "reasoning_content": thinking}
    session.set_option("response_format", None)
    session.set_option("max_tokens", 3)
    second = list(session.send("And three plus three?"))
    # the oracle: transformers renders the first reply as the model wrote it, tags and all
    raw = f"<think>\n{thinking}\n</think>\n\n{answer}"
    messages = [*ASK, {"role": "assistant", "content": raw}, {"role": "user", "content": "And three plus three?"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    assert thinking not in tok.decode(expected)  # Qwen3's template drops old thinking
    assert second[-1].stats.prompt_tokens == len(expected)
    assert session.cache.tokens[: len(expected)] == list(expected)
    assert session.undo() and session.cache.tokens == list(
        hf_tokenizer.apply_chat_template([*ASK, {"role": "assistant", "content": raw}], tokenize=True,
                                         return_dict=False))


def test_thinking_switch_and_effort_follow_the_template(model, r1, llama31_tokenizer):
    _, tok = model
    assert thinking_switch(tok, False) == {"enable_thinking": False}
    assert effort_kwargs(tok, "none") == {"enable_thinking": False} == effort_kwargs(tok, "minimal")
    assert effort_kwargs(tok, "high") == {"enable_thinking": True} and effort_kwargs(tok, None) == {}
    with pytest.raises(InvalidOptionError, match="reasoning_effort must be one of"):
        effort_kwargs(tok, "extreme")
    r1_tok = mlxinfer.load_tokenizer(r1)
    assert "enable_thinking" in r1_tok.template_variables  # (the copied template still reads it)
    plain = mlxinfer.load_tokenizer(llama31_tokenizer)
    with pytest.raises(InvalidOptionError, match="does not think"):
        thinking_switch(plain, True)
    assert effort_kwargs(plain, "none") == {}  # no switch: a documented no-op


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": []}, {"add_generation_prompt": False}, ["x"],
                                    {"not a name": 1}])
def test_bad_template_kwargs_are_refused(model, kwargs):
    m, tok = model
    with pytest.raises(InvalidOptionError, match="chat_template_kwargs"):
        list(stream_generate(m, tok, ASK, max_tokens=1, chat_template_kwargs=kwargs))


# --- the command line and the REPL ---

def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxinfer", *args], cwd=str(ROOT), capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_COLOR": "1", **(env or {})})


def test_generate_json_puts_the_thinking_under_its_own_key(r1, hf_tokenizer):
    done = cli("generate", "-m", str(r1), "-p", "hi", "--temp", "0", "--max-tokens", "12", "--json",
               "--logprobs", "0")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    ids = [t["id"] for t in out["tokens"]][: -1 if out["finish_reason"] == "stop" else None]  # EOS is no text
    raw = hf_tokenizer.decode(ids)  # the reply's own tokens, decoded by transformers
    assert (out["reasoning"], out["text"]) == by_hand(raw, inside=True) and out["reasoning"]
    plain = cli("generate", "-m", str(r1), "-p", "hi", "--temp", "0", "--max-tokens", "12")
    assert plain.returncode == 0 and plain.stdout == out["text"] + "\n"  # stdout holds the answer alone ...
    assert out["reasoning"] in plain.stderr  # ... the thinking goes to stderr
    refused = cli("generate", "-m", str(r1), "-p", "hi", "--no-think", "--raw")
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].startswith("error: --think")


@pytest.mark.parametrize("color", [True, False])
def test_repl_shows_thinking_dimmed_and_think_off_renders_the_empty_block(thinker, hf_tokenizer, tmp_path, color):
    from test_repl import quit_, say, spawn

    grammar = tmp_path / "think.lark"
    grammar.write_text(THINKING["lark"])
    child = spawn(thinker, tmp_path / "home", "--max-tokens", "80", color=color)
    say(child, f"/format lark {grammar}")
    child.expect_exact(">>>")
    say(child, "What is two plus two?")
    child.expect(r"\[TTFT")
    shown = re.sub(r"\r\n", "\n", child.before)
    child.expect_exact(">>>")
    assert ((DIM + "Thinking...") in shown) == color and (DIM in shown) == color
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    found = re.search(r"Thinking\.\.\.\n(.*?)\n\.\.\.done thinking\.\n\n([^\n]*)\n", plain, re.S)
    assert found, plain
    answer = found.group(2)
    for line in ("/think off", "/format off"):
        say(child, line)
        child.expect_exact(">>>")
    say(child, "And three?")
    child.expect(r"\[TTFT")
    child.expect_exact(">>>")
    say(child, "/stats")
    child.expect(r"last reply: (\d+) prompt tokens")
    messages = [*ASK, {"role": "assistant", "content": answer}, {"role": "user", "content": "And three?"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                enable_thinking=False, return_dict=False)
    assert int(child.match.group(1)) == len(expected)
    child.expect_exact(">>>")
    quit_(child)


# --- the server, with the official openai client ---

def serving(folder: Path):
    """A server of `folder` for a module's tests, stopped after them."""
    from serving import Server

    pytest.importorskip("fastapi")
    s = Server(["-m", str(folder), "--dtype", "float32"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def served(thinker):
    yield from serving(thinker)


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def raw_reply(model, messages, **options) -> str:
    m, tok = model
    return "".join(c.text for c in stream_generate(m, tok, messages, temperature=0.0, split_reasoning=False,
                                                   **options))


def test_server_returns_the_thinking_apart(client, model):
    thinking, answer = by_hand(raw_reply(model, ASK, max_tokens=80, response_format=THINKING))
    assert thinking and answer
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=80,
                                       response_format=THINKING)
    message = r.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (thinking, thinking, answer)

    events = list(client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=80,
                                                 response_format=THINKING, stream=True))
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert deltas[0].role == "assistant"
    streamed = ["".join(getattr(d, key, None) or "" for d in deltas) for key in ("reasoning_content", "reasoning")]
    assert streamed == [thinking, thinking]
    assert "".join(d.content or "" for d in deltas) == answer
    assert not any("<" in (getattr(d, "reasoning_content", None) or "") + (d.content or "") for d in deltas)


def test_server_thinking_switches_and_a_reply_sent_back(client, model, hf_tokenizer):
    off = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, enable_thinking=False,
                                           return_dict=False)
    on = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    asked = {"none": off, "minimal": off, "low": on, "high": on}
    for effort, expected in asked.items():
        r = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, reasoning_effort=effort)
        assert r.usage.prompt_tokens == len(expected), effort
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off) != len(on)

    first = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=80,
                                           response_format=THINKING).choices[0].message
    follow = {"role": "user", "content": "And three?"}
    # the SDK's own message object sent back as it is: its thinking (reasoning_content, reasoning) included
    r = client.chat.completions.create(model="m", messages=[*ASK, first.model_dump(), follow], max_tokens=1)
    sent_back = {"role": "assistant", "content": first.content, "reasoning_content": first.reasoning_content}
    # the oracle's template sees the thinking under reasoning_content: here it is the last turn's, so it is kept
    expected = hf_tokenizer.apply_chat_template([*ASK, sent_back], tokenize=True, return_dict=False)
    assert first.reasoning_content in hf_tokenizer.decode(expected)
    expected_next = hf_tokenizer.apply_chat_template([*ASK, sent_back, follow], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(expected_next)


def test_server_text_completions_stay_raw_and_bad_switches_are_400(client, model, hf_tokenizer):
    openai = pytest.importorskip("openai")
    prompt = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    raw = raw_reply(model, prompt, max_tokens=80, response_format=THINKING)
    r = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=80,
                                  extra_body={"response_format": THINKING})
    assert r.choices[0].text == raw and raw.startswith("<think>")
    for body, field in (({"reasoning_effort": "extreme"}, "reasoning_effort"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": "on"}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=1, extra_body=body)
        assert field in str(e.value)


# --- the Responses and Messages APIs: the same switch, the thinking as their own items ---

def test_responses_effort_and_anthropic_thinking_switch_the_template(served, client, hf_tokenizer):
    anthropic = pytest.importorskip("anthropic")
    off = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, enable_thinking=False,
                                           return_dict=False)
    on = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(off) != len(on)
    for effort, expected in (("none", off), ("minimal", off), ("low", on), ("high", on)):
        r = client.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=1,
                                    reasoning={"effort": effort})
        assert r.usage.input_tokens == len(expected), effort
    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    for thinking, expected in (({"type": "disabled"}, off), ({"type": "enabled", "budget_tokens": 1024}, on),
                               (None, on)):
        extra = {"thinking": thinking} if thinking else {}
        counted = claude.messages.count_tokens(model="m", messages=ASK, **extra)
        assert counted.input_tokens == len(expected), thinking
        m = claude.messages.create(model="m", max_tokens=1, messages=ASK, **extra)
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(expected), thinking


@pytest.fixture(scope="module")
def served_r1(r1):
    yield from serving(r1)


def test_responses_and_messages_return_a_real_reply_s_thinking_as_their_own_items(served_r1, r1):
    """Under an R1-style template the reply starts inside the thinking: what the model says
    comes back as the Responses API's reasoning item and as Anthropic's thinking block."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    m, tok = mlxinfer.load(r1, dtype="float32")
    raw = "".join(c.text for c in stream_generate(m, tok, ASK, temperature=0.0, max_tokens=12, split_reasoning=False))
    thinking, answer = by_hand(raw, inside=True)
    assert thinking and not answer

    client = openai.OpenAI(base_url=f"{served_r1.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=12)
    items = [i for i in r.output if i.type == "reasoning"]
    assert len(items) == 1 and items[0].content[0].text == thinking
    assert r.output_text == "" and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=12, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    last = events[-1]  # cut by max_output_tokens: OpenAI's stream then ends in response.incomplete
    assert last.type == "response.incomplete" and deltas == thinking
    assert [i.content[0].text for i in last.response.output if i.type == "reasoning"] == [thinking]

    claude = anthropic.Anthropic(base_url=served_r1.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="m", max_tokens=12, messages=ASK)  # greedy: the server's default
    assert [b.thinking for b in message.content if b.type == "thinking"] == [thinking]
    with claude.messages.stream(model="m", max_tokens=12, messages=ASK) as stream:
        streamed = stream.get_final_message()
    assert [b.thinking for b in streamed.content if b.type == "thinking"] == [thinking]
