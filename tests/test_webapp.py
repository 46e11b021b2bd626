"""The web app at `mlxinfer serve`'s address, driven in a real browser: the distribution's
Chromium under playwright, against the real server (tests/serving.py) with the tiny model,
drafting by prompt lookup, prefilling in chunks of PREFILL_STEP tokens, its engine steps slowed
a little (tests/fault_server.py) so a reply can be stopped mid-way; and against SmolLM2 (real
weights, real chat template).

The oracle for what the page shows is the server's own API called directly with the same
request (temperature 0: the same reply, the same logprobs, token ids and drafts), for token
ids transformers' tokenizer, and for the attention weights transformers' eager attention on
the same tokens, for the Markdown renderer markdown-it-py (CommonMark). The browser may reach
127.0.0.1 only; every request it makes is logged and checked."""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
from serving import KEY, Server, post

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (CI installs it: apt-get install chromium)")
expect = sync_api.expect
HERE = Path(__file__).parent
TIMEOUT_MS = 30_000  # a hang guard: every wait below ends on an event
expect.set_options(timeout=TIMEOUT_MS)  # assertions retry until then (playwright's default is 5 s)
PREFILL_STEP = 8  # the tiny server's prefill chunk: "hello there" (17 tokens) prefills in two


def chunked(n: int, step: int = PREFILL_STEP) -> list[int]:
    """The chunk sizes a prefill of n prompt tokens runs in: all but the last token, `step` at a time
    (the last runs with the first decode step)."""
    return [min(step, n - 1 - i) for i in range(0, n - 1, step)]


STORY = 'tell me a long story <img src="http://192.0.2.1/x.png"> [go](javascript:alert(1)) **now**'


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    """The file that lets the STORY reply go on after its first tokens (tests/fault_server.py)."""
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def server(tiny, loaded, gate):
    story = loaded[1].apply_chat_template([{"role": "user", "content": STORY}], add_generation_prompt=True,
                                          tokenize=True)
    s = Server(["-m", str(tiny), "--dtype", "float32", "--api-key", KEY, "--prompt-lookup",
                "--prefill-step", str(PREFILL_STEP)],
               env={"MLXINFER_TEST_STEP_DELAY": "0.02", "MLXINFER_TEST_GATE": str(gate),
                    "MLXINFER_TEST_GATE_DECODE": ",".join(map(str, story))},
               script=[sys.executable, str(HERE / "fault_server.py")])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """One tab on the web app, with what it logged: console errors and every request it made."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context()
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.bodies: list[dict] = []  # chat completion request bodies, in order
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._sent)
        self.page.goto(url)

    def _sent(self, request) -> None:
        self.requests.append(request.url)
        if request.url.endswith("/v1/chat/completions"):
            self.bodies.append(request.post_data_json)

    def replies(self):
        return self.page.get_by_role("article", name="Assistant")

    def send(self, text: str) -> None:
        box = self.page.get_by_role("textbox", name="Message")
        box.fill(text)
        box.press("Enter")

    def wait_done(self) -> None:
        """Until no reply streams (the Stop button is gone) and the page has saved it."""
        expect(self.page.get_by_role("button", name="Stop")).to_have_count(0)
        expect(self.page.get_by_role("button", name="Send")).to_be_enabled()

    def conversation(self) -> list[dict]:
        """The current conversation's messages as the page stored them."""
        return self.page.evaluate("JSON.parse(localStorage.getItem('mlxinfer.conversations'))[0].messages")

    def settings(self, **values: str) -> None:
        toggle = self.page.get_by_role("button", name="Settings")
        if toggle.get_attribute("aria-expanded") != "true":
            toggle.click()
        for label, value in values.items():
            self.page.get_by_label(label, exact=True).fill(value)


def keyed(browser, server) -> Page:
    """A fresh tab (its own storage) after the API key flow: the server answers 401, the page asks once."""
    t = Page(browser, server.url + "/")
    dialog = t.page.get_by_role("dialog", name="API key")
    expect(dialog).to_be_visible()
    dialog.get_by_label("API key").fill(KEY)
    dialog.get_by_role("button", name="Use key").click()
    expect(t.page.locator("body[data-ready=true]")).to_have_count(1)
    return t


@pytest.fixture
def tab(browser, server):
    """Each test's own tab, from empty storage; afterwards, what it logged: no console error, and no
    request that left the server."""
    t = keyed(browser, server)
    yield t
    t.context.close()
    assert t.errors == []
    assert t.requests and all(u.startswith(server.url + "/") for u in t.requests), t.requests


def api_chat(server, text: str, **options) -> dict:
    status, body, _ = post(server.url, {"messages": [{"role": "user", "content": text}], "temperature": 0,
                                        **options})
    assert status == 200, body
    return body


def greedy_reply(tab: Page, text: str) -> None:
    """Send `text` with the settings the tests compare against the API (greedy, 12 tokens, seed 7)
    and wait for the whole reply."""
    tab.settings(**{"Temperature": "0", "Max tokens": "12", "Seed": "7"})
    before = tab.replies().count()
    tab.send(text)
    expect(tab.replies()).to_have_count(before + 1)
    tab.wait_done()


def test_the_page_loads_after_asking_for_the_key_once(tab, server):
    expect(tab.page.get_by_role("heading", level=1)).to_have_text(server.health()["model"])
    assert tab.page.evaluate("sessionStorage.getItem('mlxinfer.key')") == KEY
    tab.page.reload()  # the key is kept for the tab: not asked again
    expect(tab.page.locator("body[data-ready=true]")).to_have_count(1)
    expect(tab.page.get_by_role("dialog", name="API key")).to_be_hidden()
    box = tab.page.get_by_role("textbox", name="Message")
    box.press("x")
    box.press("Shift+Enter")  # a new line, not a send
    box.press("y")
    assert box.input_value() == "x\ny" and tab.bodies == []
    box.fill("")
    assert tab.errors == []


def test_a_dismissed_key_dialog_asks_again_on_the_next_send(browser, server):
    """Esc closes the dialog without a submit: the wait for the key ends there (a refusal shown), and
    the next request the server refuses asks again."""
    t = Page(browser, server.url + "/")
    try:
        dialog = t.page.get_by_role("dialog", name="API key")
        error = t.page.locator("#error")
        expect(dialog).to_be_visible()  # asked before the first call
        t.page.keyboard.press("Escape")
        expect(dialog).to_be_hidden()
        expect(error).to_contain_text("API key")
        t.settings(**{"Temperature": "0", "Max tokens": "12", "Seed": "7"})
        t.send("hello there")  # the server answers 401: asked again
        expect(dialog).to_be_visible()
        t.page.keyboard.press("Escape")  # dismissed again, mid-send: that send ends
        expect(dialog).to_be_hidden()
        t.wait_done()
        expect(error).to_contain_text("API key")
        t.send("hello there")
        expect(dialog).to_be_visible()
        dialog.get_by_label("API key").fill(KEY)
        dialog.get_by_role("button", name="Use key").click()
        expect(t.replies()).to_have_count(1)
        t.wait_done()
        sent = t.bodies[-1]["messages"]  # the refused sends' messages stay in the conversation
        assert [m["content"] for m in sent] == ["hello there"] * 2
        _, want, _ = post(server.url, {"messages": sent, "temperature": 0, "max_tokens": 12, "seed": 7})
        assert t.conversation()[-1]["content"] == want["choices"][0]["message"]["content"]
        expect(error).to_be_empty()
        assert all("401 (Unauthorized)" in e for e in t.errors), t.errors  # Chromium logs each 401: no other error
    finally:
        t.context.close()


def test_settings_shape_the_request_and_a_greedy_reply_equals_the_api(tab, server):
    form = tab.page.get_by_role("form", name="Settings")
    expect(form).to_be_hidden()  # folded until asked for
    tab.settings(**{"Temperature": "0", "Max tokens": "12", "Seed": "7"})
    expect(form).to_be_visible()
    tab.send("hello there")
    expect(tab.replies()).to_have_count(1)
    tab.wait_done()
    sent = tab.bodies[-1]
    assert (sent["temperature"], sent["max_tokens"], sent["seed"], sent["stream"]) == (0, 12, 7, True)
    want = api_chat(server, "hello there", max_tokens=12, seed=7)
    assert tab.conversation()[-1]["content"] == want["choices"][0]["message"]["content"]
    stats = tab.replies().first.locator(".stats").inner_text()
    assert re.search(r"TTFT \d+ ms · prefill [\d.]+ tok/s · decode [\d.]+ tok/s", stats), stats
    assert f"{want['usage']['completion_tokens']} tokens · {want['usage']['prompt_tokens']} prompt" in stats
    timings = tab.conversation()[-1]["look"]["timings"]  # the server drafts by prompt lookup: acceptance shown
    assert timings["draft_n"] > 0 and f"drafts accepted {timings['draft_n_accepted']}/{timings['draft_n']}" in stats


def shown(items, key: str) -> list[str]:
    """`data-KEY` of each item, in order."""
    return items.evaluate_all(f"items => items.map(i => i.dataset.{key})")


def token_ids(logprobs: list[dict]) -> list[int]:
    """The ids of the tokens in chat logprobs sent with return_tokens_as_token_ids."""
    assert all(t["token"].startswith("token_id:") for t in logprobs), logprobs
    return [int(t["token"].removeprefix("token_id:")) for t in logprobs]


LOOK = "hello world"  # this test's own prompt (no other sends it): prompt lookup drafts on its reply


def test_look_inside_lists_each_token_with_the_api_logprobs_ids_and_drafts(tab, server):
    greedy_reply(tab, LOOK)
    tab.replies().last.get_by_role("button", name="Look inside").click()
    tokens = tab.page.get_by_role("region", name="Tokens")
    body = api_chat(server, LOOK, max_tokens=12, seed=7, logprobs=True, top_logprobs=5,
                    return_tokens_as_token_ids=True, return_token_details=True)
    want = body["choices"][0]["logprobs"]["content"]
    items = tokens.get_by_role("list", name="Reply tokens").get_by_role("listitem")
    expect(items).to_have_count(len(want))
    assert [float(x) for x in shown(items, "logprob")] == [t["logprob"] for t in want]
    assert [int(x) for x in shown(items, "id")] == token_ids(want)
    drafted = [d["drafted"] for d in body["choices"][0]["token_details"]]
    assert shown(items, "drafted") == [str(d).lower() for d in drafted]
    assert sum(drafted) == body["timings"]["draft_n_accepted"] > 0  # prompt lookup drafted, and it is marked
    assert f"id {token_ids(want)[0]}" in items.first.get_attribute("title")
    expect(items.and_(tab.page.locator(".drafted"))).to_have_count(sum(drafted))
    status, ids, _ = post(server.url, {"messages": [{"role": "user", "content": LOOK}]}, path="/tokenize")
    expect(tokens.get_by_role("list", name="Prompt tokens").get_by_role("listitem")).to_have_count(ids["count"])
    stages = tab.page.get_by_role("region", name="Pipeline").get_by_role("list", name="Stages").get_by_role("listitem")
    expect(stages).to_have_count(5)
    assert f"become {ids['count']} tokens" in stages.first.inner_text()
    # the timeline: what the prompt cache did not hold (at most the chat template's opening, shared with
    # other prompts) prefilled chunk by chunk
    timings = tab.conversation()[-1]["look"]["timings"]
    assert timings["cache_n"] + timings["prompt_n"] == ids["count"]
    timeline = tab.page.get_by_role("region", name="Pipeline").get_by_role("list", name="Timeline")
    chunks = timeline.locator(".prefill")
    expect(chunks).to_have_count(len(chunked(timings["prompt_n"])))
    assert [int(n) for n in shown(chunks, "n")] == chunked(timings["prompt_n"]) and chunks.count() > 1
    assert all(float(ms) > 0 for ms in shown(chunks, "ms"))
    steps = timeline.locator(".step")
    expect(steps).to_have_count(len(want) - 1)  # the first token comes with the prefill
    assert shown(steps, "drafted") == [str(d).lower() for d in drafted[1:]]
    attention = tab.page.get_by_role("region", name="Attention")
    attention.get_by_role("combobox", name="Layer").select_option("1")
    attention.get_by_role("combobox", name="Head").select_option("2")
    attention.get_by_role("button", name="Show attention").click()
    cells = attention.get_by_role("list", name="Attention weights").get_by_role("listitem")
    _, want, _ = post(server.url, {"messages": [{"role": "user", "content": LOOK}],
                                   "reply": tab.conversation()[-1]["content"], "layer": 1, "head": 2},
                      path="/v1/attention")
    expect(cells).to_have_count(len(want["tokens"]))
    assert [float(x) for x in cells.evaluate_all("cells => cells.map(c => c.dataset.weight)")] == want["weights"]


def test_regenerate_and_edit(tab, server):
    greedy_reply(tab, "hello there")
    before = len(tab.bodies)
    tab.replies().last.get_by_role("button", name="Regenerate").click()
    tab.wait_done()
    assert len(tab.bodies) == before + 1 and len(tab.conversation()) == 2
    want = api_chat(server, "hello there", max_tokens=12, seed=7)["choices"][0]["message"]["content"]
    assert tab.conversation()[-1]["content"] == want
    tab.page.get_by_role("article", name="You").get_by_role("button", name="Edit").click()
    tab.page.get_by_role("textbox", name="Edit message").fill("the quick brown fox")
    tab.page.get_by_role("button", name="Save and send").click()
    tab.wait_done()
    messages = tab.conversation()
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "the quick brown fox"
    assert messages[1]["content"] == api_chat(server, "the quick brown fox", max_tokens=12,
                                              seed=7)["choices"][0]["message"]["content"]


def test_stop_ends_the_reply_and_frees_the_slot(tab, server, gate):
    tab.page.get_by_role("button", name="New chat").click()
    tab.settings(**{"Max tokens": "200"})
    tab.send(STORY)  # the server holds this reply after its first tokens until the gate opens
    stop = tab.page.get_by_role("button", name="Stop")
    expect(stop).to_be_visible()
    expect(tab.replies().last.locator(".content")).not_to_be_empty()  # tokens are arriving
    assert server.health()["active"] == 1
    tab.page.keyboard.press("Escape")
    tab.wait_done()
    gate.touch()  # the engine goes on: its next step sees the request cancelled
    health = server.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0)
    assert (health["active"], health["queued"]) == (0, 0)
    assert "stopped" in tab.replies().last.locator(".stats").inner_text()
    mine = tab.page.get_by_role("article", name="You").last
    assert mine.locator("img, a, script").count() == 0 and mine.locator("strong").inner_text() == "now"
    assert '<img src="http://192.0.2.1/x.png">' in mine.inner_text()


def test_conversations_rename_delete_export(tab):
    greedy_reply(tab, "hello there")  # a conversation with a reply, then an empty one
    tab.page.get_by_role("button", name="New chat").click()
    names = tab.page.get_by_role("complementary", name="Conversations").get_by_role("listitem")
    expect(names).to_have_count(2)
    names.first.get_by_role("button", name="Rename").click()
    tab.page.get_by_role("textbox", name="Conversation name").fill("story time")
    tab.page.get_by_role("textbox", name="Conversation name").press("Enter")
    expect(names.first.get_by_role("button", name="story time", exact=True)).to_have_count(1)
    with tab.page.expect_download() as download:
        tab.page.get_by_role("button", name="Export").click()
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported == tab.page.evaluate("JSON.parse(localStorage.getItem('mlxinfer.conversations'))")
    assert [c["title"] for c in exported][0] == "story time"
    tab.page.get_by_role("button", name="Delete story time").click()
    expect(names).to_have_count(1)
    assert len(tab.page.evaluate("JSON.parse(localStorage.getItem('mlxinfer.conversations'))")) == 1


# --- the Markdown renderer (markdown.js, inline.js): untrusted text, linear time, drawn incrementally ---

# A rendering as a comparable tree, in the page: [tag, attributes..., children], adjacent text joined,
# the line endings around blocks dropped; ours and markdown-it's HTML in one vocabulary (our headings
# sit two levels down under the page's own, our code blocks carry a copy button and data-lang).
SHAPE = """(root, oracle) => {
  const BLOCKS = new Set(["DIV", "LI", "BLOCKQUOTE", "UL", "OL"]);
  const children = (node) => {
    const out = [];
    let afterBreak = false;
    for (const child of node.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) {
        const text = afterBreak ? child.data.replace(/^\\n/, "") : child.data;
        if (typeof out.at(-1) === "string") out[out.length - 1] += text; else out.push(text);
      } else out.push(element(child));
      afterBreak = child.nodeName === "BR";
    }
    const trim = (x) => typeof x === "string" && BLOCKS.has(node.nodeName) ? x.replace(/^\\n+|\\n+$/g, "") : x;
    return out.map(trim).filter((x) => x !== "");
  };
  const element = (e) => {
    const tag = e.nodeName.toLowerCase();
    if (!oracle && tag === "div" && e.className === "code") {
      const pre = e.querySelector("pre");
      return ["pre", pre.dataset.lang ?? "", pre.textContent];
    }
    if (oracle && tag === "pre") {
      return ["pre", e.firstChild.className.replace(/^language-/, ""), e.textContent.replace(/\\n$/, "")];
    }
    if (/^h[1-6]$/.test(tag)) return [oracle ? `h${Math.min(Number(tag[1]) + 2, 6)}` : tag, ...children(e)];
    if (tag === "a") return ["a", e.getAttribute("href"), ...children(e)];
    if (tag === "ol") return ["ol", e.getAttribute("start") ?? "1", ...children(e)];
    if (tag === "code") return ["code", e.textContent];
    return [tag, ...children(e)];
  };
  return children(root);
}"""

# What chat replies hold, and CommonMark's corners of it.
ORDINARY = [
    "Hello! Here is **bold**, *italic*, `code`, and a [link](https://example.com/docs).",
    "# One\n## Two\n### Three\n#### Four\n##### Five\n###### Six\n\nText under them.",
    "Steps:\n\n1. Install it\n2. Run `mlxinfer serve`\n3. Open the page\n",
    "- apples\n- pears\n  - green\n  - red\n- plums\n",
    "A loose list:\n\n- one\n\n- two\n\n- three\n",
    "```python\ndef add(a, b):\n    return a + b\n```\n\nAnd in a shell:\n\n~~~bash\necho \"hi\" | wc -c\n~~~\n",
    "> A quote with *emphasis*\n> over two lines\n>\n> - and a list\n",
    "Before\n\n---\n\nAfter\n\n***\n\n___\n",
    "Setext heading\n==============\n\nSmaller\n-------\n",
    "snake_case_name and __init__ stay as they are, 2*3*4 = 24, and a_b_c too.",
    "Line one  \nline two (a hard break)\\\nline three\n",
    "Escaped \\*stars\\* and \\`ticks\\` and \\[brackets\\].",
    "3. starts at three\n4. four\n\n10) another list\n",
    "1. **Install**:\n\n   ```bash\n   pip install mlxinfer\n   ```\n\n2. **Serve**: run it.\n",
    "Backticks inside code: `` a `b` c `` and ``` ` ```.",
    "A [link with *emphasis*](http://example.org/a_(b)) and [another](https://x.y/?q=1#frag).",
    "Unsafe links stay text: [click](javascript:alert(1)) and [file](file:///etc/passwd).",
    "HTML stays text: <img src=x onerror=alert(1)> <script>alert(1)</script> <b>bold?</b>",
    "    indented code\n    second line\n\nafter\n",
    "***strong emphasis*** then **bold *nested* bold** and *em **strong** em*; *a *b* c*, **a**b, foo*bar*",
    "- item with `code`\n\n  a second paragraph in the item\n- next\n",
    "Tabs:\n\n\tcode after a tab\n\n-\tlist item after a tab\n",
    "A paragraph\n> a quote interrupting it\ncontinued lazily\n",
    "# Title #\n\nText #not a heading\n\n#5 not a heading either\n",
    "Empty fenced block:\n\n```\n```\n\nUnclosed at the end:\n\n```js\nlet a = 1;\n",
    "Unicode: *très* bien — 中文 **粗体** 🙂 *ok*",
    "1. a\n   1. nested ordered\n   2. two\n2. b\n",
    "- a\n- b\n\n\n- c after two blank lines\n",
    "> quote\n\n> another quote\n> > nested\n",
]


def markdown_it(sources: list[str]) -> list[str]:
    """CommonMark's HTML for each source, from markdown-it-py (raw HTML off: it stays text, as in ours)."""
    mdit = pytest.importorskip("markdown_it", reason="markdown-it-py is the oracle (the test extra)")
    md = mdit.MarkdownIt("commonmark", {"html": False})
    return [md.render(s) for s in sources]


def shapes(tab: Page, sources: list[str]) -> list:
    """Our rendering of each source (markdown.js in the page), as SHAPE trees."""
    return tab.page.evaluate(f"""async (sources) => {{
        const {{ markdown }} = await import("/web/markdown.js");
        return sources.map((s) => {{
            const box = document.createElement("div");
            box.append(markdown(s));
            return ({SHAPE})(box, false);
        }});
    }}""", sources)


def oracle_shapes(tab: Page, html: list[str]) -> list:
    """markdown-it's HTML parsed by the page (its own, escaped output: the test's, not a reply's), as SHAPE trees."""
    return tab.page.evaluate(f"""(html) => html.map((h) => {{
        const box = document.createElement("div"); box.innerHTML = h; return ({SHAPE})(box, true); }})""", html)


def test_markdown_renders_what_commonmark_says(tab):
    """Ordinary replies render as CommonMark says (markdown-it-py's rendering, mapped to our headings and
    code blocks); links other than http(s) and mailto, and raw HTML, stay text."""
    got = shapes(tab, ORDINARY)
    want = oracle_shapes(tab, markdown_it(ORDINARY))
    for source, ours, theirs in zip(ORDINARY, got, want):
        assert ours == theirs, source
    unsafe = tab.page.evaluate("""async (sources) => {
        const { markdown } = await import("/web/markdown.js");
        const box = document.createElement("div");
        for (const s of sources) box.append(markdown(s));
        return box.querySelectorAll("img, script, a:not([href^='http'])").length;
    }""", ORDINARY)
    assert unsafe == 0


def soup(size: int, seed: int = 0) -> str:
    """`size` characters of Markdown's special characters and fragments, shuffled (seeded)."""
    rng = random.Random(seed)
    pieces = list("ab *_`[]()\\\n>-#1.+~=!<&\t") + ["http://", "](", "**", "``", "\n\n", "    ", "- ", "> ", "1. "]
    out, n = [], 0
    while n < size:
        out.append(rng.choice(pieces))
        n += len(out[-1])
    return "".join(out)


# Replies written to make a renderer slow, ~100k characters each: the old renderer's regular expressions
# took 2.2 s on the first at 2,000 backticks (cubic: hours at 50,000), and 16 s on the second at 20,000
# characters; the nested quotes overflowed its stack (a recursion per `>`). CommonMark's pathological
# cases (cmark's test/pathological_tests.py) for the rest.
HOSTILE = {
    "a backtick run after text": "a " + "`" * 50_000,
    "backtick runs of every length": "".join("e" + "`" * i for i in range(450)),
    "nested quotes": "> " * 50_000 + "a",
    "stars": "*" * 100_000,
    "emphasis openers without closers": "_a " * 33_000,
    "emphasis closers without openers": "a_ " * 33_000,
    "mismatched openers and closers": "*a_ " * 25_000,
    "openers and closers in multiples of 3": "a**b" + "c* " * 33_000,
    "nested emphasis": "*" * 50_000 + "a" + "*" * 50_000,
    "link openers": "[a" * 50_000,
    "link closers": "a]" * 50_000,
    "link openers and emphasis closers": "[ a_" * 25_000,
    "brackets and parentheses": "[ (](" * 20_000,
    "nested brackets": "[" * 50_000 + "a" + "]" * 50_000,
    "unclosed destinations": "[a](" * 25_000,
    "an unbalanced destination": "[a](http://x" + "(" * 100_000,
    "nested lists on one line": "1. " * 33_000 + "a",
    "deeply indented lists": "".join("  " * i + "* a\n" for i in range(300)),
    "an unclosed fence": "```\n" + "a\n" * 50_000,
    "fences": "```\n" * 25_000,
    "indented code then blank lines": "    a\n" + "\n" * 100_000,
    "escapes": "\\*" * 50_000,
    "hard breaks": "a  \n" * 25_000,
    "a soup of markers": soup(200_000),
}
HOSTILE_BOUND_MS = 20_000  # each takes well under 0.2 s here on an idle 2-core box; the old renderer, minutes or more


def test_hostile_markdown_renders_in_linear_time_and_stays_shallow(tab):
    """Each hostile reply renders within a bound that is ~100x what it takes (a hang guard that a quadratic
    renderer fails by orders of magnitude), keeps its text, and nests its DOM no deeper than the renderer's
    caps (16 quotes or list items, 16 emphasis or links) however deep the text nests. The page says it is
    done on the console: a wait for that times out on the test's side even while a runaway render holds
    the page, which is then stopped (CDP's Runtime.terminateExecution) so the tab can close."""
    tab.page.evaluate("async () => { window.md = await import('/web/markdown.js'); }")
    cdp = tab.context.new_cdp_session(tab.page)
    for name, source in HOSTILE.items():
        try:
            with tab.page.expect_console_message(lambda m, name=name: m.text == f"rendered {name}",
                                                 timeout=HOSTILE_BOUND_MS):
                tab.page.evaluate("""([name, source]) => setTimeout(() => {
                    const box = document.createElement("div");
                    box.append(md.markdown(source));
                    let depth = 0;
                    for (const walk = document.createTreeWalker(box, NodeFilter.SHOW_ELEMENT); walk.nextNode();) {
                        let d = 0;
                        for (let n = walk.currentNode; n !== box; n = n.parentNode) d++;
                        depth = Math.max(depth, d);
                    }
                    window.result = { depth, quotes: box.querySelectorAll("blockquote").length, text: box.textContent };
                    console.log(`rendered ${name}`);
                })""", [name, source])
        except sync_api.TimeoutError:
            cdp.send("Runtime.terminateExecution")
            pytest.fail(f"{name}: not rendered within {HOSTILE_BOUND_MS} ms")
        result = tab.page.evaluate("window.result")
        assert result["depth"] <= 40, (name, result["depth"])
        if name == "a backtick run after text":  # no closing run: the backticks are text (CommonMark)
            assert result["text"] == source
        if name == "nested quotes":
            assert result["quotes"] == 16 and result["text"].endswith("> " * 3 + "a"), name
        if name == "nested emphasis":
            assert result["text"] == "a", name  # every star pairs up; past 16 levels, without an element


def test_markdown_streamed_character_by_character_equals_the_whole(tab):
    """Each ordinary reply (and some with CRLF line endings) drawn as it grows, one character per frame,
    equals at every frame the rendering of the whole text so far (itself CommonMark's, above)."""
    sources = ORDINARY + [s.replace("\n", "\r\n") for s in ORDINARY[:8]]
    differ = tab.page.evaluate("""async (sources) => {
        const { MarkdownView, markdown } = await import("/web/markdown.js");
        const differ = [];
        for (const source of sources) {
            const box = document.createElement("div");
            const view = new MarkdownView(box);
            for (let i = 0; i < source.length; i++) {
                view.append(source[i]);
                view.render();
                const whole = document.createElement("div");
                whole.append(markdown(source.slice(0, i + 1)));
                if (box.innerHTML !== whole.innerHTML) { differ.push([source, i]); break; }
            }
        }
        return differ;
    }""", sources)
    assert differ == []


# A reply the test streams to the page, a piece per paint; every block but the last is finished at each
# paint (a later one starts on a complete line), and so are a list's items but its last.
STREAMED = [
    "## Streaming\n\nThe first para",
    "graph goes on, *with emphasis*.\n\nThe sec",
    "ond paragraph.\n\n- item one\n- item t",
    "wo\n- item three\n\n",
    "```python\nprint(1)\n",
    "print(2)\n```\n\n> a quote\n",
    "> goes on\n\nThe end.",
]

# The page's chat completions answered by the test instead of the server: window.reply.push(text) sends
# one streamed chunk, window.reply.end() ends the stream.
FAKE_STREAM = """(() => {
  const fetch = window.fetch;
  window.fetch = (url, init) => {
    if (!String(url).endsWith("/v1/chat/completions")) return fetch(url, init);
    const bytes = new TextEncoder();
    const body = new ReadableStream({ start(out) {
      const send = (data) => out.enqueue(bytes.encode(`data: ${JSON.stringify(data)}\\n\\n`));
      window.reply = {
        push: (text) => send({ choices: [{ index: 0, delta: { content: text }, finish_reason: null }] }),
        end: () => {
          send({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] });
          out.enqueue(bytes.encode("data: [DONE]\\n\\n"));
          out.close();
        },
      };
    } });
    return Promise.resolve(new Response(body, { status: 200, headers: { "Content-Type": "text/event-stream" } }));
  };
})()"""

# After a paint: the finished blocks noted at the last paint that are no longer the same node in the same
# place; then notes this paint's (every child but the last, of the reply and of its last block when that
# is a list or a quote).
MOVED = """() => {
  const content = document.querySelector("article[aria-label=Assistant] .content");
  const moved = (window.kept ?? []).filter(([node, parent, i]) => parent.children[i] !== node).map(([n]) => n.outerHTML);
  window.kept = [];
  const keep = (parent) => {
    const children = [...parent.children];
    children.slice(0, -1).forEach((node, i) => window.kept.push([node, parent, i]));
    return children.at(-1);
  };
  const last = keep(content);
  if (last?.matches("ul, ol, blockquote")) keep(last);
  return moved;
}"""


def test_a_streamed_reply_redraws_only_its_open_block(tab):
    """The page draws a streamed reply as it comes: after each piece the reply shows what the whole text so
    far renders to, and the blocks finished before are the very same DOM nodes (not rebuilt each paint)."""
    tab.context.add_init_script(FAKE_STREAM)
    tab.page.reload()
    expect(tab.page.locator("body[data-ready=true]")).to_have_count(1)
    tab.send("write something long")
    tab.page.wait_for_function("window.reply !== undefined")
    tab.page.evaluate("async () => { window.md = await import('/web/markdown.js'); }")
    shown = """(text) => {
        const whole = document.createElement("div");
        whole.append(md.markdown(text));
        return document.querySelector("article[aria-label=Assistant] .content").innerHTML === whole.innerHTML;
    }"""
    text = ""
    for piece in STREAMED:
        text += piece
        tab.page.evaluate("(piece) => window.reply.push(piece)", piece)
        tab.page.wait_for_function(shown, arg=text)  # painted
        assert tab.page.evaluate(MOVED) == [], text
    tab.page.evaluate("window.reply.end()")
    tab.wait_done()
    assert tab.conversation()[-1]["content"] == text
    assert tab.page.evaluate(shown, text)


# --- the endpoints behind "Look inside" ---

def test_attention_weights_equal_transformers(server, tiny):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="eager", dtype=torch.float32)
    messages = [{"role": "user", "content": "the capital of France"}]
    for layer, head in ((0, 1), (1, 3)):
        status, body, _ = post(server.url, {"messages": messages, "reply": "Paris is", "layer": layer, "head": head},
                               path="/v1/attention")
        assert status == 200, body
        ids = [t["id"] for t in body["tokens"]]
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_attentions=True).attentions[layer][0, head, -1].tolist()
        assert body["weights"] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("chunk", [5, 64])
def test_attention_weights_in_chunks_equal_transformers_past_the_window(hf_checkpoint, chunk):
    """The context prefilled a few tokens at a time (the server's slices), on Gemma 3's sliding
    layers (window 8, which a 30-token context outgrows) and its full one: transformers' eager
    attention weights of the last token, masked positions included (as zeros)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    import mlxinfer
    from mlxinfer.engine.inspection import attention_slices
    from mlxinfer.base.slices import run_whole

    folder = hf_checkpoint("gemma3_text", head_dim=32, num_hidden_layers=3, sliding_window=8,
                           query_pre_attn_scalar=24,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model, _ = mlxinfer.load(folder, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    ids = [(7 * i + 3) % 500 + 2 for i in range(30)]
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(3):
        got = run_whole(attention_slices(model, ids, layer, 1, chunk))
        assert got == pytest.approx(want[layer][0, 1, -1].tolist(), abs=1e-5), f"layer {layer}"


def test_attention_is_bounded_and_needs_the_key(server):
    status, body, _ = post(server.url, {"messages": [{"role": "user", "content": "hi " * 3000}]}, path="/v1/attention")
    assert status == 400 and "at most 256" in body["error"]["message"]
    status, _, _ = post(server.url, {"messages": [{"role": "user", "content": "hi"}]}, key=None, path="/v1/attention")
    assert status == 401


def test_attention_is_off_on_a_network_address_without_a_key(loaded):
    from fastapi.testclient import TestClient

    from mlxinfer.serve.engine_thread import EngineThread
    from mlxinfer.serve.inspect import attention_offered
    from mlxinfer.engine.batch import BatchGenerator
    from mlxinfer.serve.app import ServerConfig, create_app
    from mlxinfer.serve.models import Models, Served

    assert [attention_offered(h, k) for h, k in (("127.0.0.1", None), ("0.0.0.0", None), ("0.0.0.0", "k"))] == \
        [True, False, True]
    engine = EngineThread(BatchGenerator(*loaded))
    try:
        app = create_app(Models.of(Served("tiny", engine, *loaded, 64, "tiny", 0, 0.0)), ServerConfig(attention=False))
        with TestClient(app, base_url="http://127.0.0.1") as c:
            r = c.post("/v1/attention", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    finally:
        engine.stop()


def test_streamed_usage_carries_timings(server):
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps({
        "messages": [{"role": "user", "content": "what the timings say"}], "max_tokens": 6, "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    usage, timings = events[-1]["usage"], events[-1]["timings"]
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["cache_n"] + timings["prompt_n"] == usage["prompt_tokens"]
    assert timings["prompt_ms"] > 0 and timings["prompt_per_second"] > 0
    assert "timings" not in events[0]
    chunks = timings["prompt_chunks"]
    assert [c["n"] for c in chunks] == chunked(timings["prompt_n"]) and len(chunks) > 1
    assert all(c["ms"] > 0 for c in chunks)
    ends = [c["start_ms"] + c["ms"] for c in chunks]
    assert all(ends[i] <= chunks[i + 1]["start_ms"] for i in range(len(chunks) - 1))
    assert 0 <= chunks[0]["start_ms"] and ends[-1] <= timings["prompt_ms"]  # all before the first token


def test_token_ids_and_drafts_reach_the_openai_client(server, tiny):
    """vLLM's return_tokens_as_token_ids and our return_token_details through the official client,
    streamed and whole: the ids are the tokens transformers' tokenizer decodes to the plain logprobs'
    text; without the fields the wire shape is OpenAI's."""
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "a b c a b c a b"}], max_tokens=10,
               temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**ask)
    assert "token_details" not in plain.choices[0].model_extra
    texts = [t.token for t in plain.choices[0].logprobs.content]
    whole = client.chat.completions.create(**ask, extra_body={"return_tokens_as_token_ids": True,
                                                                  "return_token_details": True})
    content = whole.choices[0].logprobs.content
    ids = token_ids([t.model_dump() for t in content])
    assert [hf.decode([i]) for i in ids] == texts
    assert all(a.token.startswith("token_id:") for t in content for a in t.top_logprobs)
    details = whole.choices[0].model_extra["token_details"]
    assert [d["id"] for d in details] == ids and whole.choices[0].message.content == plain.choices[0].message.content
    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_details": True})
    streamed, last = [], None
    for chunk in stream:
        if chunk.choices:
            assert len(chunk.choices[0].model_extra["token_details"]) == len(chunk.choices[0].logprobs.content
                                                                             if chunk.choices[0].logprobs else [])
            streamed += chunk.choices[0].model_extra["token_details"]
        last = chunk
    assert [d["id"] for d in streamed] == ids
    assert sum(d["drafted"] for d in streamed) == last.model_extra["timings"]["draft_n_accepted"] > 0
    legacy = client.completions.create(model="tiny", prompt="a b c a b c", max_tokens=4, temperature=0, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in legacy.choices[0].logprobs.tokens)
    assert all(k.startswith("token_id:") for top in legacy.choices[0].logprobs.top_logprobs for k in top)


def test_no_web_serves_no_page(tiny):
    s = Server(["-m", str(tiny), "--dtype", "float32", "--no-web"])
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(s.url + "/", timeout=60)
        assert e.value.code == 404
        assert json.load(urllib.request.urlopen(s.url + "/v1/models", timeout=60))["data"]
    finally:
        s.stop()



# --- SmolLM2: real weights, a real chat template (and its default system prompt) ---

@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf, tmp_path_factory):
    from mlxinfer.convert import convert

    folder = tmp_path_factory.mktemp("smollm2") / "model"
    convert(smollm2_gguf, folder)  # into the test's own folder: nothing lands in the user's model store
    s = Server(["-m", str(folder)])
    yield s
    s.stop()


def test_smollm2_greedy_reply_and_its_tokens_equal_the_api(browser, smollm2_server):
    question = "What is the capital of France?"
    t = Page(browser, smollm2_server.url + "/")
    try:
        expect(t.page.locator("body[data-ready=true]")).to_have_count(1)  # no key: none asked for
        expect(t.page.get_by_role("heading", level=1)).to_have_text(smollm2_server.health()["model"])
        t.settings(**{"Temperature": "0", "Max tokens": "10"})
        t.send(question)
        expect(t.replies()).to_have_count(1)
        t.wait_done()
        body = api_chat(smollm2_server, question, max_tokens=10, logprobs=True, top_logprobs=5,
                        return_tokens_as_token_ids=True)
        assert t.conversation()[-1]["content"] == body["choices"][0]["message"]["content"]
        assert "Paris" in body["choices"][0]["message"]["content"]  # the real model, really answering
        want = body["choices"][0]["logprobs"]["content"]
        t.replies().last.get_by_role("button", name="Look inside").click()
        items = t.page.get_by_role("region", name="Tokens").get_by_role("list", name="Reply tokens") \
            .get_by_role("listitem")
        expect(items).to_have_count(len(want))
        assert [float(x) for x in shown(items, "logprob")] == [w["logprob"] for w in want]
        assert [int(x) for x in shown(items, "id")] == token_ids(want)
        assert t.errors == []
        assert all(u.startswith(smollm2_server.url + "/") for u in t.requests), t.requests
    finally:
        t.context.close()
