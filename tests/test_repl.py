"""The chat REPL in a real pseudo-terminal (pexpect drives `python -m mlxinfer chat`).

Prefill counts shown on screen are checked against a conversation replayed here
independently: the template rendered with the tokenizer, greedy replies from fresh
(uncached) generation, and the tokens the cache must already hold."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlxinfer
from mlxinfer.engine.generate import stream_generate
from mlxinfer.cli.terminal import CYAN, DIM, spinner

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"\[TTFT [\d.]+ ms \| prefill (\d+) tok [\d.]+ tok/s \| decode (\d+) tok [\d.]+ tok/s \| "
                   r"cache (\d+) tok")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def endless(tiny, tmp_path_factory) -> Path:
    """The tiny model with its end-of-turn logits pinned to 0: greedy replies never end by themselves."""
    folder = tmp_path_factory.mktemp("endless") / "model"
    shutil.copytree(tiny, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    tok = mlxinfer.load_tokenizer(folder)
    head = weights["lm_head.weight"]
    for eos in tok.eos_token_ids:
        head[eos] = 0.0
    mx.save_safetensors(str(folder / "model.safetensors"), {**weights, "lm_head.weight": head}, {"format": "pt"})
    model, _ = mlxinfer.load(folder, dtype="float32")
    chunks = list(stream_generate(model, tok, [{"role": "user", "content": "go"}], max_tokens=300,
                                  temperature=0.0, max_kv_size=64))
    assert chunks[-1].finish_reason == "length"
    return folder


def spawn(model: Path, home: Path, *args: str, color: bool = False) -> pexpect.spawn:
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "MLXINFER_HOME": str(home),
           "HF_HUB_OFFLINE": "1"}
    env.pop("NO_COLOR", None)
    if not color:
        env["NO_COLOR"] = "1"
    child = pexpect.spawn(sys.executable, ["-m", "mlxinfer", "chat", "-m", str(model), "--temp", "0", *args],
                          env=env, cwd=str(ROOT), encoding="utf-8", timeout=60, dimensions=(50, 250))
    child.expect_exact(">>>")
    return child


def say(child: pexpect.spawn, text: str) -> None:
    child.send(text + "\r")


def reply_stats(child: pexpect.spawn) -> tuple[int, int, int]:
    """(prefilled, generated, cached) from the stats line after a reply; waits for the next prompt."""
    child.expect(STATS)
    found = tuple(int(x) for x in child.match.groups())
    child.expect_exact(">>>")
    return found


def command(child: pexpect.spawn, line: str, expect: str) -> str:
    say(child, line)
    child.expect(expect)
    text = child.match.group(0)
    child.expect_exact(">>>")
    return text


def quit_(child: pexpect.spawn) -> None:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


class Replay:
    """The conversation the REPL should hold, recomputed without any cache reuse."""

    def __init__(self, model, tok, max_tokens: int = MAX_TOKENS):
        self.model, self.tok, self.max_tokens = model, tok, max_tokens
        self.messages: list[dict] = []
        self.tokens: list[int] = []  # the conversation as the model saw it, through the last reply
        self.text = ""
        self.cached: list[int] = []  # what the KV cache holds after the last reply
        self.history: list[tuple[list[int], str]] = []  # (tokens, text) after each exchange

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def render(self, generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(self.messages, add_generation_prompt=generation_prompt)

    def ids_for(self, rendered: str) -> list[int]:
        """The transcript's ids for what it covers, the rest of the render encoded."""
        assert rendered.startswith(self.text)
        return self.tokens + self.encode(rendered[len(self.text):]) if self.text else self.encode(rendered)

    def turn(self, text: str) -> int:
        """The user says `text`; returns how many tokens the REPL must prefill for it."""
        self.messages.append({"role": "user", "content": text})
        rendered = self.render()
        prompt = self.ids_for(rendered)
        self.prompt_tokens = len(prompt)
        common = next((i for i, (a, b) in enumerate(zip(prompt, self.cached)) if a != b),
                      min(len(prompt), len(self.cached)))
        chunks = list(stream_generate(self.model, self.tok, prompt, max_tokens=self.max_tokens, temperature=0.0))
        ids = [c.token for c in chunks if c.token is not None]
        reply = "".join(c.text for c in chunks)
        kept = ids[:-1] if chunks[-1].finish_reason == "stop" else ids
        self.messages.append({"role": "assistant", "content": reply})
        self.tokens, self.text = prompt + kept, rendered + reply
        self.history.append((self.tokens, self.text))
        self.cached = prompt + (ids if len(ids) < self.max_tokens else ids[:-1])  # the last token is never fed
        return len(prompt) - common

    def undo(self) -> int:
        """Drop the last exchange; the number of tokens the cache must hold afterwards."""
        del self.messages[-2:]
        self.history.pop()
        self.tokens, self.text = self.history[-1] if self.history else ([], "")
        self.cached = self.ids_for(self.render(generation_prompt=False)) if self.messages else []
        return len(self.cached)


def test_multi_turn_prefills_only_the_new_turn(tiny, loaded, tmp_path):
    replay = Replay(*loaded)
    child = spawn(tiny, tmp_path / "home", "--max-tokens", str(MAX_TOKENS))
    for text in ("hello there", "What is the capital of France?", "and Germany?"):
        expected = replay.turn(text)
        say(child, text)
        prefilled, generated, cached = reply_stats(child)
        assert (prefilled, generated) == (expected, MAX_TOKENS)
        assert cached == len(replay.cached)
    assert expected < len(replay.encode(replay.render())) // 2  # far less than the whole conversation
    quit_(child)
    assert "What is the capital of France?" in (tmp_path / "home" / "chat_history").read_text()


def test_undo_reset_save_and_load(tiny, loaded, tmp_path):
    replay = Replay(*loaded)
    child = spawn(tiny, tmp_path / "home", "--max-tokens", str(MAX_TOKENS))
    for text in ("hello there", "tell me more", "and more"):
        replay.turn(text)
        say(child, text)
        reply_stats(child)
    cached = replay.undo()
    assert command(child, "/undo", r"dropped the last exchange; cache (\d+) tokens") == \
        f"dropped the last exchange; cache {cached} tokens"
    expected = replay.turn("something else")
    say(child, "something else")
    assert reply_stats(child)[0] == expected

    save = tmp_path / "chat.json"
    command(child, f"/save {save}", r"saved 6 messages and \d+ cached tokens")
    command(child, "/reset", "conversation cleared")
    command(child, "/stats", "conversation: 0 messages; cache 0 tokens")
    command(child, f"/load {save}", rf"loaded 6 messages; cache restored \({len(replay.cached)} tokens\)")
    expected = replay.turn("after loading")
    say(child, "after loading")
    assert reply_stats(child)[0] == expected  # no re-prefill of the saved conversation
    command(child, "/reset", "conversation cleared")
    say(child, "hello there")
    _, tok = loaded
    assert reply_stats(child)[0] == len(tok.apply_chat_template([{"role": "user", "content": "hello there"}],
                                                                tokenize=True))
    quit_(child)


def test_ctrl_c_stops_a_reply_and_keeps_the_session(endless, tmp_path):
    child = spawn(endless, tmp_path / "home", "--max-kv-size", "64", "--max-tokens", "1000000")
    say(child, "go")
    child.expect(r"[^\x1b]{200}")  # the reply is streaming (the prompt's redraw is full of escapes)
    child.sendintr()
    child.expect_exact("[interrupted; the partial reply is kept]")
    child.expect(STATS)
    child.expect_exact(">>>")
    command(child, "/stats", r"conversation: 2 messages; cache \d+ tokens")
    command(child, "/set max_tokens 5", "max_tokens = 5")
    say(child, "and now a short one")
    assert reply_stats(child)[1] == 5
    command(child, "/undo", "dropped the last exchange")
    command(child, "/stats", "conversation: 2 messages")
    quit_(child)


def test_bad_commands_get_one_line_and_the_session_goes_on(tiny, tmp_path):
    child = spawn(tiny, tmp_path / "home", "--max-tokens", "4")
    for line, message in [
        ("/frobnicate", "unknown command /frobnicate; type /help for the list"),
        ("/set temp hot", "error: temp needs a number, got 'hot'"),
        ("/set top_k -1", r"error: top_k must be >= 0"),
        ("/set speed 3", "error: unknown setting 'speed'"),
        ("/save", "error: /save needs a file name"),
        (f"/load {tmp_path / 'none.json'}", "error: no saved chat at"),
        ("/undo", "nothing to undo"),
    ]:
        command(child, line, re.escape(message) if not message.startswith("error: top_k") else message)
    say(child, "still here?")
    assert reply_stats(child)[1] == 4
    quit_(child)


def test_line_editing_multi_line_history_and_ctrl_c_at_the_prompt(tiny, loaded, tmp_path):
    model, tok = loaded
    home = tmp_path / "home"
    child = spawn(tiny, home, "--max-tokens", "3")
    child.send("/undo-this-typo")
    child.sendintr()  # clears the line
    command(child, "/help", r"/save FILE\s+save the conversation")
    child.send('"""first line\r')
    child.send('second line"""\r')
    reply_stats(child)
    child.send("one\x1b\rtwo\r")  # Alt-Enter inserts a newline
    reply_stats(child)
    say(child, "/stats")
    child.expect(r"last reply: (\d+) prompt tokens")
    replay = Replay(model, tok, max_tokens=3)
    replay.turn("first line\nsecond line")
    replay.turn("one\ntwo")
    assert int(child.match.group(1)) == replay.prompt_tokens
    child.expect_exact(">>>")
    say(child, "/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    child = spawn(tiny, home, "--max-tokens", "3")
    child.send("\x1b[A" * 3 + "\r")  # history from the last session: /exit, /stats, then the Alt-Enter message
    reply_stats(child)
    say(child, "/stats")
    child.expect(r"last reply: (\d+) prompt tokens")
    assert int(child.match.group(1)) == len(tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}],
                                                                    tokenize=True))
    child.expect_exact(">>>")
    quit_(child)


@pytest.mark.parametrize("color", [True, False])
def test_drafted_tokens_are_coloured_unless_no_color(tiny, tmp_path, color):
    child = spawn(tiny, tmp_path / "home", "--prompt-lookup", "--max-tokens", "60", color=color)
    say(child, "the quick brown fox")
    child.expect(r"accepted (\d+)/(\d+) drafted")
    shown = child.before
    assert int(child.match.group(1)) > 0
    child.expect_exact(">>>")
    assert (CYAN in shown) == color and (DIM in shown) == color
    quit_(child)


class FakeTerminal(io.StringIO):
    """A terminal that says when the spinner first drew on it."""

    def __init__(self):
        super().__init__()
        self.drawn = threading.Event()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        written = super().write(text)
        self.drawn.set()
        return written


def test_spinner_shows_only_on_a_terminal_and_cleans_up():
    screen = FakeTerminal()
    with spinner("loading model", screen, delay=0.0):
        assert screen.drawn.wait(60)  # however busy the machine, the block lasts until the spinner drew
    assert "loading model" in screen.getvalue() and screen.getvalue().endswith("\r\x1b[K")
    quiet, threads = io.StringIO(), threading.active_count()
    with spinner("loading model", quiet, delay=0.0):
        assert threading.active_count() == threads  # not a terminal: nothing is started that could draw later
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("stdin_errors", ["strict", "surrogateescape"])
def test_piped_chat_survives_bad_files_and_bytes_that_are_not_utf8(tiny, tmp_path, stdin_errors):
    """Piped input: a /load of a broken file, a line that is not UTF-8 and a command that fails are each
    one `error:` line (or a reply with U+FFFD); the chat goes on to answer the last line."""
    import subprocess

    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"messages": [1, 2], "options": "nope"')
    not_utf8 = b"caf\xe9 \xff\xfe ok"
    lines = [f"/load {bad}".encode(), f"/load {tmp_path}".encode(), not_utf8, b"/set top_k -1", b"hello there"]
    env = {**os.environ, "MLXINFER_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
           "PYTHONIOENCODING": f"utf-8:{stdin_errors}"}
    done = subprocess.run([sys.executable, "-m", "mlxinfer", "chat", "-m", str(tiny), "--temp", "0",
                           "--max-tokens", "4"], input=b"\n".join(lines) + b"\n", env=env, cwd=str(ROOT),
                          capture_output=True, timeout=120)
    out = done.stdout.decode("utf-8", "replace") + done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, out
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, out  # the two /loads and /set; the undecodable line is a message
    assert len(STATS.findall(out)) == 2, out  # replies to the U+FFFD line and to "hello there"


def test_history_file_is_private(tiny, tmp_path):
    """The history holds everything typed: created 0600, and an existing one made so."""
    home = tmp_path / "home"
    child = spawn(tiny, home, "--max-tokens", "2")
    say(child, "my secret")
    reply_stats(child)
    quit_(child)
    history = home / "chat_history"
    assert "my secret" in history.read_text()
    assert history.stat().st_mode & 0o777 == 0o600
    history.chmod(0o644)
    quit_(spawn(tiny, home))
    assert history.stat().st_mode & 0o777 == 0o600


def test_format_command_holds_replies_to_a_regex_then_lets_go(tiny, tmp_path):
    import subprocess

    lines = [b"/format regex [0-9]{4}", b"give me digits", b"/format json {oops", b"/format", b"/format off",
             b"hello there"]
    env = {**os.environ, "MLXINFER_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "mlxinfer", "chat", "-m", str(tiny), "--temp", "0",
                           "--max-tokens", "8"], input=b"\n".join(lines) + b"\n", env=env, cwd=str(ROOT),
                          capture_output=True, timeout=120)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0 and "Traceback" not in out, out
    assert "replies are held to regex [0-9]{4}" in out
    assert re.search(r"^(?:>>> )*[0-9]{4}$", out, re.M), out  # the reply, exactly four digits
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not valid JSON" in errors[0], out
    assert 'format: {"type": "regex", "pattern": "[0-9]{4}"}' in out and "replies are free text again" in out
    assert len(STATS.findall(out)) == 2, out


def test_a_tool_call_is_shown_readably(hf_checkpoint, tmp_path):
    import subprocess

    roomy = hf_checkpoint("llama", head_dim=32, max_position_embeddings=2048)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}]))
    env = {**os.environ, "MLXINFER_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "mlxinfer", "chat", "-m", str(roomy), "--temp", "0",
                           "--max-tokens", "40", "--tools", str(tools), "--tool-choice", "required"],
                          input=b"pick a number\n", env=env, cwd=str(ROOT), capture_output=True, timeout=120)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0 and "Traceback" not in out, out
    assert re.search(r"^tool call: pick\(n=[0-9]\)$", out, re.M), out
