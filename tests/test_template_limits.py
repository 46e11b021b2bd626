"""Chat templates are untrusted code: rendering is bounded in time and size, and every failure is one
line. Hostile templates run in a child process with a deadline, so a template that hangs or eats memory
fails its test instead of taking the suite down; real templates must render exactly as before."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import real_tokenizer, train_tokenizer

HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string times 3e9": "{{ 'x' * 3000000000 }}",
    "list times 1e9": "{{ [1] * 10**9 }}",
    "range 1e9": "{% for i in range(10**9) %}{% endfor %}",
    "range over the sandbox cap": "{% for i in range(10**7) %}{% endfor %}",
    "huge power": "{{ 2 ** (10 ** 9) }}",
    "center filter": "{{ 'x'|center(3000000000) }}",
    "ljust method": "{{ 'x'.ljust(3000000000) }}",
    "percent width": "{{ '%3000000000d' % 1 }}",
    "format width": "{{ '{:>3000000000}'.format(1) }}",
    "format filter width": "{{ '%3000000000d'|format(1) }}",
    "tojson indent": "{{ messages|tojson(indent=3000000000) }}",
    "doubling namespace": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s|length }}",
    "join of a huge list": "{{ (['x' * 1000000] * 100000)|join }}",
    "output flood": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}
CHILD = textwrap.dedent("""
    import json, sys, time
    from mlxinfer.base.errors import MlxinferError
    from mlxinfer.text.tokenizer import load_tokenizer_from_dir
    for name, folder in json.loads(sys.argv[1]).items():
        start = time.monotonic()
        try:
            load_tokenizer_from_dir(folder).apply_chat_template([{"role": "user", "content": "hi"}])
            outcome = "rendered"
        except MlxinferError as e:
            outcome = "error: " + str(e)
        except BaseException as e:
            outcome = f"escaped {type(e).__name__}: {e}"[:300]
        print(json.dumps([name, outcome, time.monotonic() - start]), flush=True)
""")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[str, float]]:
    """Each hostile template rendered in one child process (killed after 90 s): name -> (outcome, seconds)."""
    root = tmp_path_factory.mktemp("templates")
    train_tokenizer(root)
    folders = {}
    for i, (name, template) in enumerate(HOSTILE.items()):
        folder = root / f"t{i}"
        folder.mkdir()
        shutil.copy(root / "tokenizer.json", folder)
        config = json.loads((root / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        folders[name] = str(folder)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(folders)], capture_output=True, text=True,
                              timeout=90)
        stdout = done.stdout
    except subprocess.TimeoutExpired as e:
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return {name: (outcome, seconds) for name, outcome, seconds in map(json.loads, stdout.splitlines())}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_one_line_error_in_bounded_time(outcomes, name):
    assert name in outcomes, f"{name!r} did not finish: the renderer hung or the process died"
    outcome, seconds = outcomes[name]
    assert outcome.startswith("error: chat template"), outcome
    assert "\n" not in outcome
    assert seconds < 10, f"{name!r} took {seconds:.1f} s"


def test_time_limit_names_itself(outcomes):
    assert "ran for over" in outcomes["nested loops"][0]


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "smollm2", "llama3.1", "mistral-instruct-v0.3"])
def test_real_templates_render_as_jinja_does(name):
    """The bounded renderer gives exactly what jinja2's plain sandbox gives on a long conversation."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    import mlxinfer
    from mlxinfer.text import tokenizer as T

    tok = mlxinfer.load_tokenizer(real_tokenizer(name))
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 40} for i in range(200)]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = T._tojson
    env.globals.update(raise_exception=T._raise_exception, strftime_now=T._strftime_now)
    expected = env.from_string(tok.chat_template).render(
        messages=messages, add_generation_prompt=True, tools=None, documents=None, **tok._special_tokens)
    started = time.perf_counter()
    assert tok.apply_chat_template(messages) == expected
    assert time.perf_counter() - started < T.sandbox.TIME_LIMIT


def test_tracing_is_restored_after_rendering(tiny):
    """The time limit traces the template's frames only while it renders; a debugger's or coverage's
    tracer that was there before is put back."""
    import mlxinfer

    def tracer(*_):
        return None

    tok = mlxinfer.load_tokenizer(tiny)
    sys.settrace(tracer)
    try:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_template_kwargs_and_messages_keep_working(tiny, tmp_path):
    """Big but legitimate inputs (a 1 MB message, numbers in tool arguments) still render."""
    import mlxinfer

    tok = mlxinfer.load_tokenizer(Path(tiny))
    text = tok.apply_chat_template([{"role": "user", "content": "y" * 1_000_000 + " 12345678901234"}])
    assert "y" * 1_000_000 + " 12345678901234" in text
