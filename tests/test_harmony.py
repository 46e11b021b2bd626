"""gpt-oss's harmony format: a reply's `analysis` channel is its reasoning, its `final` channel
the answer, in the engine, the batch and the server's `reasoning_content`; `reasoning_effort`
reaches the chat template as its `reasoning_effort` variable; a message addressed to
`functions.NAME` is a tool call (held to the function's schema by the tool grammar, read back
as the reply's tool_calls, never its text), and a conversation sent back with the call and the
tool's result renders as transformers renders it.

The chat template is gpt-oss's own, as llama.cpp ships it (`models/templates/` in the
llama-cpp-python sdist, which the GGUF tests fetch too); no gpt-oss tokenizer is at hand, so a
small BPE is trained here with harmony's special tokens. The oracles: prompts rendered by
transformers' `apply_chat_template` on the same files, and replies (forced into channels by a
grammar over those special tokens, or steered into a call by a logit bias) cut at the markers
by a regular expression."""

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
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.engine.generate import stream_generate
from mlxinfer.text.reasoning import HARMONY, effort_kwargs

LLAMA_CPP = "llama-cpp-python==0.3.36"
TEMPLATE = "vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"
# o200k_harmony's special tokens (tiktoken's openai_public lists them)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
            "<|end|>", "<|message|>", "<|call|>"]
ID = {t: i for i, t in enumerate(SPECIALS)}  # the trainer numbers special tokens first, in order
ASK = [{"role": "user", "content": "What is two plus two?"}]
WORDS = "/[a-z]{3,8}( [a-z]{2,8}){1,3}/"
# tools whose arguments a random model finishes in a few tokens (enums, bounded integers)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of its arguments",
                                           "parameters": schema}} for name, schema in PARAMETERS.items()]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def t(name: str) -> str:
    """A special token in a Lark grammar, by id (so it is sampled as that token, never spelled out)."""
    return f"<[{ID[name]}]>"


# analysis then final, as gpt-oss answers after `<|start|>assistant`
THINKING = {"type": "grammar", "lark": (
    f'start: {t("<|channel|>")} "analysis" {t("<|message|>")} {WORDS} {t("<|end|>")} '
    f'{t("<|start|>")} "assistant" {t("<|channel|>")} "final" {t("<|message|>")} {WORDS}')}
# a message: its header (a recipient before or after the channel), its body up to an end
MESSAGE = re.compile(r"(?:<\|start\|>assistant)?(?: to=([^\s<]+))?<\|channel\|>(\w+)(?: to=([^\s<]+))?[^<]*"
                     r"(?:<\|constrain\|>\w+)?<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|\Z)", re.S)


def messages_of(raw: str) -> list[tuple[str, str, str]]:
    """(channel, recipient or "", body) of each message of a harmony reply."""
    return [(channel, before or after, body) for before, channel, after, body in MESSAGE.findall(raw)]


def by_hand(raw: str) -> tuple[str, str]:
    """(reasoning, answer) of a harmony reply: the analysis bodies, and the bodies of the other
    channels' messages to the user (those addressed to a tool are calls, neither)."""
    messages = [(ch, body) for ch, to, body in messages_of(raw) if not to]
    return ("".join(body for ch, body in messages if ch == "analysis"),
            "".join(body for ch, body in messages if ch != "analysis"))


def calls_by_hand(raw: str) -> list[tuple[str, str]]:
    return [(to, body) for _, to, body in messages_of(raw) if to]


# --- the splitter on its own ---

BODY = st.text(st.sampled_from(list("ab <|>/\n")), max_size=12).filter(lambda b: "<|" not in b)
HEADERS = {"analysis": "<|channel|>analysis", "final": "<|channel|>final", "commentary": "<|channel|>commentary",
           # a call as gpt-oss writes it, and as the template renders one back (recipient first)
           "call": "<|channel|>commentary to=functions.add <|constrain|>json",
           "call back": " to=functions.get_weather<|channel|>commentary json",
           "call in analysis": "<|channel|>analysis to=functions.add<|constrain|>json"}


@given(st.lists(st.tuples(st.sampled_from(sorted(HEADERS)), BODY, st.sampled_from(["<|end|>", "<|call|>"])),
                min_size=1, max_size=4), st.data())
def test_streamed_channels_join_to_the_reply_cut_by_hand(messages, data):
    raw = "".join(("<|start|>assistant" if i else "") + HEADERS[ch] + "<|message|>" + body + end
                  for i, (ch, body, end) in enumerate(messages))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    splitter, reasoning, answer = HARMONY.splitter(False), [], []
    for start, end in zip([0, *cuts], [*cuts, len(raw)]):
        r, a = splitter.push(raw[start:end])
        reasoning.append(r)
        answer.append(a)
    rest = splitter.flush()
    assert ("".join(reasoning) + rest[0], "".join(answer) + rest[1]) == by_hand(raw)
    assert splitter.calls == calls_by_hand(raw)


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


# --- tool calls ---

def away(tok, *words: str, also: tuple[str, ...] = ()) -> dict[int, float]:
    """A logit bias against every token whose text begins one of `words` (channel names) and
    against the special tokens `also`. Where the grammar allows one token only (the `<|message|>`
    after a call's header), a bias cannot keep it out: it steers only where there is a choice."""
    pieces = {i: tok.decode([i]) for i in range(tok.vocab_size)}
    return {**{i: -100.0 for i, p in pieces.items() if p and any(w.startswith(p) for w in words)},
            **{ID[s]: -100.0 for s in also}}


def to_call(tok) -> dict[int, float]:
    """Steers a reply into a call: off the analysis and final channels, and after `commentary`
    off `<|message|>` (a message to the user) onto ` to=functions....`."""
    return away(tok, "analysis", "final", also=("<|message|>",))


def the_call(raw: str) -> tuple[str, dict]:
    """The one call in a raw harmony reply, cut by hand: (function name, arguments)."""
    [(to, body)] = calls_by_hand(raw)
    assert to.startswith("functions.")
    return to.removeprefix("functions."), json.loads(body)


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "add"}}])
def test_a_harmony_call_is_the_replys_tool_call(model, choice):
    jsonschema = pytest.importorskip("jsonschema")
    m, tok = model
    options = dict(temperature=0.0, max_tokens=80, tools=TOOLS, tool_choice=choice, logit_bias=to_call(tok))
    raw_chunks = list(stream_generate(m, tok, WEATHER_ASK, split_reasoning=False, **options))
    raw = "".join(c.text for c in raw_chunks)
    assert raw.startswith("<|channel|>commentary to=functions.")  # steered into a call, in gpt-oss's own header
    name, arguments = the_call(raw)
    jsonschema.validate(arguments, PARAMETERS[name])  # the grammar held the arguments to the function's schema
    assert name == "add" or not isinstance(choice, dict)
    for chunks in (raw_chunks, list(stream_generate(m, tok, WEATHER_ASK, **options))):
        last = chunks[-1]
        assert last.finish_reason == "tool_calls" and last.token == ID["<|call|>"]  # <|call|> ended the turn
        assert [(c.name, c.arguments) for c in last.tool_calls] == [(name, arguments)]
    assert last.content is None and parts(chunks) == ("", "")  # the call is in neither the answer nor the reasoning
    if choice != "required":
        return
    engine = BatchGenerator(m, tok, max_batch=2)  # two at once in the batched engine, each its own grammar
    uids = [engine.submit(WEATHER_ASK, parallel_tool_calls=False, **options) for _ in range(2)]
    lasts = {uid: chunk for uid, chunk in engine.stream() if chunk.finish_reason}
    assert [[(c.name, c.arguments) for c in lasts[uid].tool_calls] for uid in uids] == [[(name, arguments)]] * 2


def test_auto_lets_the_model_answer_instead(model):
    m, tok = model
    options = dict(max_tokens=24, tools=TOOLS, logit_bias=away(tok, "analysis", "commentary"))
    raw = raw_reply(model, WEATHER_ASK, **options)
    assert raw.startswith("<|channel|>final<|message|>") and not calls_by_hand(raw)
    chunks = list(stream_generate(m, tok, WEATHER_ASK, temperature=0.0, **options))
    assert chunks[-1].finish_reason != "tool_calls" and chunks[-1].tool_calls is None
    assert parts(chunks) == by_hand(raw)


def accepts(tok, grammar, text: str) -> bool:
    """Whether `grammar` takes `text` (as the model's tokens) whole."""
    from mlxinfer.text.constrain import Constraint
    from mlxinfer.base.errors import InvalidOptionError

    constraint = Constraint(grammar, tok, tok.vocab_size)
    try:
        for token in tok.encode(text, add_special_tokens=False):
            constraint.accept(token)
    except InvalidOptionError:
        return False
    return constraint.complete


def test_the_call_grammar_holds_each_function_to_its_schema(model):
    jsonschema = pytest.importorskip("jsonschema")
    from mlxinfer.text.tools import plan

    _, tok = model

    def call(name: str, arguments: dict) -> str:
        return (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                f"{json.dumps(arguments, separators=(',', ':'))}<|call|>")

    tried = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 40}),
             ("get_weather", {"city": "Lyon", "unit": "celsius"}), ("add", {"a": 2, "b": 400}),
             ("add", {"a": 2}), ("add", {"a": 2, "b": 4, "c": 5}), ("delete_everything", {})]
    thought = "<|channel|>analysis<|message|>let me think<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>It is sunny."
    for choice in ("required", "auto"):
        grammar = plan(tok, TOOLS, choice).grammar
        for name, arguments in tried:
            valid = name in PARAMETERS and jsonschema.Draft202012Validator(PARAMETERS[name]).is_valid(arguments)
            assert accepts(tok, grammar, call(name, arguments)) == valid, (choice, name, arguments)
            assert accepts(tok, grammar, thought + call(name, arguments)) == valid
        assert accepts(tok, grammar, final) == (choice == "auto")
    named = plan(tok, TOOLS, {"type": "function", "function": {"name": "add"}}).grammar
    assert accepts(tok, named, call("add", {"a": 1, "b": 2})) and not accepts(tok, named, call(*tried[0]))
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    formatted = plan(tok, TOOLS, "auto", answer=answer).grammar  # auto with a JSON format: a call, or that JSON
    assert accepts(tok, formatted, '<|channel|>final<|message|>{"ok": true}')
    assert not accepts(tok, formatted, final) and accepts(tok, formatted, call(*tried[1]))
    assert plan(tok, TOOLS, "none").grammar is None


CALLED = {"id": "call_7", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "unit": "celsius"}'}}
RESULT = {"role": "tool", "tool_call_id": "call_7", "content": "18 degrees"}
CONVERSATIONS = {  # sent back as OpenAI's wire has them: arguments as a JSON string
    "call and result": [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [CALLED]}, RESULT],
    "thought, call and result": [*WEATHER_ASK, {"role": "assistant", "content": "", "reasoning_content": "look it up",
                                                "tool_calls": [CALLED]}, RESULT],
    "a later turn": [*WEATHER_ASK, {"role": "assistant", "content": "", "reasoning_content": "look it up",
                                    "tool_calls": [CALLED]}, RESULT,
                     {"role": "assistant", "content": "18 degrees in Paris."},
                     {"role": "user", "content": "And in Tokyo?"}]}


def as_transformers_takes_them(messages: list[dict]) -> list[dict]:
    """The messages as transformers' chat templates take a call: arguments as an object."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def transformers_ids(hf_tokenizer, messages: list[dict]) -> list[int]:
    return list(hf_tokenizer.apply_chat_template(as_transformers_takes_them(messages), tools=TOOLS,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_a_call_and_its_result_render_as_transformers_renders_them(model, hf_tokenizer, conversation):
    m, tok = model
    messages = CONVERSATIONS[conversation]
    expected = transformers_ids(hf_tokenizer, messages)
    text = hf_tokenizer.decode(expected)
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"' in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 degrees"' in text
    cache = mlxinfer.PromptCache.for_model(m)
    list(stream_generate(m, tok, messages, prompt_cache=cache, max_tokens=1, tools=TOOLS, tool_choice="none"))
    assert cache.tokens[: len(expected)] == expected


# --- the server, with the official openai client ---

@pytest.fixture(scope="module")
def server(folder):
    from serving import Server

    pytest.importorskip("fastapi")
    server = Server(["-m", str(folder), "--dtype", "float32"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


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


def test_server_tool_calls_streamed_and_sent_back(server, client, model, hf_tokenizer):
    from serving import post

    m, tok = model
    bias = to_call(tok)
    name, arguments = the_call(raw_reply(model, WEATHER_ASK, max_tokens=80, tools=TOOLS, tool_choice="required",
                                         logit_bias=bias))
    ask = dict(model="m", messages=WEATHER_ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80,
               logit_bias={str(k): int(v) for k, v in bias.items()})
    r = client.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert getattr(choice.message, "reasoning_content", None) is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)

    events = list(client.chat.completions.create(**ask, stream=True))
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert "".join(d.content or "" for d in deltas) == ""  # the call never streams as text
    streamed = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [(name, arguments)]
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"

    # the round trip: the reply as the SDK hands it back, then the tool's result
    sent = [*WEATHER_ASK, choice.message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    expected = transformers_ids(hf_tokenizer, sent)
    assert f'to=functions.{name}<|channel|>commentary json<|message|>' in hf_tokenizer.decode(expected)
    status, body, _ = post(server.url, {"messages": sent, "tools": TOOLS}, path="/tokenize")
    assert status == 200 and body["tokens"] == expected
    again = client.chat.completions.create(model="m", messages=[*WEATHER_ASK, choice.message, sent[-1]], tools=TOOLS,
                                           max_tokens=1)
    assert again.usage.prompt_tokens == len(expected)

    # Responses' function_call and function_call_output items render the same conversation
    items = [*WEATHER_ASK, {"type": "function_call", "call_id": call.id, "name": name,
                            "arguments": call.function.arguments},
             {"type": "function_call_output", "call_id": call.id, "output": "18 C"}]
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    assert client.responses.input_tokens.count(model="m", input=items, tools=tools).input_tokens == len(expected)


def test_text_before_a_call_streams_once(model):
    """Harmony's calls never reach the text, so nothing is held back while a call may be coming:
    the text before one streams as it comes, and the delta with the call does not send it again
    (the stream adds up to the whole response)."""
    import asyncio

    from mlxinfer.serve.openai import Reply
    from mlxinfer.decode.sources import Stats
    from mlxinfer.engine.text_stream import Chunk
    from mlxinfer.text.tools import ToolCall, call_opener

    _, tok = model
    stats = Stats(prompt_tokens=3, prefill_tokens=3, generated_tokens=3)
    chunks = [Chunk("Let me ", 1, None, None, stats), Chunk("add.", 2, None, None, stats),
              Chunk("", ID["<|call|>"], None, "tool_calls", stats, tool_calls=[ToolCall("add", {"a": 1}, "call_1")],
                    content="Let me add.")]
    reply = Reply(rid="chatcmpl-1", chat=True, model="m", opener=call_opener(tok))
    assert reply.opener is None

    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def stream() -> list[dict]:
        return [json.loads(e.decode().removeprefix("data: ")) async for e in reply.events([chunks[0]], [rest()], False)
                if not e.startswith(b"data: [DONE]")]

    deltas = [e["choices"][0]["delta"] for e in asyncio.run(stream())]
    whole = reply.whole([chunks])["choices"][0]["message"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"] == "Let me add."
    assert [c for d in deltas for c in d.get("tool_calls", [])] == [{"index": 0, **c} for c in whole["tool_calls"]]
