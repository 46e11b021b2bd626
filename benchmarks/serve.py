"""HTTP serving: `mlxinfer serve` vs `mlx_lm.server` at 1, 4 and 8 concurrent streaming clients.

    python benchmarks/serve.py                          # ~58M float32 Llama (random weights)
    python benchmarks/serve.py --models llama,smollm2   # and SmolLM2-135M 4-bit, if its GGUF is found
    python benchmarks/serve.py --max-tokens 128 --repeat 5 --clients 1,4,8 --json

Both servers run as subprocesses on free 127.0.0.1 ports, loading the same folder, and stay
up for the whole run; they are driven by the same client code, alternately (who goes first
swaps every repeat). Each client sends one streamed text completion (`/v1/completions`,
model "default_model": mlx-lm's name for the model it was started with, while ours serves its
one model whatever the name; greedy, `max_tokens` tokens, `stream_options.include_usage`)
with its own random prompt of
`--prompt-tokens` words — the same prompts for both servers — over `http.client` in its own
thread; all clients of a run start together. Completion tokens are counted from the final
usage event (content events where a server sends none).

Per run: aggregate tok/s = completion tokens of all clients / (last token received − first
request sent); TTFT = a client's first content event − its send; a client's decode tok/s =
(tokens − 1) / (its last − its first content event). The table shows medians over the repeats
(TTFT: over every client of every repeat). The in-process line runs `mlxinfer.stream_generate`
on the first prompt, greedy, EOS ignored, timed the same way from its chunks, before the
servers start.

Targets: ours at 1 client ≥ 0.95× in-process decode; ours at 8 clients ≥ 3× ours at 1
(aggregate); ours ≥ 1.0× mlx_lm.server at 1 and at 8 clients (aggregate). Default run ~2
minutes on 2 cores. On Linux install OpenBLAS first (see README).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.blas)
from batch import convert_smollm2, smollm2_source  # noqa: E402, I001
from compare_mlx_lm import build_llama_50m  # noqa: E402
from mlxinfer.bench import random_prompt  # noqa: E402
from mlxinfer.tokenizer import load_tokenizer_from_dir  # noqa: E402

TARGET_HTTP_VS_IN_PROCESS = 0.95
TARGET_SCALING = 3.0
TARGET_VS_MLX_LM = 1.0
START_SECONDS = 180


@dataclass
class Stream:
    """What one client saw."""

    sent: float
    first: float
    last: float
    tokens: int
    events: int

    @property
    def decode_tps(self) -> float:
        return (self.events - 1) / max(self.last - self.first, 1e-9)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on a free loopback port; `up` is False (with `why`) if it did not start."""

    def __init__(self, name: str, command: list[str], ready_path: str):
        self.name, self.port = name, free_port()
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.up, self.why = self._wait(ready_path), ""

    def _wait(self, path: str) -> bool:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = (self.proc.stderr.read() or "no output").strip().splitlines()
                self.why = lines[-1] if lines else "no output"
                return False
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2)
                return True
            except OSError:
                time.sleep(0.2)
        self.why = f"not ready after {START_SECONDS} s"
        return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ours(path: Path, max_batch: int) -> Server:
    return Server("mlxinfer", [sys.executable, "-m", "mlxinfer.cli", "serve", "-m", str(path),
                               "--max-concurrency", str(max_batch)], "/health")


def mlx_lm(path: Path, max_batch: int) -> Server:
    return Server("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", str(path),
                                    "--decode-concurrency", str(max_batch), "--log-level", "WARNING"], "/v1/models")


def stream(port: int, prompt: str, max_tokens: int) -> Stream:
    body = json.dumps({"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = last = 0.0
    events, usage = 0, None
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event.get("choices") or []):
            last = time.perf_counter()
            first = first or last
            events += 1
    conn.close()
    return Stream(sent, first, last, usage if usage is not None else events, events)


def load(server: Server, prompts: list[str], max_tokens: int) -> list[Stream]:
    """All clients at once, one thread each."""
    results: list[Stream | Exception] = [RuntimeError("no reply")] * len(prompts)

    def client(i: int) -> None:
        try:
            results[i] = stream(server.port, prompts[i], max_tokens)
        except Exception as e:  # noqa: BLE001 - reported below with the server's name
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{server.name}: {failed[0]}")
    return results  # type: ignore[return-value]


def aggregate(streams: list[Stream]) -> float:
    return sum(s.tokens for s in streams) / max(max(s.last for s in streams) - min(s.sent for s in streams), 1e-9)


def in_process(path: Path, prompt: str, max_tokens: int, repeat: int) -> float:
    """Median decode tok/s of `stream_generate`, timed from its chunks as the clients time theirs."""
    model, tokenizer = mlxinfer.load(path)
    rates = []
    for _ in range(repeat + 1):  # the first run warms up
        stamps = [time.perf_counter() for c in mlxinfer.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if c.text]
        rates.append((len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9))
    del model
    gc.collect()
    return statistics.median(rates[1:])


def prompts_for(path: Path, n: int, length: int) -> list[str]:
    tokenizer = load_tokenizer_from_dir(path)
    return [tokenizer.decode(random_prompt(tokenizer.vocab_size, length, seed=i)) for i in range(n)]


def bench_model(name: str, path: Path, clients: list[int], prompt_tokens: int, max_tokens: int,
                repeat: int) -> dict:
    prompts = prompts_for(path, max(clients), prompt_tokens)
    result: dict = {"model": name, "in_process_tps": in_process(path, prompts[0], max_tokens, repeat), "rows": []}
    servers = [ours(path, max(clients)), mlx_lm(path, max(clients))]
    try:
        down = [s for s in servers if not s.up]
        for s in down:
            print(f"{name}: {s.name} did not start: {s.why}")
        if down:
            return result
        for s in servers:  # warm up: compile, allocate
            load(s, prompts[: max(clients)], 8)
        runs: dict[tuple[str, int], list[list[Stream]]] = {(s.name, c): [] for s in servers for c in clients}
        for r in range(repeat):
            for c in clients:
                for s in servers if r % 2 == 0 else servers[::-1]:
                    runs[(s.name, c)].append(load(s, prompts[:c], max_tokens))
        for c in clients:
            row = {"clients": c}
            for s in servers:
                got = runs[(s.name, c)]
                key = "ours" if s is servers[0] else "mlx_lm"
                row[f"{key}_tps"] = statistics.median(aggregate(x) for x in got)
                row[f"{key}_ttft_ms"] = 1000 * statistics.median(st.first - st.sent for x in got for st in x)
                row[f"{key}_decode_tps"] = statistics.median(st.decode_tps for x in got for st in x)
                row[f"{key}_tokens"] = sum(st.tokens for st in got[0])
            result["rows"].append(row)
    finally:
        for s in servers:
            s.stop()
    return result


def report(result: dict, max_tokens: int, prompt_tokens: int, repeat: int) -> None:
    print(f"\n{result['model']}: {prompt_tokens}-word prompts, {max_tokens} tokens each, greedy, median of {repeat}")
    print(f"  in-process stream_generate decode: {result['in_process_tps']:.1f} tok/s")
    rows = result["rows"]
    if not rows:
        return
    print(f"  {'clients':>7} | {'ours tok/s':>10} {'TTFT ms':>8} | {'mlx_lm tok/s':>12} {'TTFT ms':>8} | "
          f"{'ratio':>5} | {'scaling':>7}")
    one = rows[0]["ours_tps"]
    for row in rows:
        print(f"  {row['clients']:>7} | {row['ours_tps']:>10.1f} {row['ours_ttft_ms']:>8.0f} | "
              f"{row['mlx_lm_tps']:>12.1f} {row['mlx_lm_ttft_ms']:>8.0f} | "
              f"{row['ours_tps'] / row['mlx_lm_tps']:>5.2f} | {row['ours_tps'] / one:>6.2f}x")
        if row["ours_tokens"] != row["mlx_lm_tokens"]:
            print(f"  warning: {row['clients']} clients got {row['ours_tokens']} tokens from us and "
                  f"{row['mlx_lm_tokens']} from mlx_lm.server (EOS reached early?)")
    by = {row["clients"]: row for row in rows}

    def target(what: str, value: float, goal: float) -> None:
        print(f"  {'pass' if value >= goal else 'MISS'}: {what} {value:.2f} (target >= {goal})")

    if 1 in by:
        target("1 client through HTTP / in-process (decode tok/s)", by[1]["ours_decode_tps"] / result["in_process_tps"],
               TARGET_HTTP_VS_IN_PROCESS)
        target("ours vs mlx_lm.server at 1 client", by[1]["ours_tps"] / by[1]["mlx_lm_tps"], TARGET_VS_MLX_LM)
    if 1 in by and 8 in by:
        target("ours 8 clients / 1 client (aggregate)", by[8]["ours_tps"] / by[1]["ours_tps"], TARGET_SCALING)
    if 8 in by:
        target("ours vs mlx_lm.server at 8 clients", by[8]["ours_tps"] / by[8]["mlx_lm_tps"], TARGET_VS_MLX_LM)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama", help="comma-separated subset of llama,smollm2")
    ap.add_argument("--smollm2", help="SmolLM2-135M Hugging Face folder or .gguf (default: the test-asset cache)")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    clients = sorted({int(c) for c in args.clients.split(",")})
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        wanted = args.models.split(",")
        if "llama" in wanted:
            path = build_llama_50m(Path(tmp) / "llama")
            results.append(bench_model("Llama ~58M float32", path, clients, args.prompt_tokens, args.max_tokens,
                                       args.repeat))
        if "smollm2" in wanted:
            source = smollm2_source(args.smollm2)
            if source is None:
                print("SmolLM2-135M skipped: no checkpoint; pass --smollm2 PATH")
            else:
                path = convert_smollm2(source, Path(tmp) / "smollm2")
                results.append(bench_model("SmolLM2-135M 4-bit", path, clients, args.prompt_tokens,
                                           args.max_tokens, args.repeat))
    if args.json:
        print(json.dumps(results))
        return
    for result in results:
        report(result, args.max_tokens, args.prompt_tokens, args.repeat)


if __name__ == "__main__":
    main()
