"""Every example of README.md and docs/*.md runs as written and prints what the page shows
(tests/docs_runner.py holds the convention and the runner; docs/regenerate.py rewrites the outputs
shown from the same runner), and every examples/*.py is run by a page."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from docs_runner import ROOT, Block, difference, normalize, pages, parse, problems, run_page, seed, steps

PAGES = pages()


@pytest.fixture(scope="session")
def docs_home(smollm2_wheel, tmp_path_factory) -> Path:
    """A HOME with the demo model converted from its wheel once per session; each page gets a
    linked copy of it."""
    return seed(tmp_path_factory.mktemp("docs-home") / "home", smollm2_wheel)


def test_every_block_is_run_or_says_why_not():
    """No block is silently ignored: each is run, holds data (text, json, ...) or says why it is
    not run; each shown output follows a block that is run."""
    found = [problem for page in PAGES for problem in problems(parse(page))]
    assert not found, "\n".join(found)


def test_every_example_script_is_run_by_a_page():
    """examples/*.py run in CI because a page runs each as the reader would."""
    commands = "\n".join("\n".join(block.lines) for page in PAGES for block in parse(page) if block.runs)
    missing = [f"examples/{script.name}" for script in sorted((ROOT / "examples").glob("*.py"))
               if not re.search(rf"\bexamples/{re.escape(script.name)}\b", commands)]
    assert not missing, f"no block of README.md or docs/ that is run runs {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(ROOT).as_posix() for page in PAGES])
def test_page_runs_as_written(page, docs_home, smollm2_wheel):
    failures = [result.failure for result, _ in run_page(parse(page), docs_home, smollm2_wheel) if result.failure]
    assert not failures, "\n\n".join(failures)


# The runner itself, on small pages of its own: each kind of difference is caught and located.

def write_page(tmp_path: Path, text: str) -> list[Block]:
    page = tmp_path / "page.md"
    page.write_text(text)
    return parse(page)


def failures_of(blocks: list[Block], home: Path) -> list[str]:
    return [result.failure for result, _ in run_page(blocks, home) if result.failure]


@pytest.fixture
def bare_home(tmp_path) -> Path:
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_a_changed_word_fails_naming_the_line(tmp_path, bare_home):
    blocks = write_page(tmp_path, "# t\n\n```console\n$ echo 'decode 8 tok 34.3 tok/s in 12 ms'\n"
                                  "decode 8 tok 9.1 tok/s in 300 ms\n$ echo two words\ntwo word\n```\n")
    [failure] = failures_of(blocks, bare_home)
    assert failure.startswith(f"{tmp_path / 'page.md'}:6: `echo two words`") and "-two word\n+two words" in failure


def test_shown_output_blocks_and_python_state(tmp_path, bare_home):
    page = ("```python\nx = 6 * 7\n```\n\n```python\nprint(x, 'tokens')\n```\n<!-- output of the block above -->\n"
            "```text\n42 tokens\n```\n\n```bash\necho $HOME/models; echo 5 files\n```\n"
            "<!-- output of the block above -->\n```text\n~/models\n4 files\n```\n")
    [failure] = failures_of(write_page(tmp_path, page), bare_home)
    assert ":17: `echo $HOME/models; echo 5 files` (" in failure and "-4 files\n+5 files" in failure


def test_failing_commands_and_python_errors_are_failures(tmp_path, bare_home):
    page = "```bash\ntrue\nfalse\n```\n\n```python\nraise ValueError('no')\n```\n\n```sh\nexit 3\n```\n"
    first, second, third = failures_of(write_page(tmp_path, page), bare_home)
    assert ":3: `false` exits 1" in first
    assert "page.md\", line 7" in second and "ValueError: no" in second
    assert ":10: the block exits 3" in third


def test_a_background_server_serves_the_blocks_after_it_and_stops(tmp_path, bare_home):
    from serving import free_port

    port = free_port()
    serve = ("import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[2])), "
             "http.server.SimpleHTTPRequestHandler).serve_forever()")
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/').status)"
    page = (f"<!-- run: background -->\n```bash\npython -c \"{serve}\" --port {port}\n```\n\n"
            f"```python\n{fetch}\n```\n<!-- output of the block above -->\n```text\n200\n```\n")
    assert failures_of(write_page(tmp_path, page), bare_home) == []
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # stopped with the page


def test_transcript_input_goes_to_stdin(tmp_path, bare_home):
    blocks = write_page(tmp_path, "```console\n$ cat | tr a-z A-Z\n>>> hello\nHELLO\n```\n")
    assert [step.stdin for step in steps(blocks[0])] == ["hello\n"]
    assert failures_of(blocks, bare_home) == []


def test_the_convention_is_checked(tmp_path):
    page = ("```\nbare\n```\n\n```javascript\nx()\n```\n\n<!-- not run: -->\n```bash\nrm -rf /\n```\n\n"
            "<!-- not run: needs a Mac -->\n```swift\nx()\n```\n\n<!-- not run: needs a Mac -->\n```bash\nmetal\n```\n"
            "<!-- output of the block above -->\n```text\nfast\n```\n\n```json\n{}\n```\n")
    found = problems(write_page(tmp_path, page))
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in found] == ["1", "5", "10", "24"], found


def test_normalize_blanks_only_measurements():
    printed = "[TTFT 1443 ms | prefill 37 tok 26 tok/s | cache 45 tok 2.1 MB] 92.5 GFLOP/s on 2026-11-28 12:00"
    assert normalize(printed) == ["[TTFT <measured> | prefill 37 tok <measured> | cache 45 tok <measured>] "
                                  "<measured> on <date>"]
    assert normalize("9 query heads, 3 KV heads  (46,080 bytes)") == ["9 query heads, 3 KV heads (46,080 bytes)"]


def test_outputs_that_vary_by_machine_are_compared_by_their_labels():
    shown = ["BLAS: OpenBLAS (Haswell kernels)", "4-bit GEMM: 259 GFLOP/s", "  decode tok/s  134.7 [129.0-140.5]"]
    other = ["BLAS: BLIS", "4-bit GEMM: 118 GFLOP/s", "  decode tok/s   97.1 [90.2-99.0]"]
    assert difference(shown, other, None, form_only=True) is None
    assert "+  decode tokens/s" in difference(shown, [*other[:2], "  decode tokens/s 97.1"], None, form_only=True)


def test_regenerate_rewrites_what_the_test_rejects(tmp_path, bare_home):
    """docs/regenerate.py writes back what the blocks print, leaving outputs the test accepts alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "docs" / "regenerate.py")
    regenerate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regenerate)
    page = tmp_path / "page.md"
    page.write_text("```bash\necho hello; echo took 3 s\n```\n<!-- output of the block above -->\n```text\nbye\n```\n\n"
                    "```console\n$ echo one\ntwo\n$ echo took 2 s\ntook 9 s\n```\n")
    assert regenerate.regenerate(page, bare_home, None, every=False) == (2, [])
    assert page.read_text() == ("```bash\necho hello; echo took 3 s\n```\n<!-- output of the block above -->\n"
                                "```text\nhello\ntook 3 s\n```\n\n```console\n$ echo one\none\n$ echo took 2 s\n"
                                "took 2 s\n```\n")
    assert failures_of(parse(page), bare_home) == []
    page.write_text("- a list item:\n\n  ```bash\n  printf '  two spaces'\n  ```\n  <!-- output of the block above -->\n"
                    "  ```text\n  ```\n")
    regenerate.regenerate(page, bare_home, None, every=True)
    assert page.read_text().endswith("  ```text\n    two spaces\n  ```\n")
