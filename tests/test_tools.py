"""Tool calling: tools rendered through real chat templates (Qwen3's own, and the
documented fallback for templates without tools), calls in each family's syntax read
back, the call grammar held to each function's `parameters` (accepting what the schema
allows, refusing what it does not), and required / named calls on a real model whose
arguments validate with the `jsonschema` package."""

from __future__ import annotations

import json

import pytest

import mlxinfer
from conftest import real_tokenizer
from mlxinfer.models.cache import make_cache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.text.constrain import Constraint
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.engine.prompt import request_tokens
from mlxinfer.text.tokenizer import load_tokenizer_from_dir
from mlxinfer.text.tools import HERMES, JSON_CALL, MISTRAL, call_grammar, plan

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def tokenizer(name: str):
    return load_tokenizer_from_dir(real_tokenizer(name))


# --- rendering ---

def test_qwen3_renders_tools_through_its_own_template():
    tok = tokenizer("qwen3")
    p = plan(tok, TOOLS)
    assert p.syntax == HERMES
    text = tok.decode(request_tokens(tok, ASK, tok.vocab_size, p))
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    assert "You can call these functions" not in text


@pytest.mark.parametrize("name", ["llama3.1", "mistral-instruct-v0.3", "smollm2"])
def test_templates_without_tools_get_the_documented_fallback(name):
    tok = tokenizer(name)
    p = plan(tok, TOOLS)
    assert p.syntax == JSON_CALL
    text = tok.decode(request_tokens(tok, ASK, tok.vocab_size, p))
    assert "You can call these functions" in text and json.dumps(TOOLS[0]["function"]) in text
    assert "What is the weather in Paris?" in text


def test_a_conversation_with_a_tool_result_renders():
    tok = tokenizer("qwen3")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    text = tok.decode(request_tokens(tok, messages, tok.vocab_size, plan(tok, TOOLS)))
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text


# --- the call grammar and reading calls back, per syntax, on real tokenizers ---

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
BAD = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}


def written(syntax, calls: list[dict]) -> str:
    """Calls as the family writes them."""
    body = [json.dumps(c) for c in calls]
    if syntax == HERMES:
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in body)
    if syntax == MISTRAL:
        return "[TOOL_CALLS] [" + ", ".join(body) + "]"
    return body[0]


@pytest.mark.parametrize("name, syntax", [("qwen3", HERMES), ("mistral-instruct-v0.3", MISTRAL),
                                          ("llama3.1", JSON_CALL)])
def test_call_grammar_accepts_valid_calls_and_refuses_invalid_ones(name, syntax):
    tok = tokenizer(name)
    functions = [t["function"] for t in TOOLS]
    from mlxinfer.text.constrain import compiled_lark

    fmt = compiled_lark(call_grammar(tok, syntax, functions), "tool call")

    def accepts(text: str) -> bool:
        c = Constraint(fmt, tok, tok.vocab_size)
        ids = tok.encode(text, add_special_tokens=False)
        if c.valid_prefix(ids) != len(ids):
            return False
        for t in ids:
            c.accept(t)
        return c.complete

    calls = [CALL, {"name": "add", "arguments": {"a": 2, "b": 40}}]
    assert accepts(written(syntax, calls[:1]))
    if syntax != JSON_CALL:
        assert accepts(written(syntax, calls))
    assert not accepts(written(syntax, [BAD]))
    assert not accepts(written(syntax, [{"name": "delete_everything", "arguments": {}}]))
    p = plan(tok, TOOLS)
    p.syntax = syntax
    content, read = p.parse(written(syntax, calls if syntax != JSON_CALL else calls[:1]))
    assert [(c.name, c.arguments) for c in read] == [(c["name"], c["arguments"]) for c in
                                                     (calls if syntax != JSON_CALL else calls[:1])]
    assert content is None and all(c.id.startswith("call_") for c in read)


@pytest.mark.parametrize("name, syntax", [("qwen3", HERMES), ("mistral-instruct-v0.3", MISTRAL)])
def test_without_parallel_calls_the_grammar_admits_exactly_one(name, syntax):
    """OpenAI's parallel_tool_calls=false: one call completes the reply, a second cannot start."""
    tok = tokenizer(name)
    functions = [t["function"] for t in TOOLS]
    from mlxinfer.text.constrain import compiled_lark

    calls = [CALL, {"name": "add", "arguments": {"a": 2, "b": 40}}]
    for parallel, two_allowed in ((True, True), (False, False)):
        fmt = compiled_lark(call_grammar(tok, syntax, functions, parallel), "tool call")
        one = tok.encode(written(syntax, calls[:1]), add_special_tokens=False)
        two = tok.encode(written(syntax, calls), add_special_tokens=False)
        c = Constraint(fmt, tok, tok.vocab_size)
        assert c.valid_prefix(one) == len(one)
        assert (c.valid_prefix(two) == len(two)) == two_allowed
        for t in one:
            c.accept(t)
        assert c.complete


FORECAST = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["days"], "additionalProperties": False}


@pytest.mark.parametrize("name, syntax", [("qwen3", HERMES), ("mistral-instruct-v0.3", MISTRAL),
                                          ("llama3.1", JSON_CALL)])
def test_with_a_json_format_a_reply_is_a_call_or_that_json(name, syntax):
    """tool_choice "auto" with a response format (OpenAI: an app with tools and a structured
    answer): the grammar admits calls, or one JSON value following the format, nothing else."""
    tok = tokenizer(name)
    from mlxinfer.text.constrain import compiled_lark

    fmt = compiled_lark(call_grammar(tok, syntax, [t["function"] for t in TOOLS], answer=FORECAST), "tool call")

    def accepts(text: str, inside: bool = False) -> bool:
        """Whether the grammar takes `text`, tokenized alone or (`inside`) as it is within a
        reply (a SentencePiece tokenizer gives a text's first word a leading space)."""
        c = Constraint(fmt, tok, tok.vocab_size)
        ids = tok.encode("x" + text, add_special_tokens=False)[1:] if inside else tok.encode(text,
                                                                                               add_special_tokens=False)
        return c.valid_prefix(ids) == len(ids) and (all(c.accept(t) is None for t in ids) and c.complete)

    assert accepts(written(syntax, [CALL])) and accepts('{"days": 3}', inside=True)
    assert not accepts('{"days": 9}', inside=True) and not accepts("It is sunny.")
    assert not accepts(written(syntax, [BAD])) and not accepts(written(syntax, [CALL]) + ' {"days": 3}')


def test_with_a_json_format_the_model_calls_or_answers_in_it(roomy):
    model, tok = roomy
    answer = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    called = []
    for seed in range(4):
        chunks = list(mlxinfer.stream_generate(model, tok, ASK, tools=TOOLS, response_format=answer, max_tokens=200,
                                               temperature=1.0, seed=seed))
        called.append(bool(chunks[-1].tool_calls))
        if chunks[-1].tool_calls:
            jsonschema.validate(chunks[-1].tool_calls[0].arguments, PARAMETERS[chunks[-1].tool_calls[0].name])
        else:
            assert chunks[-1].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(c.text for c in chunks)), FORECAST)
    assert set(called) == {True, False}  # these seeds take both ways
    # a call made is not held to the format, and with "none" the format alone holds
    required = list(mlxinfer.stream_generate(model, tok, ASK, tools=TOOLS, tool_choice="required",
                                             response_format=answer, max_tokens=200))[-1]
    assert required.tool_calls
    text = mlxinfer.generate(model, tok, ASK, tools=TOOLS, tool_choice="none", response_format=answer, max_tokens=200)
    jsonschema.validate(json.loads(text), FORECAST)


@pytest.fixture(scope="module")
def roomy(hf_checkpoint):
    """The tiny Llama with a context long enough for the tool listing (its tokenizer spells words out)."""
    return mlxinfer.load(hf_checkpoint("llama", head_dim=32, max_position_embeddings=2048), dtype="float32")


def test_free_text_is_no_call(loaded):
    _, tok = loaded
    assert plan(tok, TOOLS).parse("It is sunny.") == ("It is sunny.", [])
    assert plan(tok, TOOLS, "none").parse(json.dumps(CALL)) == (json.dumps(CALL), [])


@pytest.mark.parametrize("tools, choice, fact", [
    ([], None, "non-empty list"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0]"),
    ([TOOLS[0], TOOLS[0]], None, "used twice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "names no function"),
])
def test_bad_tools_are_one_line_errors(loaded, tools, choice, fact):
    model, tok = loaded
    with pytest.raises(InvalidOptionError) as e:
        mlxinfer.generate(model, tok, ASK, tools=tools, tool_choice=choice)
    assert fact in str(e.value) and "\n" not in str(e.value)


def test_tools_need_messages_and_combine_with_json_formats_only(loaded):
    model, tok = loaded
    with pytest.raises(InvalidOptionError, match="chat messages"):
        mlxinfer.generate(model, tok, "plain text", tools=TOOLS)
    with pytest.raises(InvalidOptionError, match="json_schema or json_object"):
        mlxinfer.generate(model, tok, ASK, tools=TOOLS, response_format={"type": "regex", "pattern": "a+"})


# --- models calling ---

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    from mlxinfer.convert import convert

    folder = tmp_path_factory.mktemp("smollm2") / "model"
    convert(smollm2_gguf, folder)
    return mlxinfer.load(folder)


@pytest.fixture(scope="module")
def smollm2_cache(smollm2) -> PromptCache:
    """One prompt cache for the real model's runs of the same prompt: each prefills only what
    differs from the last (the tool listing alone takes seconds to prefill on a CPU; a reused
    cache gives what a fresh one does, tests/test_pool.py)."""
    return PromptCache(make_cache(smollm2[0]))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_validate_on_a_real_model(smollm2, smollm2_cache, choice):
    model, tok = smollm2
    for seed in range(3):
        chunks = list(mlxinfer.stream_generate(model, tok, ASK, smollm2_cache, tools=TOOLS, tool_choice=choice,
                                               max_tokens=80, temperature=1.0, seed=seed))
        last = chunks[-1]
        assert last.finish_reason == "tool_calls" and len(last.tool_calls) == 1, "".join(c.text for c in chunks)
        call = last.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == "add"
        jsonschema.validate(call.arguments, PARAMETERS[call.name])


def test_auto_lets_the_model_answer_in_text_or_call(roomy):
    model, tok = roomy
    for seed in range(4):
        chunks = list(mlxinfer.stream_generate(model, tok, ASK, tools=TOOLS, max_tokens=40, temperature=1.0,
                                               seed=seed))
        last = chunks[-1]
        if last.tool_calls:
            jsonschema.validate(last.tool_calls[0].arguments, PARAMETERS[last.tool_calls[0].name])
        else:
            assert last.finish_reason in ("stop", "length")


def test_batched_tool_requests_equal_solo(roomy):
    model, tok = roomy
    engine = mlxinfer.BatchGenerator(model, tok)
    items = [dict(tools=TOOLS, tool_choice="required", max_tokens=60),
             dict(max_tokens=8),
             dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60,
                  temperature=1.0, seed=2)]
    uids = [engine.submit(ASK, **o) for o in items]
    last = {}
    for uid, chunk in engine.stream():
        last[uid] = chunk
    for uid, options in zip(uids, items):
        want = list(mlxinfer.stream_generate(model, tok, ASK, **options))[-1]
        assert last[uid].finish_reason == want.finish_reason
        assert last[uid].tool_calls == want.tool_calls or [
            (c.name, c.arguments) for c in last[uid].tool_calls] == [(c.name, c.arguments) for c in want.tool_calls]


def test_auto_holds_a_reply_to_the_grammar_once_its_first_token_opens_a_call(loaded):
    model, tok = loaded
    p = plan(tok, TOOLS)
    opening = tok.encode('{"', add_special_tokens=False)[0]
    prose = tok.encode("It", add_special_tokens=False)[0]
    called, free = p.constraint(tok, model.config.vocab_size), p.constraint(tok, model.config.vocab_size)
    assert called.allowed().all() and free.allowed().all()  # the first token is the model's choice
    called.accept(opening)
    free.accept(prose)
    assert free.allowed().all() and free.complete
    assert 0 < called.allowed().sum() < model.config.vocab_size and not called.complete


def test_chat_session_offers_tools_every_turn(roomy):
    model, tok = roomy
    session = mlxinfer.ChatSession(model, tok, tools=TOOLS, tool_choice="required", max_tokens=60)
    last = list(session.send("What is the weather in Paris?"))[-1]
    want = list(mlxinfer.stream_generate(model, tok, ASK, tools=TOOLS, tool_choice="required", max_tokens=60))[-1]
    assert last.finish_reason == "tool_calls" and [(c.name, c.arguments) for c in last.tool_calls] == [
        (c.name, c.arguments) for c in want.tool_calls]
    jsonschema.validate(last.tool_calls[0].arguments, PARAMETERS[last.tool_calls[0].name])
    session.set_option("tool_choice", "none")
    assert list(session.send("thanks"))[-1].tool_calls is None


ITEM = {"type": "object", "properties": {"n": {"type": "integer"},
                                         "child": {"anyOf": [{"$ref": "#/$defs/Item"}, {"type": "null"}]}},
        "required": ["n", "child"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
          "additionalProperties": False, "$defs": {"Item": ITEM}}


@pytest.mark.parametrize("count", [1, 2])
def test_parameters_with_defs_and_refs_are_enforced(loaded, count):
    """Pydantic writes nested models as `$defs` + `$ref`: they resolve inside the call
    grammar, for one function and under anyOf for several (before: "Pointer '/$defs/Item'
    does not exist"). `jsonschema` says which arguments are valid."""
    _, tok = loaded
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": NESTED}} for i in range(count)]
    fmt = plan(tok, tools, "required").grammar
    good = {"item": {"n": 1, "child": {"n": 2, "child": None}}}
    bad = {"item": {"n": 1, "child": {"n": "two", "child": None}}}
    jsonschema.validate(good, NESTED)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, NESTED)
    for arguments, valid in ((good, True), (bad, False)):
        c = Constraint(fmt, tok, tok.vocab_size)
        ids = tok.encode(json.dumps({"name": f"f{count - 1}", "arguments": arguments}), add_special_tokens=False)
        taken = c.valid_prefix(ids)
        for t in ids[:taken]:
            c.accept(t)
        assert (taken == len(ids) and c.complete) == valid
