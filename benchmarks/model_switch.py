"""Serving many models: the first token of a model not yet loaded, and switching between two.

    python benchmarks/model_switch.py                          # SmolLM2-135M from the test-asset cache
    python benchmarks/model_switch.py --smollm2 PATH           # its GGUF (or a Hugging Face folder) elsewhere
    python benchmarks/model_switch.py --repeat 5 --switches 20 --json
    python benchmarks/model_switch.py --repeat 1 --switches 4  # a quick check that it runs

Models. The demo model, SmolLM2-135M-Instruct (`mlxinfer.cli.demo`), from its GGUF as the other
benchmarks convert it (`fixtures.convert_smollm2`: 4-bit g64, float32 activations: MLX's CPU
computes float16 slowly, mlx-lm ~20x slower there), under the demo's name, and a second copy of
it quantized to 8 bits, both into a store of their own (MLXINFER_HOME and HF_HOME in a
temporary folder, the server run from there, so it serves these two and nothing else). Nothing
is downloaded: without `--smollm2` the GGUF the test suite caches is used, or the run stops.

(a) Cold first token. Each repeat starts `mlxinfer serve` afresh with no model loaded (its
process is up and answers /health before the clock starts), then sends one streamed
`/v1/completions` request for the 4-bit model: TTFT = its first non-empty content event − the
send, measured at the client (the load, the prefill and the first token). Against it, in a
fresh process each repeat (`import mlx_lm` before the clock, as the server's imports are),
mlx-lm's `load()` of the same folder and `stream_generate` on the same prompt text, greedy,
until its first non-empty text. Reported: medians and their ratio (ours / mlx-lm, < 1 is
faster), and mlx-lm's load time alone.

(b) Switching. One server with `--max-loaded-models 1` (each request to the other model
unloads one and loads the other) and one with both kept (`--max-loaded-models 2`), both
`--keep-alive -1`, each warmed by a request to each model; then `--switches` requests
alternating 4-bit, 8-bit, ... TTFT of each, median by the model switched to; the ratio
switching / kept is what a switch costs. Every prompt starts with its request's number, so
no prompt cache answers from an earlier request.

The machine's load average is printed before and after, with a warning from 0.5 up: timings
on a busy machine are not results. On Linux install OpenBLAS first (see README).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
from fixtures import convert_smollm2, free_port, load_average, smollm2_source, stop_process  # noqa: E402, I001
from mlxinfer.base import blas  # noqa: E402
from mlxinfer.cli.demo import NAME as DEMO  # noqa: E402
from mlxinfer.text.tokenizer import load_tokenizer_from_dir  # noqa: E402

EIGHT_BIT = "smollm2-135m-instruct-8bit"
BUSY_LOAD = 0.5  # a 1-minute load average from here up: the numbers are not results
START_SECONDS = 180  # a server not answering /health by then did not start
REQUEST_SECONDS = 600  # one request's socket timeout: a stuck server ends the run instead of hanging it
MAX_TOKENS = 8  # a request's length: its first token is what is timed
TEXT = ("The history of astronomy spans thousands of years, from the first people who tracked the moon and the "
        "planets across the night sky to the telescopes that now look back to the early universe. ")
# mlx-lm in a fresh process: load() and stream_generate's first text, timed after the import
MLX_LM = """
import json, sys, time
import mlx_lm
from mlx_lm.sample_utils import make_sampler
start = time.perf_counter()
model, tokenizer = mlx_lm.load(sys.argv[1])
loaded = time.perf_counter()
for r in mlx_lm.stream_generate(model, tokenizer, sys.argv[2], max_tokens=int(sys.argv[3]),
                                 sampler=make_sampler(0.0)):
    if r.text:
        break
print(json.dumps({"load": loaded - start, "ttft": time.perf_counter() - start}))
"""


def store(source: Path, home: Path) -> dict[str, Path]:
    """The two models in `home`'s store: the demo model 4-bit, and 8-bit, float32 both."""
    from mlxinfer.convert import convert

    folders = {DEMO: home / "models" / DEMO, EIGHT_BIT: home / "models" / EIGHT_BIT}
    convert_smollm2(source, folders[DEMO])
    convert(source, folders[EIGHT_BIT], quantize=True, bits=8, dtype="float32", progress=False)
    return folders


def prompt_text(folder: Path, tokens: int) -> str:
    """About `tokens` tokens of English text (the model's tokenizer cuts it)."""
    tokenizer = load_tokenizer_from_dir(folder)
    ids = tokenizer.encode(TEXT * (tokens // 20 + 2))[:tokens]
    return tokenizer.decode(ids)


def child_env(home: Path) -> dict[str, str]:
    """The environment of a server or mlx-lm process: the store in `home`, and the BLAS `import
    mlxinfer` bound here preloaded (mlx-lm would otherwise prefill on MLX's reference BLAS)."""
    env = {**os.environ, "MLXINFER_HOME": str(home), "HF_HOME": str(home / "hf")}
    if blas.STATE.library:
        env["LD_PRELOAD"] = " ".join(filter(None, [blas.STATE.library, env.get("LD_PRELOAD")]))
    return env


class Server:
    """`mlxinfer serve` over the store in `home` (no --model: every model there, none loaded), on
    a free loopback port, its output in `log`; ready once /health answers."""

    def __init__(self, home: Path, args: list[str], log: IO[str]):
        self.port, self.log = free_port(), log
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxinfer", "serve", "--no-web", "--port", str(self.port),
                                      *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log, text=True,
                                     env=child_env(home), cwd=home)
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}: {self.last_line()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health in {START_SECONDS} s: {self.last_line()}")

    def loaded(self) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=30) as r:
            return sorted(json.load(r)["models"])

    def last_line(self) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().splitlines() if line.strip()]
        return (lines or ["no output"])[-1]

    def stop(self) -> None:
        stop_process(self.proc)


def first_token(port: int, model: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first non-empty content event."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_SECONDS)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}: {response.read()[:300]!r}")
        first = None
        for line in response:
            if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{model}: error event: {event['error']}")
            if first is None and any(c.get("text") for c in event.get("choices") or []):
                first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"{model}: the stream had no content")
        return first - sent
    finally:
        conn.close()


def mlx_lm_cold(home: Path, folder: Path, prompt: str) -> dict[str, float]:
    """mlx-lm's load and first token in a fresh process (`MLX_LM`)."""
    done = subprocess.run([sys.executable, "-c", MLX_LM, str(folder), prompt, str(MAX_TOKENS)], capture_output=True, text=True,
                          env=child_env(home), timeout=REQUEST_SECONDS, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mlx-lm failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Cold:
    ours: list[float]  # TTFT of a model not yet loaded, each repeat
    mlx_lm: list[float]  # load + first token, each repeat
    mlx_lm_load: list[float]


def cold(home: Path, folder: Path, prompt: str, repeat: int, log: IO[str]) -> Cold:
    """(a): alternately a fresh server's first request and a fresh mlx-lm process, `repeat` times."""
    ours, theirs, loads = [], [], []
    for _ in range(repeat):
        server = Server(home, ["--keep-alive", "-1"], log)
        try:
            if server.loaded():
                raise RuntimeError(f"the server loaded {server.loaded()} before any request")
            ours.append(first_token(server.port, DEMO, prompt))
        finally:
            server.stop()
        run = mlx_lm_cold(home, folder, prompt)
        theirs.append(run["ttft"])
        loads.append(run["load"])
    return Cold(ours, theirs, loads)


def switching(home: Path, prompt: str, switches: int, max_loaded: int, log: IO[str]) -> dict[str, list[float]]:
    """(b): TTFT of `switches` requests alternating between the two models, on a server holding
    at most `max_loaded` models, by the model each request switched to."""
    server = Server(home, ["--keep-alive", "-1", "--max-loaded-models", str(max_loaded)], log)
    try:
        for model in (EIGHT_BIT, DEMO, EIGHT_BIT):  # warm: each loaded once, the 8-bit last
            first_token(server.port, model, f"warm. {prompt}")
        times: dict[str, list[float]] = {DEMO: [], EIGHT_BIT: []}
        for i in range(switches):
            model = (DEMO, EIGHT_BIT)[i % 2]
            times[model].append(first_token(server.port, model, f"{i}. {prompt}"))
        return times
    finally:
        server.stop()


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", help="SmolLM2-135M-Instruct .gguf or Hugging Face folder (default: the test-asset "
                                      "cache's GGUF)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5, help="cold first tokens, each side")
    ap.add_argument("--switches", type=int, default=20, help="alternating requests on each switching server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    source = smollm2_source(args.smollm2)
    if source is None or not source.exists():
        sys.exit("no SmolLM2-135M checkpoint: pass --smollm2 PATH (its .gguf or a Hugging Face folder); nothing is "
                 "downloaded")

    before = os.getloadavg()[0]
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as log:
        home = Path(tmp)
        folders = store(source, home)
        prompt = prompt_text(folders[DEMO], args.prompt_tokens)
        first = cold(home, folders[DEMO], prompt, args.repeat, log)
        swapped = switching(home, prompt, args.switches, 1, log)
        kept = switching(home, prompt, args.switches, 2, log)
    after = os.getloadavg()[0]
    result = {
        "model": f"{DEMO} ({source.name}): 4-bit g64 and 8-bit, float32", "prompt_tokens": args.prompt_tokens,
        "repeat": args.repeat, "switches": args.switches, "blas": blas.describe(),
        "cold_ttft_ms": {"ours": median_ms(first.ours), "mlx_lm": median_ms(first.mlx_lm),
                         "mlx_lm_load": median_ms(first.mlx_lm_load),
                         "ours_each": [1000 * t for t in first.ours], "mlx_lm_each": [1000 * t for t in first.mlx_lm]},
        "cold_ratio": statistics.median(first.ours) / statistics.median(first.mlx_lm),
        "switch_ttft_ms": {m: {"switching": median_ms(swapped[m]), "kept": median_ms(kept[m]),
                               "ratio": statistics.median(swapped[m]) / statistics.median(kept[m])}
                           for m in (DEMO, EIGHT_BIT)},
        "load_before": load_before, "load_after": load_average(), "busy": max(before, after) >= BUSY_LOAD,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}; {args.prompt_tokens}-token prompt, greedy; BLAS {blas.describe()}")
    print(f"load average before: {load_before}")
    c = result["cold_ttft_ms"]
    print(f"(a) first token of a model not loaded, medians of {args.repeat}: mlxinfer serve {c['ours']:.0f} ms, "
          f"mlx-lm load + stream_generate {c['mlx_lm']:.0f} ms (its load {c['mlx_lm_load']:.0f} ms); "
          f"ratio {result['cold_ratio']:.2f}")
    print(f"(b) TTFT over {args.switches} alternating requests, medians: {'to model':<34}{'switching':>10}"
          f"{'kept':>8}{'ratio':>8}")
    for model, row in result["switch_ttft_ms"].items():
        print(f"{'':48}{model:<34}{row['switching']:8.0f}ms{row['kept']:6.0f}ms{row['ratio']:8.2f}")
    print(f"load average after: {result['load_after']}")
    if result["busy"]:
        print(f"warning: the load average reached {max(before, after):.2f} (>= {BUSY_LOAD}): the machine was busy; "
              "these timings are not results")


if __name__ == "__main__":
    main()
