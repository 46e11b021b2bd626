"""How long one client's stream stalls while another client's long prompt is prefilled.

`mlxinfer serve` runs in a subprocess. Client A streams a long completion; once it is
decoding, client B sends an ~8,000-token prompt. Every token A receives is timestamped: the
longest gap while B is in the server is compared with A's usual gap before B came, and with
one step's share of B's prefill (B's time in the server over the number of `prefill_step`
chunks its prompt needs). The engine prefills one chunk between decode steps, and renders,
tokenizes and compiles requests on other threads, so the longest gap should be about one
chunk plus one decode step, not B's whole prefill.

    python benchmarks/stall.py                       # the demo model (SmolLM2-135M, 8K context)
    python benchmarks/stall.py --model PATH --prompt-tokens 8000

Run it on an idle machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import mlxinfer  # noqa: F401  (first: it picks MLX's BLAS)
from mlxinfer.loading import load_tokenizer
from mlxinfer.store import resolve_model

PREFILL_STEP = 512  # the engine's default chunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def post(url: str, body: dict, timeout: float = 600):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def stream_times(url: str, body: dict, times: list[float], stop: threading.Event) -> None:
    """Client A: the arrival time of every streamed token, until `stop`."""
    with post(url, {**body, "stream": True}) as r:
        for line in r:
            if stop.is_set() or line.strip() == b"data: [DONE]":
                return
            if line.startswith(b"data: "):
                times.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="anything --model accepts (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    args = parser.parse_args()
    print(f"load average before: {load()}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlxinfer.cli", "serve", "--port", str(port)]
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
        # B's prompt: plain words, about one token each; its real length comes back in usage
        words = ("river stone light cloud garden paper window music silver forest " * (args.prompt_tokens // 10 + 1))
        long_prompt = " ".join(words.split()[: args.prompt_tokens])
        post(f"{base}/v1/completions", {"prompt": "warm up", "max_tokens": 4}).read()
        times: list[float] = []
        stop = threading.Event()
        no_end = {str(t): -100 for t in load_tokenizer(resolve_model(args.model)).eos_token_ids}  # A must outlast B
        a = threading.Thread(target=stream_times, args=(f"{base}/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "logit_bias": no_end}, times, stop))
        a.start()
        while len(times) < 40:
            time.sleep(0.01)
        sent = time.perf_counter()
        reply = json.load(post(f"{base}/v1/completions", {"prompt": long_prompt, "max_tokens": 1}))
        done = time.perf_counter()
        if not a.is_alive():
            sys.exit("A ended before B was answered: nothing measured (try another --model)")
        stop.set()
        a.join()
        before = [b - a for a, b in zip(times, times[1:]) if b < sent]
        during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < done]
        n = reply["usage"]["prompt_tokens"]
        chunks = math.ceil(n / PREFILL_STEP)
        per_chunk = (done - sent) / chunks
        print(f"B: {n} prompt tokens in {done - sent:.2f} s ({chunks} chunks of {PREFILL_STEP}: "
              f"{per_chunk * 1000:.0f} ms per chunk and step)")
        print(f"A: median gap {statistics.median(before) * 1000:.1f} ms before B; while B was in the server "
              f"{len(during)} tokens, longest gap {max(during) * 1000:.0f} ms "
              f"= {max(during) / per_chunk:.2f}x one chunk's step")
    finally:
        server.terminate()
        server.wait(30)
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
