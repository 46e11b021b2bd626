"""The checks every model family passes beyond its logits, as tests a family's test module
imports (`from family_checks import test_...`) to run on its own `variant` fixture, which gives
(name, checkpoint folder, model in float32, tokenizer). The oracle is transformers on the same
random-weight checkpoint, or the single-sequence path itself checked against it:

- a prompt prefilled through the caches in chunks, then decoded a token at a time, gives
  transformers' logits for the whole sequence;
- greedy generation through the engine (prompt prefilled in several chunks) picks, at every
  step, transformers' argmax over the sequence so far (teacher forcing);
- a batch of mixed lengths gives each sequence what it gets alone;
- a generation from a pooled prompt cache equals one from a fresh cache, prefilling only the new
  tokens;
- speculative decoding (prompt lookup, and a draft model) gives plain greedy's tokens."""

from __future__ import annotations

import json
import shutil
from contextlib import closing
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from conftest import build_hf_checkpoint, llama_cpp_gguf, real_tokenizer
from test_batch import GREEDY, assert_batch_equals_solo, prompts_for
from test_parity import TOL, hf_logits, ours_incremental, tokens
from test_pool import BIG, assert_same_as_fresh, served

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.convert.gguf_file import GGUFFile
from mlxinfer.engine.generate import stream_generate
from mlxinfer.models.cache import make_cache
from mlxinfer.engine.pool import PromptCachePool

PREFILL_STEP = 16  # a prompt of PROMPT_LENGTH tokens is prefilled in three chunks
PROMPT_LENGTH = 40
STEPS = 12
NEAR_TIE = 1e-4  # a top-2 logit gap this small may flip under another summation order


def prompt(length: int = PROMPT_LENGTH, seed: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=length).tolist()


def test_chunked_prefill_matches_transformers(variant) -> None:
    """Two prefill chunks of 12, then single tokens, through our caches: transformers' logits."""
    _, folder, model, _ = variant
    ids = tokens()
    ref = hf_logits(folder, ids)
    assert np.abs(ref).max() > 0.1, "logits too small for the comparison to mean anything"
    np.testing.assert_allclose(ours_incremental(model, ids, chunks=[12, 12]), ref, atol=TOL, rtol=0)


def test_greedy_matches_teacher_forcing(variant) -> None:
    """Greedy tokens from the engine equal transformers' argmax at each step, given the prompt
    and the tokens before; where they differ, transformers' top two must be a near-tie (and the
    rest is not compared: the two continuations part there)."""
    _, folder, model, tok = variant
    ids = prompt()
    got = [c.token for c in stream_generate(model, tok, ids, max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                            prefill_step=PREFILL_STEP) if c.token is not None]
    assert len(got) == STEPS
    logits = hf_logits(folder, np.array([ids + got[:-1]]))[0, len(ids) - 1 :]
    for step, (ours, row) in enumerate(zip(got, logits)):
        if ours != int(row.argmax()):
            top = np.sort(row)[-2:]
            assert top[1] - top[0] < NEAR_TIE, f"step {step}: we chose {ours}, transformers {int(row.argmax())}"
            return


def test_batched_equals_alone(variant) -> None:
    _, _, model, tok = variant
    widest = assert_batch_equals_solo(model, tok, [(ids, GREEDY) for ids in prompts_for(model)])
    assert widest > 1, "the sequences were never decoded together"


def test_pool_reuse_equals_fresh(variant) -> None:
    """A second turn (the first's tokens plus three) fetched from the pool prefills only the three."""
    _, _, model, tok = variant
    pool = PromptCachePool(BIG)
    held = served(pool, model, tok, prompt(20))
    turn2 = held + [9, 10, 11]
    cache = pool.fetch(model, turn2)
    assert cache.tokens == held
    assert assert_same_as_fresh(model, tok, turn2, cache) == 3


def test_speculative_equals_plain(variant, hf_checkpoint) -> None:
    """Prompt lookup and a draft model (a one-layer Llama with the same vocabulary) both draft,
    and both give plain greedy's tokens."""
    _, _, model, tok = variant
    draft = mlxinfer.load(hf_checkpoint("llama", num_hidden_layers=1, seed=7), dtype="float32")[0]
    ids = prompt(10) * 3  # repetitive: prompt lookup finds drafts
    opts = dict(max_tokens=20, ignore_eos=True, temperature=0.0)
    plain = [c.token for c in stream_generate(model, tok, ids, **opts)]
    for spec in (dict(prompt_lookup=True), dict(draft_model=draft)):
        chunks = list(stream_generate(model, tok, ids, num_draft_tokens=4, **spec, **opts))
        assert [c.token for c in chunks] == plain, spec
        assert chunks[-1].stats.drafted > 0, spec


# --- GGUF: llama.cpp's own converter writes the file, ours converts it back ---

SMOLLM2_VOCAB = 49152  # llama.cpp's converter knows a tokenizer by the ids it gives: a real one, this the smallest


def real_vocab_checkpoint(folder: Path, model_type: str, overrides: dict, specials: dict | None = None) -> Path:
    """A random checkpoint with the real SmolLM2 tokenizer, some of its special tokens renamed as
    `specials` says ({id: new text}: a family's own)."""
    source = real_tokenizer("smollm2")
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    src = build_hf_checkpoint(folder, model_type, {**ids, **overrides, "vocab_size": SMOLLM2_VOCAB})
    for file in source.iterdir():
        shutil.copyfile(file, src / file.name)
    if specials:
        tok = json.loads((src / "tokenizer.json").read_text())
        for entry in tok["added_tokens"]:
            entry["content"] = specials.get(entry["id"], entry["content"])
        vocab = tok["model"]["vocab"]
        tok["model"]["vocab"] = {specials.get(i, text): i for text, i in vocab.items()}
        (src / "tokenizer.json").write_text(json.dumps(tok))
        config = json.loads((src / "tokenizer_config.json").read_text())
        for key, entry in config["added_tokens_decoder"].items():
            entry["content"] = specials.get(int(key), entry["content"])
        (src / "tokenizer_config.json").write_text(json.dumps(config))
    return src


def assert_llama_cpp_gguf_matches_transformers(llama_cpp: Path, src: Path, tmp: Path, arch: str) -> dict:
    """`src` through llama.cpp's converter (GGUF architecture `arch`) and back through ours: the
    folder's float32 logits equal transformers' on `src`, a prompt prefilled in two chunks.
    Returns the converted folder's config."""
    from transformers import AutoModelForCausalLM

    gguf_file = llama_cpp_gguf(llama_cpp, src, tmp / "model.gguf")
    with closing(GGUFFile(gguf_file)) as file:
        assert file.metadata["general.architecture"] == arch
    convert(gguf_file, tmp / "out", dtype="float32")
    ids = np.array([prompt(PROMPT_LENGTH)])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    ours = mlxinfer.load(tmp / "out", dtype="float32")[0]
    cache = make_cache(ours)
    got = np.concatenate([np.array(ours(mx.array(part), cache=cache)) for part in np.split(ids, [24], axis=1)], 1)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    return json.loads((tmp / "out" / "config.json").read_text())
