"""How long one client's stream stalls while another client asks for heavy work.

`mlxinfer serve` runs in a subprocess. Client A streams a long completion; once it is
decoding, client B sends one heavy request (a case below). Every token A receives is
timestamped: the longest gap while B is in the server is compared with A's usual gap before
B came, and with one step's share of a long prompt's prefill (a first case, `prefill`, sends
a long prompt and divides its time in the server by the number of `prefill_step`
chunks it needs). The engine prefills one chunk between decode steps; inspection and
embeddings run on the engine thread a chunk at a time between steps; rendering, tokenizing,
parsing (bodies are refused past 100,000 objects and arrays) and compiling run on other
threads without holding the GIL for long. So every
longest gap should be about one chunk plus one decode step, not B's whole work.

Cases (`--cases`, default all):
- prefill: B completes a --prompt-tokens prompt (2,048 by default; the reference: one chunk's step).
- inspect, attention: B asks /v1/inspect over ~2,000 tokens of chat, /v1/attention over ~600.
- embed-long, embed-many: B embeds one ~1,000-token text; 8 texts of ~500 tokens.
- score: B scores 4 prompts of ~500 tokens (echo, logprobs 5, max_tokens 0).
- tokenize, detokenize: B tokenizes ~4 MB of text with pieces; detokenizes 600,000 ids.
- chat-objects, reasoning-objects: B sends 3.9 MB of `{}` as a chat message's content, or as a
  Responses reasoning item (refused: over 100,000 objects and arrays).
- reasoning-99k: a reasoning item of 99,000 `{}` (answered, and stored).
- references: 20,000 `item_reference`s to an item of a stored response.
- choices: B asks for n=16 long choices, then A starts: A's time to its first token (the
  server runs 8 sequences; fair admission gives A a slot within a step or two).

    python benchmarks/stall.py                       # the demo model (SmolLM2-135M, 8K context)
    python benchmarks/stall.py --model PATH --cases prefill,inspect

Run it on an idle machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import mlxinfer  # noqa: F401  (first: it picks MLX's BLAS)
from fixtures import free_port, load_average
from mlxinfer.loading.model import load_tokenizer
from mlxinfer.cli.store import resolve_model

PREFILL_STEP = 512  # the engine's default chunk
WORDS = "river stone light cloud garden paper window music silver forest "


def post(url: str, body: dict, timeout: float = 900):
    data = json.dumps(body, separators=(",", ":")).encode()
    return urllib.request.urlopen(urllib.request.Request(url, data, {"Content-Type": "application/json"}),
                                  timeout=timeout)


def send(url: str, body: dict) -> tuple[int, bytes]:
    """B: one request; its status and answer (a refusal too)."""
    try:
        with post(url, body) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def words(n: int) -> str:
    """About n tokens of plain words (about one token each)."""
    return " ".join((WORDS * (n // 10 + 1)).split()[:n])


class Stream:
    """Client A: a long greedy completion whose every token's arrival time is kept."""

    def __init__(self, base: str, no_end: dict[str, int]):
        self.times: list[float] = []
        self.stop = threading.Event()
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "logit_bias": no_end,
                "stream": True}
        self.thread = threading.Thread(target=self._read, args=(f"{base}/v1/completions", body), daemon=True)
        self.started = time.perf_counter()
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        with post(url, body) as r:
            for line in r:
                if self.stop.is_set() or line.strip() == b"data: [DONE]":
                    return
                if line.startswith(b"data: "):
                    self.times.append(time.perf_counter())

    def wait_tokens(self, n: int) -> None:
        while len(self.times) < n and self.thread.is_alive():
            time.sleep(0.01)

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


def cases(tokenizer, prompt_tokens: int) -> dict[str, tuple[str, Callable[[], dict[str, Any]]]]:
    """Each case's (path, body maker)."""
    chat = [{"role": "user", "content": words(1990)}]
    objects = [{}] * 1_300_000  # 3.9 MB of JSON
    hi = {"role": "user", "content": "hi"}
    mid = [{"role": "user", "content": words(600)}]
    ids = tokenizer.encode(words(20000), False)
    return {
        "prefill": ("/v1/completions", lambda: {"prompt": words(prompt_tokens), "max_tokens": 1}),
        "inspect": ("/v1/inspect", lambda: {"messages": chat}),
        "attention": ("/v1/attention", lambda: {"messages": mid, "layer": 0, "head": 0}),
        "embed-long": ("/v1/embeddings", lambda: {"input": words(1000)}),
        "embed-many": ("/v1/embeddings", lambda: {"input": [f"{i} {words(500)}" for i in range(8)]}),
        "score": ("/v1/completions", lambda: {"prompt": [f"{i} {words(500)}" for i in range(4)], "echo": True,
                                              "logprobs": 5, "max_tokens": 0}),
        "tokenize": ("/tokenize", lambda: {"content": words(700_000)[: 4_000_000], "with_pieces": True}),
        "detokenize": ("/detokenize", lambda: {"tokens": (ids * (600_000 // len(ids) + 1))[:600_000]}),
        "chat-objects": ("/v1/chat/completions", lambda: {"messages": [{"role": "user", "content": objects}],
                                                          "max_tokens": 1}),
        "reasoning-objects": ("/v1/responses", lambda: {"input": [{"type": "reasoning", "summary": objects}, hi],
                                                        "max_output_tokens": 1}),
        "reasoning-99k": ("/v1/responses", lambda: {"input": [{"type": "reasoning", "summary": [{}] * 99_000}, hi],
                                                    "max_output_tokens": 1}),
        "references": ("/v1/responses", lambda: {"input": [{"type": "item_reference", "id": "rs_19999"}] * 20_000
                                                 + [hi], "max_output_tokens": 1}),
    }


def gaps(stream: Stream, sent: float, done: float) -> tuple[float, float, int]:
    """A's median gap before B was sent, its longest gap while B was in the server, and how many
    tokens it got meanwhile."""
    t = stream.times
    before = [b - a for a, b in zip(t, t[1:]) if b < sent]
    during = [b - a for a, b in zip(t, t[1:]) if b > sent and a < done]
    # a gap still open when B was answered counts up to then
    last = max((x for x in t if x < done), default=sent)
    during.append(done - last)
    return statistics.median(before), max(during), sum(sent < x < done for x in t)


def run_case(base: str, name: str, path: str, body: dict, no_end: dict[str, int]) -> dict[str, Any]:
    stream = Stream(base, no_end)
    stream.wait_tokens(40)
    sent = time.perf_counter()
    status, reply = send(base + path, body)
    done = time.perf_counter()
    alive = stream.thread.is_alive()
    stream.end()
    if not alive:
        sys.exit(f"{name}: A ended before B was answered: nothing measured (try another --model)")
    median, longest, tokens = gaps(stream, sent, done)
    return {"case": name, "status": status, "seconds": done - sent, "median_gap": median, "longest_gap": longest,
            "tokens": tokens, "reply": reply}


def choices_case(base: str, no_end: dict[str, int]) -> dict[str, Any]:
    """B's n=16 long choices take the server's slots first; A's time to its first token."""
    b = threading.Thread(target=lambda: post(f"{base}/v1/completions", {
        "prompt": "Once upon a time", "n": 16, "max_tokens": 600, "temperature": 0.7, "logit_bias": no_end}).read(),
        daemon=True)
    b.start()
    while json.load(urllib.request.urlopen(f"{base}/health"))["active"] < 8:
        time.sleep(0.05)
    stream = Stream(base, no_end)
    stream.wait_tokens(1)
    first = stream.times[0] - stream.started if stream.times else math.inf
    stream.end()
    b.join()
    return {"case": "choices", "first_token": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="anything --model accepts (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="the prefill case's prompt")
    parser.add_argument("--cases", default="prefill,inspect,attention,embed-long,embed-many,score,tokenize,"
                                           "detokenize,chat-objects,reasoning-objects,reasoning-99k,references,"
                                           "choices")
    args = parser.parse_args()
    wanted = args.cases.split(",")
    print(f"load average before: {load_average()}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlxinfer", "serve", "--port", str(port)]
    server = subprocess.Popen(cmd + (["-m", args.model] if args.model else []), stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:  # ready when it says where it serves
            if line.startswith("serving "):
                print(line.strip())
                break
        else:
            sys.exit("the server did not start")
        threading.Thread(target=lambda: server.stderr.read(), daemon=True).start()
        while True:  # the banner comes just before it listens
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.1)
        tokenizer = load_tokenizer(resolve_model(args.model))
        post(f"{base}/v1/completions", {"prompt": "warm up", "max_tokens": 4}).read()
        # a stored response with 20,000 items, for the references case
        post(f"{base}/v1/responses", {"input": [*({"type": "reasoning", "id": f"rs_{i}", "summary": []}
                                                   for i in range(20_000)), {"role": "user", "content": "hi"}],
                                      "max_output_tokens": 1}).read()
        no_end = {str(t): -100 for t in tokenizer.eos_token_ids}  # A must outlast B
        every = cases(tokenizer, args.prompt_tokens)
        per_chunk = None
        if "prefill" in wanted:
            path, body = every["prefill"]
            r = run_case(base, "prefill", path, body(), no_end)
            n = json.loads(r["reply"])["usage"]["prompt_tokens"]
            chunks = math.ceil(n / PREFILL_STEP)
            per_chunk = r["seconds"] / chunks
            print(f"prefill: B's {n} prompt tokens in {r['seconds']:.2f} s ({chunks} chunks of {PREFILL_STEP}: "
                  f"{per_chunk * 1000:.0f} ms per chunk and step)")
        print(f"{'case':<18} {'B':>4} {'B s':>8} {'A median gap ms':>16} {'A longest gap ms':>17} "
              f"{'x one chunk':>12} {'A tokens':>9}")
        for name in wanted:
            if name == "prefill":
                continue
            if name == "choices":
                r = choices_case(base, no_end)
                print(f"choices: A's first token {r['first_token']:.2f} s after it was sent, while 16 choices ran")
                continue
            path, body = every[name]
            r = run_case(base, name, path, body(), no_end)
            ratio = f"{r['longest_gap'] / per_chunk:.2f}" if per_chunk else "-"
            print(f"{name:<18} {r['status']:>4} {r['seconds']:>8.2f} {r['median_gap'] * 1000:>16.1f} "
                  f"{r['longest_gap'] * 1000:>17.0f} {ratio:>12} {r['tokens']:>9}")
    finally:
        server.terminate()
        server.wait(30)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
