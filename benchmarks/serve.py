"""HTTP serving: `mlxinfer serve` vs `mlx_lm.server` at 1, 4 and 8 concurrent streaming clients.

    python benchmarks/serve.py                          # ~58M float32 Llama (random weights), ~1-2 minutes
    python benchmarks/serve.py --smollm2 PATH           # and SmolLM2-135M 4-bit (HF folder or .gguf), ~5 more
    python benchmarks/serve.py --models llama,smollm2   # SmolLM2 from the test-asset cache, if it is there
    python benchmarks/serve.py --max-tokens 128 --repeat 5 --clients 1,4,8 --json
    python benchmarks/serve.py --max-tokens 16 --clients 1,2 --repeat 1   # a quick check that it runs

Method. Both servers run as subprocesses on free 127.0.0.1 ports and load the same folder
on the same BLAS (the one `import mlxinfer` binds here, given to both as LD_PRELOAD, as
batch.py's mlx-lm shares it in one process). Each decodes up to max(--clients) requests
together (ours: `--max-concurrency`, mlx-lm: `--decode-concurrency`). One starts, then the
other; both stay up for the whole run, driven by the same client code alternately (who
goes first swaps every repeat), so drift in machine load hits both. Each is warmed first
with max(--clients) concurrent 8-token requests: mlx-lm's /health answers before its model
has loaded, and both allocate their batch shapes.

A run of N clients is N threads started together, each sending one streamed text
completion (`/v1/completions` over `http.client`; model "default_model", mlx-lm's name for
the model it was started with, while ours serves its one model whatever the name;
temperature 0, `--max-tokens`, `stream_options.include_usage`). The prompts are
`--prompt-tokens` random token ids, drawn among ids whose text encodes back to themselves,
decoded to text: distinct for every client of every run and the same for both servers, so
neither server's prompt cache can answer from an earlier request (the usage events'
cached-token counts are checked to be 0, and their prompt-token counts to agree). The
Llama has random weights, so EOS is unlikely; completion tokens are counted from the final
usage event (content events where a server sends none), and a line warns when the two
servers' counts differ (SmolLM2 may stop early at EOS).

Per run: aggregate tok/s = completion tokens of all clients / (the last stream's end − the
first send); TTFT = a client's first non-empty content event − its send; a client's decode
tok/s = (content events − 1) / (its last − its first content event). The table shows
medians over the repeats (TTFT and decode: over every client of every repeat). The
in-process line runs `mlxinfer.stream_generate` on the first run's first prompt, greedy,
`ignore_eos=True`, the same `--max-tokens`, timed from its chunks the way the clients time
theirs (decode tok/s), median of --repeat after one warm-up, before the servers start. The
two servers' greedy texts are compared request by request (whitespace-normalised) as a
sanity line.

Targets (pass/MISS lines): ours at 1 client ≥ 0.95× in-process (decode tok/s: the server's
cost per token); ours at 8 clients ≥ 3× ours at 1 (aggregate); ours ≥ 1.0× mlx_lm.server
at 1 and at 8 clients (aggregate). A server that does not start, or a request that fails,
gives one line saying why and the model's comparison is skipped. On Linux install OpenBLAS
first (see README).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
from fixtures import build_llama_50m, convert_smollm2, free_port, smollm2_source, stop_process  # noqa: E402, I001
from mlxinfer.base import blas  # noqa: E402
from mlxinfer.cli.bench import random_prompt  # noqa: E402
from mlxinfer.text.tokenizer import load_tokenizer_from_dir  # noqa: E402

TARGET_HTTP_VS_IN_PROCESS = 0.95  # ours at 1 client, decode tok/s
TARGET_SCALING = 3.0  # ours at 8 clients / ours at 1, aggregate
TARGET_VS_MLX_LM = 1.0  # at 1 and at 8 clients, aggregate
START_SECONDS = 180  # a server not answering its readiness path by then counts as not started
REQUEST_SECONDS = 600  # socket timeout of one client: a stuck server ends the run instead of hanging it
WARM_TOKENS = 8
ACCESS_LOG = re.compile(r'\S+ - \S+ \[[^]]*\] "')  # http.server's request lines in mlx-lm's stderr
OURS, THEIRS = "mlxinfer", "mlx_lm.server"


@dataclass(frozen=True)
class Stream:
    """What one client saw of its request (perf_counter stamps)."""

    sent: float
    first: float  # first non-empty content event
    last: float  # last non-empty content event
    done: float  # end of the stream ([DONE] or the connection closing)
    events: int  # non-empty content events
    tokens: int  # completion tokens: the usage event's count, else `events`
    prompt_tokens: int | None
    cached_tokens: int
    text: str

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def decode_tps(self) -> float:
        return (self.events - 1) / max(self.last - self.first, 1e-9)


class Server:
    """A server subprocess on a free loopback port, its stderr in a temporary file (a pipe
    nobody reads could fill and stall it). `why` is None once it answers `ready_path`,
    else the reason it did not start."""

    def __init__(self, name: str, command: list[str], ready_path: str, log: IO[str]):
        self.name, self.port, self.log = name, free_port(), log
        self.proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, text=True,
                                     env=server_env())
        try:
            self.why = self._wait(ready_path)
        except BaseException:  # Ctrl-C while it loads: leave no server behind
            self.stop()
            raise

    def _wait(self, path: str) -> str | None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with status {self.proc.returncode}: {self.last_line()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2):
                    return None
            except urllib.error.HTTPError as e:  # up but unwell: mlx-lm's model load failed
                return f"{path} answered HTTP {e.code}: {self.last_line()}"
            except OSError:
                time.sleep(0.2)
        return f"not ready after {START_SECONDS} s: {self.last_line()}"

    def last_line(self) -> str:
        """Its stderr's last line naming an error (a traceback's last line), else its last
        line, leaving out HTTP access-log lines (mlx-lm prints warnings after a failed load)."""
        self.log.flush()
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().splitlines()
                 if line.strip() and not ACCESS_LOG.match(line)]
        errors = [line for line in lines if "error" in line.lower()]
        return (errors or lines or ["no output"])[-1]

    def stop(self) -> None:
        stop_process(self.proc)


def server_env() -> dict[str, str]:
    """This process's environment with the BLAS `import mlxinfer` bound preloaded: mlx-lm
    would otherwise run its prefill matmuls on MLX's reference BLAS (see mlxinfer.base.blas)."""
    env = dict(os.environ)
    if blas.STATE.library:
        env["LD_PRELOAD"] = " ".join(filter(None, [blas.STATE.library, env.get("LD_PRELOAD")]))
    return env


def start(name: str, path: Path, max_batch: int, log: IO[str]) -> Server:
    python = sys.executable
    if name == OURS:
        return Server(name, [python, "-m", "mlxinfer", "serve", "-m", str(path),
                             "--max-concurrency", str(max_batch)], "/health", log)
    return Server(name, [python, "-m", "mlx_lm", "server", "--model", str(path), "--decode-concurrency",
                         str(max_batch), "--log-level", "WARNING"], "/health", log)


def stream(port: int, prompt: str, max_tokens: int) -> Stream:
    """One streamed text completion, read event by event."""
    body = json.dumps({"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_SECONDS)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first = last = 0.0
        events, usage, parts = 0, None, []
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            usage = event.get("usage") or usage
            text = "".join(c.get("text") or "" for c in event.get("choices") or [])
            if text:
                last = time.perf_counter()
                first = first or last
                events += 1
                parts.append(text)
        done = time.perf_counter()
    finally:
        conn.close()
    if not events:
        raise RuntimeError("the stream had no content")
    details = (usage or {}).get("prompt_tokens_details") or {}
    return Stream(sent, first, last, done, events, usage["completion_tokens"] if usage else events,
                  usage.get("prompt_tokens") if usage else None, details.get("cached_tokens") or 0, "".join(parts))


def load(server: Server, prompts: list[str], max_tokens: int) -> list[Stream]:
    """All clients at once, one thread each; the first failure is raised with the server's name."""
    results: list[Stream | BaseException] = [RuntimeError("no reply")] * len(prompts)

    def client(i: int) -> None:
        try:
            results[i] = stream(server.port, prompts[i], max_tokens)
        except Exception as e:  # noqa: BLE001 - re-raised below, after every thread has ended
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{server.name}: a request failed: {failed[0]} (its last log line: {server.last_line()})")
    return results  # type: ignore[return-value]


def aggregate(streams: list[Stream]) -> float:
    return sum(s.tokens for s in streams) / max(max(s.done for s in streams) - min(s.sent for s in streams), 1e-9)


def in_process(path: Path, prompt: str, max_tokens: int, repeat: int) -> float:
    """Median decode tok/s of `stream_generate`, timed from its chunks as the clients time theirs."""
    model, tokenizer = mlxinfer.load(path)
    rates = []
    for _ in range(repeat + 1):  # the first run warms up
        stamps = [time.perf_counter() for c in mlxinfer.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if c.text]
        rates.append((len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9))
    del model, tokenizer
    gc.collect()
    return statistics.median(rates[1:])


class Prompts:
    """Random-token prompts as text: run `r`'s client `i` always gets the same one, and no
    two (run, client) pairs share one. Only ids whose text encodes back to themselves are
    drawn, so a prompt is `length` tokens on both servers: the test Llama's word-level
    vocabulary would otherwise split "t16684" into the special "t1" (EOS) and an unknown."""

    def __init__(self, path: Path, length: int):
        self.tokenizer = load_tokenizer_from_dir(path)
        self.length = length
        self._clean: dict[int, bool] = {}

    def _is_clean(self, token: int) -> bool:
        if token not in self._clean:
            self._clean[token] = self.tokenizer.encode(self.tokenizer.decode([token])) == [token]
        return self._clean[token]

    def run(self, run: int, n: int) -> list[str]:
        prompts = []
        for i in range(n):
            drawn = random_prompt(self.tokenizer.vocab_size, 8 * self.length, seed=1000 * run + i)
            clean = [t for t in drawn if self._is_clean(t)][: self.length]
            if len(clean) < self.length:
                raise RuntimeError(f"too few token ids of this vocabulary encode back to themselves for a "
                                   f"{self.length}-token prompt; pass a smaller --prompt-tokens")
            prompts.append(self.tokenizer.decode(clean))
        return prompts


@dataclass
class Row:
    """One client count's runs, by server."""

    clients: int
    runs: dict[str, list[list[Stream]]] = field(default_factory=lambda: {OURS: [], THEIRS: []})

    def summary(self) -> dict:
        row: dict = {"clients": self.clients}
        for name, key in ((OURS, "ours"), (THEIRS, "mlx_lm")):
            runs = self.runs[name]
            streams = [s for run in runs for s in run]
            row[f"{key}_tps"] = statistics.median(aggregate(run) for run in runs)
            row[f"{key}_ttft_ms"] = 1000 * statistics.median(s.ttft for s in streams)
            row[f"{key}_decode_tps"] = statistics.median(s.decode_tps for s in streams)
            row[f"{key}_tokens"] = sum(s.tokens for s in streams)
            row[f"{key}_prompt_tokens"] = sorted({s.prompt_tokens for s in streams}, key=str)
            row[f"{key}_cached_tokens"] = sum(s.cached_tokens for s in streams)
        pairs = [(a, b) for x, y in zip(self.runs[OURS], self.runs[THEIRS]) for a, b in zip(x, y)]
        row["same_text"] = sum(a.text.split() == b.text.split() for a, b in pairs)
        row["requests"] = len(pairs)
        row["ratio"] = row["ours_tps"] / row["mlx_lm_tps"]
        return row


def drive(servers: dict[str, Server], prompts: Prompts, clients: list[int], max_tokens: int,
          repeat: int) -> list[Row]:
    """Warm both servers, then every client count `repeat` times on each, alternating."""
    rows = [Row(c) for c in clients]
    for i, server in enumerate(servers.values()):  # run numbers past the timed ones: prompts of their own
        load(server, prompts.run(repeat * len(rows) + i, max(clients)), WARM_TOKENS)
    order = list(servers)
    for r in range(repeat):
        for k, row in enumerate(rows):
            batch = prompts.run(r * len(rows) + k, row.clients)
            for name in order if r % 2 == 0 else order[::-1]:
                row.runs[name].append(load(servers[name], batch, max_tokens))
    return rows


def bench_model(name: str, path: Path, clients: list[int], prompt_tokens: int, max_tokens: int,
                repeat: int) -> dict:
    prompts = Prompts(path, prompt_tokens)
    result: dict = {"model": name, "in_process_tps": in_process(path, prompts.run(0, 1)[0], max_tokens, repeat),
                    "rows": [], "error": None}
    servers: dict[str, Server] = {}
    with tempfile.TemporaryFile("w+") as ours_log, tempfile.TemporaryFile("w+") as their_log:
        try:
            for server, log in ((OURS, ours_log), (THEIRS, their_log)):
                servers[server] = start(server, path, max(clients), log)
                if servers[server].why is not None:
                    result["error"] = f"{server} did not start: {servers[server].why}"
                    return result
            rows = drive(servers, prompts, clients, max_tokens, repeat)
            result["rows"] = [row.summary() for row in rows]
        except RuntimeError as e:  # a request failed: say which server and why, keep the other models
            result["error"] = str(e)
        finally:
            for server in servers.values():
                server.stop()
    return result


def targets(result: dict) -> list[dict]:
    """The pass/miss checks whose client counts were measured."""
    by = {row["clients"]: row for row in result["rows"]}
    checks = []

    def check(what: str, value: float, goal: float) -> None:
        checks.append({"target": what, "value": value, "goal": goal, "pass": value >= goal})

    if 1 in by:
        check("ours at 1 client / in-process stream_generate (decode tok/s)",
              by[1]["ours_decode_tps"] / result["in_process_tps"], TARGET_HTTP_VS_IN_PROCESS)
    if 1 in by and 8 in by:
        check("ours at 8 clients / ours at 1 (aggregate tok/s)", by[8]["ours_tps"] / by[1]["ours_tps"],
              TARGET_SCALING)
    for n in (1, 8):
        if n in by:
            check(f"ours / mlx_lm.server at {n} client{'s' * (n > 1)} (aggregate tok/s)", by[n]["ratio"],
                  TARGET_VS_MLX_LM)
    return checks


def fairness_warnings(result: dict) -> list[str]:
    """Differences between the servers that would make the comparison unfair."""
    lines = []
    for row in result["rows"]:
        n = row["clients"]
        if row["ours_tokens"] != row["mlx_lm_tokens"]:
            lines.append(f"{n} clients: {row['ours_tokens']} completion tokens from us, {row['mlx_lm_tokens']} "
                         "from mlx_lm.server (EOS reached, or a count differs)")
        if row["ours_prompt_tokens"] != row["mlx_lm_prompt_tokens"]:
            lines.append(f"{n} clients: prompt tokens {row['ours_prompt_tokens']} (ours) vs "
                         f"{row['mlx_lm_prompt_tokens']} (mlx_lm.server)")
        if row["ours_cached_tokens"] or row["mlx_lm_cached_tokens"]:
            lines.append(f"{n} clients: prompt-cache hits, ours {row['ours_cached_tokens']} tokens, mlx_lm.server "
                         f"{row['mlx_lm_cached_tokens']}")
    return lines


def report(result: dict, prompt_tokens: int, max_tokens: int, repeat: int) -> None:
    print(f"\n{result['model']}: {prompt_tokens}-token random prompts, {max_tokens} tokens each, greedy; "
          f"medians of {repeat} alternating runs")
    print(f"in-process stream_generate: {result['in_process_tps']:.1f} tok/s decode; BLAS {blas.describe()}")
    if result["error"]:
        print(result["error"])
    if not result["rows"]:
        return
    one = next((row["ours_tps"] for row in result["rows"] if row["clients"] == 1), None)
    print(f"{'clients':>7} | {'ours tok/s':>10} {'TTFT ms':>8} {'decode/client':>13} | {'mlx-lm tok/s':>12} "
          f"{'TTFT ms':>8} {'decode/client':>13} | {'ours/mlx-lm':>11} | {'ours N/1':>8}")
    for row in result["rows"]:
        scaling = f"{row['ours_tps'] / one:8.2f}" if one else f"{'-':>8}"
        print(f"{row['clients']:7d} | {row['ours_tps']:10.1f} {row['ours_ttft_ms']:8.0f} "
              f"{row['ours_decode_tps']:13.1f} | {row['mlx_lm_tps']:12.1f} {row['mlx_lm_ttft_ms']:8.0f} "
              f"{row['mlx_lm_decode_tps']:13.1f} | {row['ratio']:11.2f} | {scaling}")
    same = ", ".join(f"{row['same_text']}/{row['requests']}" for row in result["rows"])
    print(f"greedy text equal between servers (requests, per client count): {same}")
    for line in result["warnings"]:
        print(f"warning: {line}")
    for t in result["targets"]:
        print(f"{'pass' if t['pass'] else 'MISS'}: {t['target']} = {t['value']:.2f} (target >= {t['goal']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama", help="comma-separated subset of llama,smollm2")
    ap.add_argument("--smollm2", help="SmolLM2-135M Hugging Face folder or .gguf (implies smollm2 in --models)")
    ap.add_argument("--clients", default="1,4,8", help="comma-separated concurrent client counts")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    clients = sorted({int(c) for c in args.clients.split(",")})
    wanted = set(args.models.split(",")) | ({"smollm2"} if args.smollm2 else set())

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models = []
        if "llama" in wanted:
            models.append(("llama-58m-float32 (random)", build_llama_50m(Path(tmp) / "llama")))
        if "smollm2" in wanted:
            source = smollm2_source(args.smollm2)
            if source is None or not source.exists():
                print("SmolLM2-135M skipped: no checkpoint; pass --smollm2 PATH (a Hugging Face folder or .gguf)",
                      file=sys.stderr)
            else:
                models.append((f"SmolLM2-135M 4-bit g64 float32 ({source.name})",
                               convert_smollm2(source, Path(tmp) / "smollm2")))
        for name, path in models:
            result = bench_model(name, path, clients, args.prompt_tokens, args.max_tokens, args.repeat)
            result["targets"], result["warnings"] = targets(result), fairness_warnings(result)
            if result["error"] and args.json:
                print(f"{name}: {result['error']}", file=sys.stderr)
            results.append(result)

    if args.json:
        print(json.dumps({"blas": blas.describe(), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                          "repeat": args.repeat, "clients": clients, "models": results}))
        return
    for result in results:
        report(result, args.prompt_tokens, args.max_tokens, args.repeat)


if __name__ == "__main__":
    main()
