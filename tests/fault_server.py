"""`mlxinfer serve` with faults planted, for tests/test_server.py (not a test module).

Environment:
- MLXINFER_TEST_STEP_DELAY: seconds each engine step sleeps first, so a stream lasts long
  enough to be caught mid-way (disconnects, a full queue, shutdown).
- MLXINFER_TEST_PREFILL_FAULT: comma-separated token ids; a prompt chunk holding them
  raises in prefill (a request that fails before its first token).
- MLXINFER_TEST_EMIT_FAULT: token ids; a sequence whose prompt holds them raises when its
  third token is emitted (a request that fails mid-stream).
- MLXINFER_TEST_PREPARE_FAULT: token ids; preparing a prompt that holds them raises (a fault
  of ours before the request reaches the engine).
- MLXINFER_TEST_GATE: a file path; MLXINFER_TEST_GATE_PREPARE / MLXINFER_TEST_GATE_PREFILL: token
  ids. Preparing (or prefilling) a prompt that holds them waits until the file exists (at most
  120 s), so a test can hold a request in that stage for as long as it needs.
  MLXINFER_TEST_GATE_DECODE: token ids; once a sequence whose prompt holds them has sent a
  token, the engine's next step waits for the file (a reply held mid-stream: a speculative
  burst can finish a short reply within one step, too fast to catch otherwise).
- MLXINFER_TEST_GATE_ADAPTER: a file path; loading an adapter creates it once it starts reading
  the adapter's files, then waits for MLXINFER_TEST_GATE (a load held mid-way, for as long as a
  test needs).
- MLXINFER_TEST_HEADER_SECONDS: the header deadline (the server's HEADER_SECONDS), so a test
  that waits for it to free connections waits that long, not the 10 s a real client gets.
"""

from __future__ import annotations

import os
import time

from mlxinfer.serve import app
from mlxinfer.loading import adapters
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.cli.main import main
from mlxinfer.engine.text_stream import TextStream


def ids(name: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, "").split(",") if x]


def holds(tokens, marker: list[int]) -> bool:
    tokens = list(tokens)
    return bool(marker) and any(tokens[i : i + len(marker)] == marker for i in range(len(tokens)))


DELAY = float(os.environ.get("MLXINFER_TEST_STEP_DELAY", "0"))
PREFILL_FAULT, EMIT_FAULT = ids("MLXINFER_TEST_PREFILL_FAULT"), ids("MLXINFER_TEST_EMIT_FAULT")
PREPARE_FAULT = ids("MLXINFER_TEST_PREPARE_FAULT")
GATE, GATE_PREPARE, GATE_PREFILL = os.environ.get("MLXINFER_TEST_GATE"), ids("MLXINFER_TEST_GATE_PREPARE"), \
    ids("MLXINFER_TEST_GATE_PREFILL")
GATE_DECODE = ids("MLXINFER_TEST_GATE_DECODE")
GATE_ADAPTER = os.environ.get("MLXINFER_TEST_GATE_ADAPTER")
step, prefill, emit, prepare = BatchGenerator.step, PromptCache.prefill, TextStream.emit, BatchGenerator.prepare
read_adapter = adapters.read_adapter


def wait_for_gate() -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(GATE) and time.monotonic() < deadline:
        time.sleep(0.01)


def slow_step(self, prefill=True):
    time.sleep(DELAY)
    if any(s.text.generated and holds(s.prompt, GATE_DECODE) for s in self._decoding):
        wait_for_gate()
    return step(self) if prefill else step(self, prefill=False)


def gated_prepare(self, request):
    prepared = prepare(self, request)
    if holds(prepared.ids, PREPARE_FAULT):
        raise RuntimeError("planted prepare fault")
    if holds(prepared.ids, GATE_PREPARE):
        wait_for_gate()
    return prepared


def faulty_prefill(self, model, tokens, *args, **kwargs):
    if holds(tokens, PREFILL_FAULT):
        raise RuntimeError("planted prefill fault")
    if holds(tokens, GATE_PREFILL):
        wait_for_gate()
    return prefill(self, model, tokens, *args, **kwargs)


def faulty_emit(self, token):
    if self.generated == 2 and holds(self.cache.tokens, EMIT_FAULT):
        raise RuntimeError("planted emit fault")
    return emit(self, token)


def gated_read_adapter(path):
    if GATE_ADAPTER:
        open(GATE_ADAPTER, "w").close()
        wait_for_gate()
    return read_adapter(path)


BatchGenerator.step = slow_step
adapters.read_adapter = gated_read_adapter
PromptCache.prefill = faulty_prefill
TextStream.emit = faulty_emit
BatchGenerator.prepare = gated_prepare
app.HEADER_SECONDS = float(os.environ.get("MLXINFER_TEST_HEADER_SECONDS", app.HEADER_SECONDS))

if __name__ == "__main__":
    main()
