"""How long one client's stream stalls while another client sends a large or hostile body.

`mlxinfer serve` runs in a subprocess. Client A streams a long completion; once it is
decoding, client B sends each body below in turn, and every token A receives is
timestamped: the longest gap while B is in the server is compared with A's usual gap.
Bodies are read, parsed and validated on worker threads, never the event loop, and refused
past 100,000 objects and arrays, so the longest gap should stay near one decode step plus
the one C call that holds the GIL longest (`json.loads` of the body: ~0.1 s for 4 MiB).

    python benchmarks/stall_bodies.py                  # the demo model
    python benchmarks/stall_bodies.py --model PATH

Run it on an idle machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import mlxinfer  # noqa: F401  (first: it picks MLX's BLAS)
from mlxinfer.loading import load_tokenizer
from mlxinfer.store import resolve_model

from stall import free_port, load, stream_times


def send(url: str, data: bytes) -> int:
    """B: one body, its status."""
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def bodies(stored_item: str) -> list[tuple[str, str, dict]]:
    """(name, path, body) of each case; `stored_item` is an item of a stored response."""
    million = [{}] * 1_300_000  # 3.9 MB of JSON
    return [
        ("chat: a content of 1.3M {} (refused)", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": million}], "max_tokens": 1}),
        ("responses: a reasoning item of 1.3M {} (refused)", "/v1/responses",
         {"input": [{"type": "reasoning", "summary": million}, {"role": "user", "content": "hi"}],
          "max_output_tokens": 1}),
        ("responses: a reasoning item of 99k {} (stored)", "/v1/responses",
         {"input": [{"type": "reasoning", "summary": [{}] * 99_000}, {"role": "user", "content": "hi"}],
          "max_output_tokens": 1}),
        ("responses: 20k item_references", "/v1/responses",
         {"input": [{"type": "item_reference", "id": stored_item}] * 20_000 + [{"role": "user", "content": "hi"}],
          "max_output_tokens": 1}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="anything --model accepts (default: the demo model)")
    args = parser.parse_args()
    print(f"load average before: {load()}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlxinfer.cli", "serve", "--port", str(port)]
    server = subprocess.Popen(cmd + (["-m", args.model] if args.model else []), stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit("the server did not start")
                time.sleep(0.2)
        reasoning = [{"type": "reasoning", "id": f"rs_{i}", "summary": []} for i in range(20_000)]
        assert send(f"{base}/v1/responses", json.dumps(
            {"input": [*reasoning, {"role": "user", "content": "hi"}], "max_output_tokens": 1}).encode()) == 200
        no_end = {str(t): -100 for t in load_tokenizer(resolve_model(args.model)).eos_token_ids}  # A must outlast B
        for name, path, body in bodies("rs_19999"):
            data = json.dumps(body, separators=(",", ":")).encode()
            times: list[float] = []
            stop = threading.Event()
            a = threading.Thread(target=stream_times, args=(f"{base}/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 100_000, "temperature": 0, "logit_bias": no_end},
                times, stop))
            a.start()
            while len(times) < 20:
                time.sleep(0.01)
            sent = time.perf_counter()
            status = send(base + path, data)
            done = time.perf_counter()
            seen = len(times)
            while len(times) == seen and a.is_alive():  # A's next token closes the gap that spans B's end
                time.sleep(0.01)
            ended = len(times) == seen
            stop.set()
            a.join()
            if ended:
                sys.exit("A ended before B was answered: nothing measured (try another --model)")
            before = [y - x for x, y in zip(times, times[1:]) if y < sent]
            during = [y - x for x, y in zip(times, times[1:]) if y > sent and x < done]
            print(f"{name}: {len(data) / 1e6:.1f} MB, {status} in {done - sent:.2f} s; A's median gap "
                  f"{statistics.median(before) * 1000:.1f} ms before, longest {max(during) * 1000:.0f} ms while B "
                  "was in the server")
    finally:
        server.terminate()
        server.wait(30)
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
