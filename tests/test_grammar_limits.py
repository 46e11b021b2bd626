"""Grammars that cannot take the process down, stall it, or "succeed" with nothing.

A catalogue and fuzzers for every hostile class (deep `$ref` chains, deep nesting, wide
schemas, long enums and strings, long Lark rule chains, huge regexes, left recursion,
`$ref` loops, invalid `$ref`s, all of it also in tools' parameters): each is a one-line
InvalidOptionError within a hang guard, and the test process survives. Before the fix,
a 3,000-long `$ref` chain, a 1,000-long chain of objects through `$ref`s or a 5,000-rule
Lark chain killed the process with SIGSEGV inside llguidance, a 10,000-deep schema raised
RecursionError, and `{"$ref": "#"}` generated "" with finish_reason "stop".

Oracles: llguidance's own matcher decides whether a rule can derive any string (the
fuzzer's verdicts must agree with it), `jsonschema` decides which values a schema
accepts, and `json` reads calls back.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import real_tokenizer
from hypothesis import HealthCheck, example, given, settings, strategies as st

import mlxinfer
from mlxinfer.text.constrain import Constraint, _CompilerProcess, grammar_tokenizer, response_format
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.text.grammar_checks import MAX_BYTES, MAX_DEPTH, MAX_RULES, check_lark, check_schema
from mlxinfer.text.tools import CALL_DEPTH, HERMES, JSON_CALL, MISTRAL, check_tools, plan

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")
HANG_GUARD = 30.0  # seconds: only a guard against a hang, the machine may be shared
WORKER = Path(mlxinfer.__file__).parent / "text" / "grammar_worker.py"


# --- hostile inputs, one builder per class ---

def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "integer"}}}


def object_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "integer"}}}


def nested(n: int, shape: str) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"items": {"type": "array", "items": schema},
                  "properties": {"type": "object", "properties": {"a": schema}, "required": ["a"]},
                  "anyOf": {"anyOf": [schema, {"type": "null"}]}}[shape]
    return schema


def lark_chain(n: int) -> str:
    return "\n".join(["start: r1"] + [f"r{i}: r{i + 1}" for i in range(1, n)] + [f'r{n}: "x"'])


def lark_wide(n: int) -> str:
    return "\n".join(["start: " + " | ".join(f"r{i}" for i in range(n))] + [f'r{i}: "w{i}"' for i in range(n)])


def as_format(grammar: dict | str) -> dict:
    if isinstance(grammar, str):
        return {"type": "grammar", "lark": grammar}
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": grammar}}


LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
CATALOGUE = [
    ("ref chain 100", ref_chain(100), "nested 103 deep through its $refs; the limit is 64"),
    ("ref chain 10000", ref_chain(10000), f"bytes; the limit is {MAX_BYTES}"),
    ("object chain 30", object_chain(30), "through its $refs; the limit is 64"),
    ("object chain 1000", object_chain(1000), f"bytes; the limit is {MAX_BYTES}"),
    ("items 10000 deep", nested(10000, "items"), "nested 10001 deep; the limit is 64"),
    ("properties 10000 deep", nested(10000, "properties"), "nested 20001 deep; the limit is 64"),
    ("anyOf 200 deep", nested(200, "anyOf"), "nested 401 deep; the limit is 64"),
    ("10000 properties", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10000)}},
     f"bytes; the limit is {MAX_BYTES}"),
    ("enum of 10000", {"enum": [f"value {i}" for i in range(10000)]}, f"bytes; the limit is {MAX_BYTES}"),
    ("100 KB const", {"const": "x" * 100_000}, f"bytes; the limit is {MAX_BYTES}"),
    ("lark chain 100000", lark_chain(100_000), f"bytes; the limit is {MAX_BYTES}"),
    ("lark chain 300", lark_chain(300), "nests 301 deep (rules within rules"),
    ("lark 600 rules", lark_wide(600), f"has 601 rules; the limit is {MAX_RULES}"),
    ("lark groups 5000 deep", "start: " + "(" * 5000 + '"x"' + ")" * 5000, "nests groups over 64 deep"),
    ("left recursion", 'start: a\na: a "x"', "can never complete: rule 'a'"),
    ("start only itself", "start: start", "can never complete: rule 'start'"),
    ("recursion with no base", 'start: "y" | a\na: "(" a ")"', "can never complete: rule 'a'"),
    ("ref to the root", {"$ref": "#"}, "can never complete: the schema ('#')"),
    ("ref loop", LOOP, "can never complete: '#/$defs/a'"),
    ("ref loop of two", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
     "can never complete"),
    ("required self", {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
     "can never complete: the schema ('#')"),
    ("non-empty self array", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "can never complete"),
    ("optional trap", {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": LOOP["$defs"]},
     "can never complete: '#/$defs/a'"),
    ("%json loop", 'start: "a" %json {"$ref": "#"}', "%json #1 can never complete"),
    ("invalid ref", {"$ref": "#/$defs/nope"}, "has a $ref to '#/$defs/nope', which is not in it"),
]


def refusal(call) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(InvalidOptionError) as e:
        call()
    return str(e.value), time.perf_counter() - start


@pytest.mark.parametrize("grammar, fact", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_catalogue_is_refused_in_one_line(grammar, fact):
    message, seconds = refusal(lambda: response_format(as_format(grammar)))
    assert fact in message and "\n" not in message, message
    assert seconds < HANG_GUARD


TOOL_CASES = [c for c in CATALOGUE if isinstance(c[1], dict)]


@pytest.mark.parametrize("parameters, fact", [c[1:] for c in TOOL_CASES], ids=[c[0] for c in TOOL_CASES])
def test_catalogue_in_a_tools_parameters_names_the_tool(loaded, parameters, fact):
    _, tok = loaded
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    message, seconds = refusal(lambda: plan(tok, tools, "required"))
    assert message.startswith("tools[1].function.parameters "), message
    assert fact.replace("the schema ('#')", "") in message and "\n" not in message, message
    assert seconds < HANG_GUARD


def test_huge_and_deeply_nested_regexes_are_refused():
    message, _ = refusal(lambda: response_format({"type": "regex", "pattern": "a" * (MAX_BYTES + 1)}))
    assert f"the limit is {MAX_BYTES}" in message
    message, _ = refusal(lambda: response_format({"type": "regex", "pattern": "(" * 10_000 + "a" + ")" * 10_000}))
    assert "nested" in message and "\n" not in message and len(message) < 600, message


# --- what the limits admit still works ---

def test_grammars_at_the_limits_compile_and_match(loaded):
    """The deepest schema and rule chain the limits allow compile in the worker and match
    a value `jsonschema` accepts (the limits refuse nothing they name as allowed)."""
    _, tok = loaded
    depth = MAX_DEPTH // 2 - 1  # two JSON levels per object: 63 deep
    schema = nested(depth, "properties")
    value: object = 7
    for _ in range(depth):
        value = {"a": value}
    jsonschema.validate(value, schema)
    constraint = Constraint(response_format(as_format(schema)), tok, tok.vocab_size)
    ids = tok.encode(json.dumps(value), add_special_tokens=False)
    assert constraint.valid_prefix(ids) == len(ids)
    for t in ids:
        constraint.accept(t)
    assert constraint.complete
    chain = Constraint(response_format(as_format(lark_chain(MAX_DEPTH - 1))), tok, tok.vocab_size)
    chain.accept(tok.encode("x", add_special_tokens=False)[0])
    assert chain.complete
    Constraint(response_format(as_format(lark_wide(MAX_RULES - 1))), tok, tok.vocab_size)


def test_an_unsatisfiable_format_is_refused_before_generating(loaded):
    """Before: 200 with "" and finish_reason "stop". Now a one-line refusal, before any token."""
    model, tok = loaded
    for fmt in (as_format({"$ref": "#"}), as_format('start: a\na: a "x"')):
        with pytest.raises(InvalidOptionError, match="can never complete"):
            mlxinfer.generate(model, tok, "x", max_tokens=4, response_format=fmt)
    empty = {"type": "regex", "pattern": "[^\\x00-\\U0010FFFF]"}  # a class with no character: no output at all
    with pytest.raises(InvalidOptionError, match="admits no output at all"):
        mlxinfer.generate(model, tok, "x", max_tokens=4, response_format=empty)


# --- the worker: a crash or a hang costs one request ---

def test_a_compiler_crash_is_one_line_and_the_worker_comes_back():
    """Past every limit (straight to the worker), a 20,000-rule chain overflows the
    compiler's stack: the worker dies, the request gets one line, the next one works."""
    compiler = _CompilerProcess()
    try:
        deadly = llguidance.LLMatcher.grammar_from_lark(lark_chain(20_000))
        message, seconds = refusal(lambda: compiler.check(deadly, "the grammar"))
        assert message.startswith("the grammar crashed the grammar compiler (") and "simplify it" in message
        assert seconds < HANG_GUARD
        fine = llguidance.LLMatcher.grammar_from_lark('start: "ok"')
        assert compiler.check(fine, "the grammar") == {"error": None, "empty": False}
        worker = compiler._proc.pid
        assert refusal(lambda: compiler.check(deadly, "again"))[0].startswith("again crashed the grammar compiler")
        assert compiler._proc.pid == worker  # a grammar that crashed it once is refused without a second crash
    finally:
        compiler.close()


def test_a_compile_past_the_time_limit_is_killed(tmp_path):
    """A worker that never answers (as one stuck in a compile) is killed at the limit."""
    fake = tmp_path / "stuck_worker.py"
    pid_file = tmp_path / "pid"
    fake.write_text(textwrap.dedent(f"""
        import os, sys
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        print('{{"ready": true}}', flush=True)
        for line in sys.stdin:  # requests are read and never answered
            pass
    """))
    compiler = _CompilerProcess(script=fake, seconds=1.0)
    message, _ = refusal(lambda: compiler.check('start: "ok"', "the grammar"))
    assert message == "the grammar took over 1 s to compile; simplify it"
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pid_file.read_text()), 0)


def test_the_worker_imports_only_llguidance_and_the_standard_library():
    """It must start fast and never load MLX (nor mlxinfer, whose import does)."""
    tree = ast.parse(WORKER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) == {"llguidance"}


# --- fuzzers ---

HOSTILE = {
    "ref chain": lambda n: ref_chain(65 + n % 3000),
    "object chain": lambda n: object_chain(22 + n % 1500),
    "items": lambda n: nested(64 + n % 20000, "items"),
    "properties": lambda n: nested(33 + n % 20000, "properties"),
    "anyOf": lambda n: nested(33 + n % 5000, "anyOf"),
    "wide": lambda n: {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000 + n)}},
    "enum": lambda n: {"enum": list(range(20000 + n))},
    "lark chain": lambda n: lark_chain(65 + n % 50000),
    "lark wide": lambda n: lark_wide(MAX_RULES + n % 5000),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(HOSTILE)), n=st.integers(0, 60_000), in_tools=st.booleans())
def test_fuzz_hostile_grammars_are_refused_quickly(kind, n, in_tools):
    grammar = HOSTILE[kind](n)
    if in_tools and isinstance(grammar, dict):
        tools = [{"type": "function", "function": {"name": "f", "parameters": grammar}}]
        call = lambda: check_tools(tools)  # noqa: E731
    else:
        call = lambda: response_format(as_format(grammar))  # noqa: E731
    message, seconds = refusal(call)
    assert "the limit is" in message and "\n" not in message, message
    assert seconds < HANG_GUARD


LARK_PIECES = ["start", ":", "a", "b", "A", '"x"', "/y/", "|", "(", ")", "[", "]", "?", "*", "+", "~", "1", "..",
               "{", "}", ",", '%json {"$ref": "#"}', "%ignore", "<[1]>", "@g", "->", "&", "!", "\n", "#", "//", "::",
               "[capture]", ".2", '"a".."z"', "{2,3}", "%regex {}", "%llguidance {}", " "]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(LARK_PIECES), max_size=24), spaced=st.booleans())
def test_fuzz_any_lark_text_is_read_or_refused_in_one_line(pieces, spaced):
    """Whatever the text, the checks end in a verdict (no other exception)."""
    try:
        check_lark("start: " + (" " if spaced else "").join(pieces), "g")
    except InvalidOptionError as e:
        assert "\n" not in str(e)


# Random grammars over the one terminal "a": rules r0..r3, each one or two alternatives of
# one or two items ("a", another rule, or another rule made optional). A rule derives a
# string iff it derives one of length <= 2**4 (a shortest derivation repeats no rule on a
# path: height <= 4, branching <= 2), so llguidance matching "a" * n for n <= 16 decides it.

ITEM = st.one_of(st.just(("a",)), st.tuples(st.just("ref"), st.integers(0, 3)),
                 st.tuples(st.just("opt"), st.integers(0, 3)))
RULES = st.lists(st.lists(st.lists(ITEM, min_size=1, max_size=2), min_size=1, max_size=2), min_size=1, max_size=4)


def rule_refs(rules) -> list[set[int]]:
    return [{item[1] % len(rules) for alt in rule for item in alt if item[0] != "a"} for rule in rules]


def lark_of(rules, start: int) -> str:
    def item(it) -> str:
        return '"a"' if it[0] == "a" else f"r{it[1] % len(rules)}" + ("?" if it[0] == "opt" else "")

    lines = [f"start: r{start}"] + [f"r{k}: " + " | ".join(" ".join(map(item, alt)) for alt in rule)
                                    for k, rule in enumerate(rules)]
    return "\n".join(lines)


def schema_of(rules) -> dict:
    """The same grammar as a JSON Schema: a rule is anyOf its alternatives, an alternative
    an array of exactly its items, "a" a constant, an optional item an array of at most one."""
    def item(it) -> dict:
        if it[0] == "a":
            return {"const": "a"}
        ref = {"$ref": f"#/$defs/r{it[1] % len(rules)}"}
        return ref if it[0] == "ref" else {"type": "array", "prefixItems": [ref], "maxItems": 1}

    def alt(items) -> dict:
        return {"type": "array", "prefixItems": [item(i) for i in items], "minItems": len(items)}

    defs = {f"r{k}": {"anyOf": [alt(a) for a in rule]} for k, rule in enumerate(rules)}
    return {"$ref": "#/$defs/r0", "$defs": defs}


def derives_something(lark: str, ll_tok, a_token: int) -> bool:
    """llguidance's verdict: the grammar accepts "a" * n for some n <= 16."""
    m = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    for _ in range(17):
        if m.is_accepting():
            return True
        if not m.consume_token(a_token):
            return False
    return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rules=RULES)
def test_fuzz_rules_that_never_complete_agree_with_llguidance(loaded, rules):
    """Refused exactly when a rule reachable from start derives nothing (llguidance's
    verdict), and the rule named is one of those; the same grammar as a JSON Schema too."""
    _, tok = loaded
    ll_tok = grammar_tokenizer(tok, tok.vocab_size)
    (a_token,) = ll_tok.tokenize_str("a")
    refs = rule_refs(rules)
    reachable, todo = {0}, [0]
    while todo:
        for k in refs[todo.pop()] - reachable:
            reachable.add(k)
            todo.append(k)
    dead = {k for k in reachable if not derives_something(lark_of(rules, k), ll_tok, a_token)}
    for check, grammar, name in ((check_lark, lark_of(rules, 0), r"rule 'r(\d)'"),
                                 (check_schema, schema_of(rules), r"'#/\$defs/r(\d)'")):
        try:
            check(grammar, "g")
            named = None
        except InvalidOptionError as e:
            found = re.search(name, str(e))
            assert found, str(e)
            named = int(found.group(1))
        assert (named is not None) == bool(dead), (lark_of(rules, 0), dead, named)
        assert named is None or named in dead


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


def reply_in(syntax, call_json: str) -> str:
    if syntax == HERMES:
        return f"<tool_call>\n{call_json}\n</tool_call>"
    if syntax == MISTRAL:
        return f"[TOOL_CALLS] [{call_json}]"
    return call_json


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(0, 20_000), syntax=st.sampled_from([HERMES, MISTRAL, JSON_CALL]),
       bracket=st.sampled_from(["[]", "{}"]))
@example(depth=CALL_DEPTH - 2, syntax=HERMES, bracket="[]")  # the deepest that is still read
@example(depth=CALL_DEPTH - 1, syntax=HERMES, bracket="[]")
@example(depth=CALL_DEPTH - 3, syntax=MISTRAL, bracket="{}")
@example(depth=CALL_DEPTH - 2, syntax=MISTRAL, bracket="{}")
def test_fuzz_a_deep_reply_comes_back_as_text_or_a_call(loaded, depth, syntax, bracket):
    """Before: a reply nested 10,000 deep raised RecursionError and the reply was lost."""
    _, tok = loaded
    p = plan(tok, [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    p.syntax = syntax
    inner = ('{"k": ' * depth + "1" + "}" * depth) if bracket == "{}" else ("[" * depth + "1" + "]" * depth)
    call_json = json.dumps(CALL)[:-2] + f', "deep": {inner}}}}}'
    text = reply_in(syntax, call_json)
    content, calls = p.parse(text)
    enclosing = 3 if syntax == MISTRAL else 2  # the call and its arguments (and Mistral's list) hold `inner`
    if depth + enclosing <= CALL_DEPTH:
        assert [(c.name, c.arguments) for c in calls] == [(CALL["name"], json.loads(call_json)["arguments"])]
        json.dumps(calls[0].openai())  # and it can be written back out
    else:
        assert calls == [] and content == text


def test_a_tokenizer_the_worker_dropped_is_sent_again(loaded):
    """The worker keeps a few tokenizers; one it dropped for others is sent again, so the
    check still runs with it (an empty pattern is refused only with a tokenizer)."""
    from mlxinfer.text.tokenizer import load_tokenizer_from_dir

    _, tok = loaded
    compiler = _CompilerProcess()
    empty = llguidance.LLMatcher.grammar_from_regex("[^\\x00-\\U0010FFFF]")
    try:
        assert compiler.check(empty, "g", tok, tok.vocab_size)["empty"]
        for name in ("smollm2", "llama2", "mistral-v0.1"):
            other = load_tokenizer_from_dir(real_tokenizer(name))
            compiler.check('start: "x"', "g", other, other.vocab_size)
        assert compiler.check(empty, "g", tok, tok.vocab_size)["empty"]
    finally:
        compiler.close()
