"""Batched generation against the single-sequence path: every sequence a batch serves
gets, token for token and logprob for logprob, what `stream_generate` gives it alone
(itself checked against transformers and mlx-lm elsewhere), whatever else shares the
batch: other lengths and options, sequences admitted or cancelled mid-way, long
prompts prefilled in chunks beside it, every model family and cache kind."""

from __future__ import annotations

import gc
from collections import defaultdict
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
import pytest
import test_models_deepseek as deepseek_tests
from test_models_gemma import VARIANTS as GEMMA
from test_models_moe import VARIANTS as MOE
from test_models_phi3 import VARIANTS as PHI3
from test_parity import VARIANTS as PARITY

import mlxinfer
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.engine.sequence import SCORED_COST
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.engine.text_stream import Chunk

LENGTHS = (3, 17, 64, 200)
MAX_TOKENS = 8
GREEDY = dict(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
LOGPROB_TOL = 1e-4
NEAR_TIE = 1e-4  # a top-2 logit gap this small may flip under a different summation order

# One or two variants per family, chosen for what a batch could break: sliding windows
# (rotating caches per layer), logit soft-capping, LongRoPE (factors chosen by length),
# MoE routing of several rows at once, MLA's latent cache.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": PARITY["llama"],
    "mistral-sliding": PARITY["mistral-sliding"],
    "qwen2": PARITY["qwen2"],
    "qwen2-sliding": PARITY["qwen2-sliding"],
    "qwen3": PARITY["qwen3"],
    "gemma2-softcap": GEMMA["gemma2-softcap"],
    "gemma3_text": GEMMA["gemma3_text"],
    "phi3-longrope": ("phi3", PHI3["longrope"]),
    "phi3-sliding": ("phi3", PHI3["sliding"]),
    "mixtral": MOE["mixtral-k2"],
    "qwen2_moe": MOE["qwen2_moe"],
    "qwen3_moe": MOE["qwen3_moe"],
    "deepseek_v2": deepseek_tests.VARIANTS["v2-q-lora-null"],
    "deepseek_v3": deepseek_tests.VARIANTS["v3-grouped-k2"],
}


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng([length, seed]).integers(0, 500, size=length).tolist()


def prompts_for(model, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Mixed lengths, capped so prompt and completion fit the model's context."""
    cap = model.config.max_position_embeddings - max_tokens
    return [prompt(min(n, cap), seed=i) for i, n in enumerate(LENGTHS)]


def tokens_of(chunks: Sequence[Chunk]) -> list[int]:
    return [c.token for c in chunks if c.token is not None]


def solo(model, tok, ids, **options) -> list[Chunk]:
    """The oracle: one sequence alone on the single-sequence path."""
    return list(mlxinfer.stream_generate(model, tok, ids, **options))


def step_until(engine: BatchGenerator, done, limit: int = 1000) -> list[tuple[int, Chunk]]:
    """Step the engine until `done(produced so far)`; a bounded loop, so a stalled engine fails."""
    produced: list[tuple[int, Chunk]] = []
    for _ in range(limit):
        if done(produced):
            return produced
        produced += engine.step()
    pytest.fail(f"the engine did not get there in {limit} steps")


def collect(engine: BatchGenerator, uids: Sequence[int], steps=None) -> list[list[Chunk]]:
    """Every chunk of `steps` (default: the engine's whole stream), grouped by sequence."""
    streams: dict[int, list[Chunk]] = defaultdict(list)
    for uid, chunk in steps if steps is not None else engine.stream():
        streams[uid].append(chunk)
    assert set(streams) <= set(uids), f"chunks for sequences never submitted: {set(streams) - set(uids)}"
    return [streams[u] for u in uids]


def rejected(fact: str, run) -> None:
    """`run` fails as one InvalidOptionError whose one-line message names `fact`."""
    with pytest.raises(InvalidOptionError) as e:
        run()
    assert fact in str(e.value) and "\n" not in str(e.value), str(e.value)


def top2_gap(chunk: Chunk) -> float | None:
    """The logit gap between the two likeliest tokens (log-softmax keeps differences)."""
    top = chunk.top_logprobs
    return top[0][1] - top[1][1] if top and len(top) >= 2 else None


def assert_same_stream(got: Sequence[Chunk], want: Sequence[Chunk], what: str, greedy: bool = True) -> None:
    """Same tokens, logprobs (within LOGPROB_TOL), top logprobs, finish reasons and text.
    A greedy token that differs where the solo run's top-2 gap is a near-tie skips, with
    the gap in the message; any other difference fails, with the gap in the message."""
    a, b = tokens_of(got), tokens_of(want)
    if a != b:
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap = top2_gap(want[i]) if i < len(want) else None
        where = (f"{what}: batched tokens {a} != solo {b}, first difference at step {i}; "
                 f"solo top-2 logit gap there: {gap if gap is None else f'{gap:.3e}'}")
        if greedy and gap is not None and gap < NEAR_TIE and len(a) == len(b):
            pytest.skip(f"near-tie, not a batching bug: {where}")
        pytest.fail(where)
    np.testing.assert_allclose([c.logprob for c in got if c.token is not None],
                               [c.logprob for c in want if c.token is not None],
                               atol=LOGPROB_TOL, rtol=0, err_msg=f"{what}: logprobs")
    for k, (x, y) in enumerate(zip(got, want)):
        if y.top_logprobs is not None:
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs], f"{what}: top ids at step {k}"
            np.testing.assert_allclose([p for _, p in x.top_logprobs], [p for _, p in y.top_logprobs],
                                       atol=LOGPROB_TOL, rtol=0, err_msg=f"{what}: top logprobs at step {k}")
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want], f"{what}: finish reasons"
    assert "".join(c.text for c in got) == "".join(c.text for c in want), f"{what}: text"


def assert_batch_equals_solo(model, tok, items: Sequence[tuple[list[int], dict]], engine_options=None) -> int:
    """Submit every (prompt, options) at once; each stream equals its solo run with the
    same options plus the engine's. Returns the most sequences that got a token in one
    step, so a caller can check they really were decoded together."""
    engine_options = dict(engine_options or {})
    engine = BatchGenerator(model, tok, **engine_options)
    uids = [engine.submit(ids, **opts) for ids, opts in items]
    assert len(set(uids)) == len(uids), "uids must be distinct"
    steps = [engine.step() for _ in range(1000) if engine.active]
    assert engine.active == 0, "the engine did not finish in 1000 steps"
    got = collect(engine, uids, [x for step in steps for x in step])
    shared = {k: v for k, v in engine_options.items() if k != "max_batch"}
    for k, ((ids, opts), stream) in enumerate(zip(items, got)):
        assert_same_stream(stream, solo(model, tok, ids, **opts, **shared), f"sequence {k} ({len(ids)} tokens)",
                           greedy=opts.get("temperature", 0) == 0)
    return max(len({u for u, c in step if c.token is not None}) for step in steps)


@pytest.fixture(scope="module")
def other_draft(hf_checkpoint):
    """A smaller model with other weights (the draft of the speculative tests)."""
    return mlxinfer.load(hf_checkpoint("llama", head_dim=32, num_hidden_layers=1, seed=7), dtype="float32")[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, hf_checkpoint):
    """(name, model in float32, tokenizer) for one family's tiny random checkpoint."""
    model_type, overrides = FAMILIES[request.param]
    if model_type.startswith("deepseek"):
        folder = deepseek_tests.checkpoint(hf_checkpoint, model_type, overrides)
    else:
        folder = hf_checkpoint(model_type, **overrides)
    model, tok = mlxinfer.load(folder, dtype="float32")
    return request.param, model, tok


# 1. every family: a batch of mixed lengths equals each prompt alone


def test_every_family_batched_greedy_equals_solo(family):
    _, model, tok = family
    widest = assert_batch_equals_solo(model, tok, [(ids, GREEDY) for ids in prompts_for(model)])
    assert widest == len(LENGTHS), f"at most {widest} of {len(LENGTHS)} sequences were decoded together"


def test_every_family_batch_generate_text_equals_solo(family):
    _, model, tok = family
    prompts = prompts_for(model)
    texts = mlxinfer.batch_generate(model, tok, prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert texts == [mlxinfer.generate(model, tok, ids, max_tokens=MAX_TOKENS, ignore_eos=True) for ids in prompts]


def test_batch_generate_takes_text_and_chat_prompts(loaded):
    model, tok = loaded
    prompts = ["The quick brown fox", [{"role": "user", "content": "hello there"}], prompt(17)]
    texts = mlxinfer.batch_generate(model, tok, prompts, max_tokens=6, ignore_eos=True, max_batch=2)
    assert texts == [mlxinfer.generate(model, tok, p, max_tokens=6, ignore_eos=True) for p in prompts]


# 2. admission mid-way and queueing


def test_sequences_admitted_mid_way_equal_solo(loaded):
    model, tok = loaded
    opts = dict(GREEDY, max_tokens=10)
    items = [(prompt(n, seed=1), opts) for n in (17, 3, 64, 5)]
    engine = BatchGenerator(model, tok, max_batch=4)
    first = [engine.submit(ids, **o) for ids, o in items[:2]]
    early = [c for _ in range(3) for c in engine.step()]
    assert early and {u for u, _ in early} <= set(first), "the first two should be decoding before the others come"
    assert not any(c.finish_reason for _, c in early)
    later = [engine.submit(ids, **o) for ids, o in items[2:]]
    uids = first + later
    got = [a + b for a, b in zip(collect(engine, uids, early), collect(engine, uids))]
    for k, ((ids, o), stream) in enumerate(zip(items, got)):
        assert_same_stream(stream, solo(model, tok, ids, **o), f"sequence {k}")


def test_more_sequences_than_max_batch_wait_their_turn(loaded):
    model, tok = loaded
    items = [(prompt(n, seed=2), dict(GREEDY, max_tokens=4 + n % 5)) for n in (3, 17, 1, 40, 5)]
    engine = BatchGenerator(model, tok, max_batch=2)
    uids = [engine.submit(ids, **o) for ids, o in items]
    streams: dict[int, list[Chunk]] = defaultdict(list)
    for _ in range(1000):
        if all(streams[u] and streams[u][-1].finish_reason for u in uids):
            break
        produced = engine.step()
        assert len({u for u, _ in produced}) <= 2, "more sequences decoded in one step than max_batch"
        for uid, chunk in produced:
            streams[uid].append(chunk)
    assert engine.active == 0
    for k, ((ids, o), uid) in enumerate(zip(items, uids)):
        assert_same_stream(streams[uid], solo(model, tok, ids, **o), f"sequence {k}")


# 3. per-sequence options


def stop_string_case(model, tok) -> tuple[list[int], str]:
    """A prompt whose greedy reply streams a clean piece of text after its second token:
    that piece as a stop string ends the reply mid-way (random weights often emit
    partial UTF-8 bytes, which the streaming detokenizer holds back)."""
    for seed in range(3, 40):
        ids = prompt(12, seed=seed)
        texts = [c.text for c in solo(model, tok, ids, max_tokens=16, ignore_eos=True)]
        clean = [t for t in texts[2:-2] if t.strip() and "\ufffd" not in t]
        if clean:
            return ids, clean[0]
    pytest.fail("no prompt gave a reply with clean text to stop on")


def test_per_sequence_options_equal_solo(loaded):
    """Each sequence its own max_tokens, stop strings, sampler and seed, all in one batch."""
    model, tok = loaded
    base, stop = stop_string_case(model, tok)
    items = [
        (prompt(3, seed=3), dict(max_tokens=3, ignore_eos=True, logprobs=2)),
        (base, dict(max_tokens=16, ignore_eos=True, stop=[stop], logprobs=2)),
        (prompt(17, seed=3), dict(max_tokens=10, ignore_eos=True, temperature=0.8, seed=1)),
        (prompt(17, seed=3), dict(max_tokens=10, ignore_eos=True, temperature=0.8, seed=2)),
        (prompt(30, seed=3), dict(max_tokens=7, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=5)),
        (prompt(9, seed=3), dict(max_tokens=9, ignore_eos=True, repetition_penalty=1.3, logit_bias={7: 2.0})),
    ]
    assert assert_batch_equals_solo(model, tok, items) >= 4
    stopped = solo(model, tok, base, **items[1][1])
    assert stopped[-1].finish_reason == "stop", "the stop string should have ended the solo run"
    a, b = (tokens_of(solo(model, tok, ids, **o)) for ids, o in items[2:4])
    assert a != b, "different seeds should give different samples here"


def test_same_seed_same_prompt_twice_in_one_batch(loaded):
    """Each sequence draws from its own generator: two copies do not share one stream of draws."""
    model, tok = loaded
    opts = dict(max_tokens=12, ignore_eos=True, temperature=1.0, seed=11)
    ids = prompt(10, seed=4)
    assert_batch_equals_solo(model, tok, [(ids, opts), (ids, opts), (prompt(20, seed=4), dict(opts, seed=12))])


def test_eos_ends_only_its_sequence(loaded):
    model, tok = loaded
    ids = prompt(10, seed=5)
    free = tokens_of(solo(model, tok, ids, max_tokens=8, ignore_eos=True))
    eos = free[3]
    tok.eos_token_ids.insert(0, eos)
    try:
        items = [(ids, dict(max_tokens=8)), (prompt(17, seed=5), dict(max_tokens=8, ignore_eos=True))]
        assert solo(model, tok, ids, max_tokens=8)[-1].finish_reason == "stop"
        assert_batch_equals_solo(model, tok, items)
    finally:
        tok.eos_token_ids.remove(eos)


def test_zero_max_tokens_and_context_limit_equal_solo(loaded):
    """max_tokens=0 and a prompt that leaves room for only a few tokens end as alone."""
    model, tok = loaded
    ctx = model.config.max_position_embeddings
    items = [(prompt(5, seed=6), dict(max_tokens=0)), (prompt(ctx - 3, seed=6), dict(GREEDY, max_tokens=10)),
             (prompt(17, seed=6), GREEDY)]
    assert_batch_equals_solo(model, tok, items)


def test_a_step_prefills_at_most_one_chunk(loaded):
    """A step's prefill stops before a chunk that would take it past `prefill_step` tokens, so a
    stream being decoded waits for one chunk at most, however many prompts are going in."""
    model, tok = loaded
    engine = BatchGenerator(model, tok, prefill_step=8)
    for n in (6, 10, 10):
        engine.submit(prompt(n, seed=n), **GREEDY)
    done = 0
    while engine.active:
        engine.step()
        assert engine.stats.prefilled_tokens - done <= 8
        done = engine.stats.prefilled_tokens
    assert done == 5 + 9 + 9


def test_a_scored_prompt_counts_its_extra_work_against_the_chunk(loaded):
    """A scored chunk also runs the LM head, a log-softmax and a top-k over the vocabulary for every
    position (2.5x a plain chunk's time on the demo model), so it is cut `SCORED_COST` times shorter
    and counts that much: a step with a scored prompt going in still costs one plain chunk at most."""
    model, tok = loaded
    engine = BatchGenerator(model, tok, prefill_step=16)
    engine.submit(prompt(40, seed=3), max_tokens=0, echo=True, prompt_logprobs=1)
    engine.submit(prompt(30, seed=4), **GREEDY)
    scored = 16 // SCORED_COST
    done, steps = 0, 0
    while engine.active:
        engine.step()
        ran = engine.stats.prefilled_tokens - done
        assert ran <= (scored if steps < -(-39 // scored) else 16), f"step {steps} prefilled {ran} tokens"
        done, steps = engine.stats.prefilled_tokens, steps + 1
    assert done == 39 + 29


# 4. cache kinds


@pytest.mark.parametrize("cache", [dict(max_kv_size=32), dict(kv_bits=8), dict(max_kv_size=32, kv_bits=8)],
                         ids=["rotating", "quantized", "rotating-quantized"])
def test_cache_kinds_batched_equal_solo(loaded, cache):
    """A 200-token prompt runs through a 32-token window; kv_bits quantizes every row."""
    model, tok = loaded
    items = [(prompt(n, seed=7), GREEDY) for n in LENGTHS]
    assert_batch_equals_solo(model, tok, items, dict(cache, prefill_step=16))


def test_cache_kinds_differ_per_sequence_in_one_batch(loaded):
    """Each row keeps its own cache kind: growing, rotating, quantized, both, side by side."""
    model, tok = loaded
    kinds = [{}, dict(max_kv_size=32), dict(kv_bits=8), dict(max_kv_size=24, kv_bits=4, kv_group_size=32)]
    # long enough replies that every row decodes beside the others (a step prefills at most one chunk)
    items = [(prompt(n, seed=13), dict(GREEDY, max_tokens=16, **kind)) for n, kind in zip((200, 100, 64, 90), kinds)]
    assert assert_batch_equals_solo(model, tok, items, dict(prefill_step=32)) == len(items)


# 5. cancel


def test_cancel_one_sequence(loaded):
    model, tok = loaded
    opts = dict(GREEDY, max_tokens=12)
    items = [(prompt(n, seed=8), opts) for n in (17, 200, 9)]
    engine = BatchGenerator(model, tok)
    uids = [engine.submit(ids, **opts) for ids, _ in items]
    before = step_until(engine, lambda done: sum(u == uids[1] for u, _ in done) >= 3)
    engine.cancel(uids[1])
    got = [a + b for a, b in zip(collect(engine, uids, before), collect(engine, uids))]
    cancelled = got[1]
    assert cancelled[-1].finish_reason == "cancelled"
    assert all(c.finish_reason is None for c in cancelled[:-1])
    alone = tokens_of(solo(model, tok, items[1][0], **opts))
    assert tokens_of(cancelled) == alone[: len(tokens_of(cancelled))] and len(tokens_of(cancelled)) < len(alone)
    for k in (0, 2):
        assert_same_stream(got[k], solo(model, tok, items[k][0], **opts), f"sequence {k}")


def test_cancel_frees_the_sequences_cache(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    keep = engine.submit(prompt(5, seed=9), max_tokens=40, ignore_eos=True)
    big = engine.submit(prompt(200, seed=9), max_tokens=40, ignore_eos=True)
    step_until(engine, lambda done: any(u == big for u, _ in done))
    reference = mlxinfer.PromptCache.for_model(model)
    solo(model, tok, prompt(200, seed=9), prompt_cache=reference, max_tokens=1)
    gc.collect()
    held, held_bytes = mx.get_active_memory(), engine.cache_bytes
    engine.cancel(big)
    assert [c.finish_reason for u, c in engine.step() if u == big] == ["cancelled"]
    gc.collect()
    freed, freed_bytes = held - mx.get_active_memory(), held_bytes - engine.cache_bytes
    assert freed_bytes >= 0.95 * reference.nbytes, f"engine.cache_bytes fell by {freed_bytes}, not ~{reference.nbytes}"
    assert freed >= 0.95 * reference.nbytes, f"active memory fell by {freed} bytes, not ~{reference.nbytes}"
    assert engine.active == 1


def test_cancel_a_queued_sequence(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok, max_batch=1)
    first = engine.submit(prompt(5, seed=10), **GREEDY)
    queued = engine.submit(prompt(7, seed=10), **GREEDY)
    engine.cancel(queued)
    got = collect(engine, [first, queued])
    assert_same_stream(got[0], solo(model, tok, prompt(5, seed=10), **GREEDY), "running sequence")
    assert tokens_of(got[1]) == [] and [c.finish_reason for c in got[1]] == ["cancelled"]


def test_cancel_unknown_or_finished_sequence(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    rejected("12345", lambda: engine.cancel(12345))
    done = engine.submit(prompt(4, seed=14), **dict(GREEDY, max_tokens=2))
    running = engine.submit(prompt(6, seed=14), **GREEDY)
    first = step_until(engine, lambda out: any(u == done and c.finish_reason for u, c in out))
    engine.cancel(done)  # finished already: nothing happens
    got = collect(engine, [done, running], first + list(engine.stream()))
    assert [c.finish_reason for c in got[0]] == [None, "length"]
    assert_same_stream(got[1], solo(model, tok, prompt(6, seed=14), **GREEDY), "the other sequence")


# 6. long prompts are prefilled in chunks beside decoding sequences


def test_long_prompt_prefill_does_not_stall_decoding(loaded):
    model, tok = loaded
    short, long = prompt(5, seed=11), prompt(200, seed=11)
    opts = dict(GREEDY, max_tokens=40)
    engine = BatchGenerator(model, tok, prefill_step=16)
    a = engine.submit(short, **opts)
    steps = [step_until(engine, lambda done: any(u == a for u, _ in done))]
    b = engine.submit(long, **opts)
    prefilling = 0
    for _ in range(100):
        produced = engine.step()
        steps.append(produced)
        if any(u == b for u, _ in produced):
            break
        assert [u for u, _ in produced] == [a], "the decoding sequence missed a step while the long prompt prefilled"
        prefilling += 1
    else:
        pytest.fail("the long prompt produced no token in 100 steps")
    assert prefilling >= 199 // 16 - 1, f"a 200-token prompt took only {prefilling} steps at prefill_step=16"
    steps.append(list(engine.stream()))
    got = collect(engine, [a, b], [x for s in steps for x in s])
    assert_same_stream(got[0], solo(model, tok, short, **opts), "decoding sequence")
    assert_same_stream(got[1], solo(model, tok, long, **opts, prefill_step=16), "long prompt")


# 7. speculative decoding while a sequence is alone; the shared batch while others run


SPECULATIVE = ["draft_model", "self_draft", "prompt_lookup"]


def speculative_option(spec: str, draft, model) -> dict:
    """A small other model, the target itself (every draft accepted), or prompt lookup."""
    return {"draft_model": dict(draft_model=draft), "self_draft": dict(draft_model=model),
            "prompt_lookup": dict(prompt_lookup=True)}[spec]


def repetitive(n: int, seed: int) -> list[int]:
    return prompt(n, seed=seed) * 3  # prompt lookup finds drafts in it


@pytest.mark.parametrize("spec", SPECULATIVE)
def test_a_lone_speculative_sequence_drafts_and_equals_solo(loaded, other_draft, spec):
    model, tok = loaded
    option = speculative_option(spec, other_draft, model)
    p, opts = repetitive(12, 40), dict(GREEDY, max_tokens=24)
    engine = BatchGenerator(model, tok)
    stream = collect(engine, [engine.submit(p, **opts, **option)])[0]
    assert_same_stream(stream, solo(model, tok, p, **opts, **option), "lone speculative sequence")
    stats = stream[-1].stats
    assert stats.rounds > 0 and stats.drafted > 0 and not stats.note, stats
    if spec == "self_draft":
        assert stats.accepted > 0 and any(c.drafted for c in stream), stats


@pytest.mark.parametrize("spec", SPECULATIVE)
def test_speculation_pauses_while_others_share_the_batch(loaded, other_draft, spec, monkeypatch):
    """Drafting alone, then batched with a plain sequence, then alone again: both equal solo.
    The mode chooser is pinned to drafting (it otherwise follows measured speeds, which vary)."""
    from mlxinfer.decode.speculative import ModeChooser

    monkeypatch.setattr(ModeChooser, "next_phase", lambda self: ("speculate", 6))
    model, tok = loaded
    option = speculative_option(spec, other_draft, model)
    p, q = repetitive(12, 41), prompt(9, seed=42)
    long, short = dict(GREEDY, max_tokens=60), dict(GREEDY, max_tokens=6)
    engine = BatchGenerator(model, tok)
    first = engine.submit(p, **long, **option)
    before = step_until(engine, lambda done: len(done) >= 8)
    stats = before[-1][1].stats
    alone_rounds = stats.rounds
    assert alone_rounds > 0, "the lone sequence did not draft before the other came"
    second = engine.submit(q, **short)
    during = step_until(engine, lambda done: any(u == second and c.finish_reason for u, c in done))
    shared_rounds = stats.rounds
    after = list(engine.stream())
    uids = [first, second]
    got = [a + b + c for a, b, c in zip(*(collect(engine, uids, x) for x in (before, during, after)))]
    assert_same_stream(got[0], solo(model, tok, p, **long, **option), "speculative sequence")
    assert_same_stream(got[1], solo(model, tok, q, **short), "plain sequence")
    assert engine.stats.max_batch_seen == 2 and stats.note, "the two were never decoded together"
    assert shared_rounds - alone_rounds <= 2, "it kept drafting while the other was decoding"
    assert stats.rounds > shared_rounds, "it did not draft again once alone"


def test_sampled_speculative_sequence_in_the_engine_finishes(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    uid = engine.submit(repetitive(10, 43), max_tokens=30, ignore_eos=True, temperature=1.0, seed=3,
                        prompt_lookup=True)
    stream = collect(engine, [uid])[0]
    assert len(tokens_of(stream)) == 30 and stream[-1].finish_reason == "length"
    assert stream[-1].stats.rounds > 0 and stream[-1].stats.drafted > 0, stream[-1].stats


# 7b. one sequence's failure ends that sequence; the others go on as if it had not been there


def planted(where: str, fails_for) -> Any:
    """A replacement for PromptCache.prefill or TextStream.emit that raises for the sequences `fails_for` picks."""
    from mlxinfer.models.prompt_cache import PromptCache
    from mlxinfer.engine.text_stream import TextStream

    if where == "prefill":
        original = PromptCache.prefill

        def prefill(self, model, tokens, *args, **kwargs):
            if fails_for(list(tokens)):
                raise RuntimeError("planted prefill fault")
            return original(self, model, tokens, *args, **kwargs)
        return prefill
    original = TextStream.emit

    def emit(self, token):
        if self.generated == 2 and fails_for(self.cache.tokens):
            raise RuntimeError("planted emit fault")
        return original(self, token)
    return emit


@pytest.mark.parametrize("where", ["prefill", "emit"])
def test_a_failing_sequence_ends_alone(loaded, monkeypatch, where):
    from mlxinfer.models.prompt_cache import PromptCache
    from mlxinfer.engine.text_stream import TextStream

    model, tok = loaded
    opts = dict(GREEDY, max_tokens=12)
    good, bad, late = prompt(17, seed=30), prompt(40, seed=31), prompt(9, seed=32)
    marker = bad[5:9]
    fails = lambda tokens: any(tokens[i : i + 4] == marker for i in range(len(tokens)))  # noqa: E731
    target = (PromptCache, "prefill") if where == "prefill" else (TextStream, "emit")
    monkeypatch.setattr(*target, planted(where, fails))
    engine = BatchGenerator(model, tok)
    first = engine.submit(good, **opts)
    before = step_until(engine, lambda done: any(u == first and c.token is not None for u, c in done))
    uids = [first, engine.submit(bad, **opts), engine.submit(late, **opts)]
    got = [a + b for a, b in zip(collect(engine, uids, before), collect(engine, uids))]
    failed = got[1]
    assert failed[-1].finish_reason == "error" and f"planted {where} fault" in failed[-1].error
    assert len(tokens_of(failed)) == (0 if where == "prefill" else 2)
    assert engine.active == 0 and engine.cache_bytes == 0
    for k in (0, 2):
        assert_same_stream(got[k], solo(model, tok, [good, bad, late][k], **opts), f"sequence {k}")


class _Unreadable:
    """Tokens of a batched step whose read fails, as an error raised while evaluating would."""

    def __init__(self, tokens: mx.array):
        self.tokens = tokens

    def __getitem__(self, index):
        return self.tokens[index]

    def tolist(self):
        raise RuntimeError("planted step fault")


@pytest.mark.parametrize("where", ["graph", "read"])
def test_a_failing_batched_step_ends_its_members_and_the_engine_goes_on(loaded, monkeypatch, where):
    """A fault while building a step (`run_rows`), or while reading a queued step's tokens."""
    from mlxinfer.engine import batch

    model, tok = loaded
    opts = dict(GREEDY, max_tokens=6)
    calls = {"n": 0}
    if where == "graph":
        original = batch.run_rows

        def run_rows(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("planted step fault")
            return original(*args, **kwargs)

        monkeypatch.setattr(batch, "run_rows", run_rows)
    else:
        original = batch._Decode

        def decode(members, tokens, *rest):
            calls["n"] += 1
            return original(members, _Unreadable(tokens) if calls["n"] == 2 else tokens, *rest)

        monkeypatch.setattr(batch, "_Decode", decode)
    engine = BatchGenerator(model, tok)
    uids = [engine.submit(prompt(n, seed=33), **opts) for n in (5, 11)]
    for stream in collect(engine, uids):
        assert stream[-1].finish_reason == "error" and "planted step fault" in stream[-1].error
    assert engine.active == 0
    uid = engine.submit(prompt(7, seed=34), **opts)
    assert_same_stream(collect(engine, [uid])[0], solo(model, tok, prompt(7, seed=34), **opts), "after the fault")


# 8. bad input fails before any work, as one InvalidOptionError naming the problem


@pytest.mark.parametrize("max_batch", [0, -1, 2.5, True, "4"])
def test_bad_max_batch(loaded, max_batch):
    model, tok = loaded
    rejected("max_batch", lambda: BatchGenerator(model, tok, max_batch=max_batch))
    rejected("max_batch", lambda: mlxinfer.batch_generate(model, tok, [prompt(3)], max_batch=max_batch))


def test_bad_input_is_rejected_and_the_engine_still_works(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    rejected("temprature", lambda: engine.submit(prompt(3), temprature=0.5))
    rejected("empty", lambda: engine.submit([]))
    rejected("empty", lambda: engine.submit(""))
    rejected("temperature", lambda: engine.submit(prompt(3), temperature=-1.0))
    rejected("max_tokens", lambda: engine.submit(prompt(3), max_tokens=-1))
    rejected("prompt", lambda: engine.submit([1, 2, 10**6]))
    rejected("context", lambda: engine.submit(prompt(model.config.max_position_embeddings + 1)))
    assert engine.active == 0
    uid = engine.submit(prompt(6), **GREEDY)
    assert_same_stream(collect(engine, [uid])[0], solo(model, tok, prompt(6), **GREEDY), "after rejections")


def test_batch_generate_rejects_before_any_work(loaded):
    model, tok = loaded
    rejected("temprature", lambda: mlxinfer.batch_generate(model, tok, [prompt(3)], temprature=0.5))
    rejected("empty", lambda: mlxinfer.batch_generate(model, tok, [prompt(3), []], max_tokens=2))
    rejected("prefill_step", lambda: mlxinfer.batch_generate(model, tok, [prompt(3)], prefill_step=0))
    rejected("kv_bits", lambda: BatchGenerator(model, tok, kv_bits=3))


# 9. a prompt-cache pool: a later request extending an earlier one prefills only what is new


def test_pool_reuses_a_finished_sequences_prefix(loaded):
    model, tok = loaded
    pool = mlxinfer.PromptCachePool(max_bytes=64 * 2**20)
    engine = BatchGenerator(model, tok, pool=pool)
    first = prompt(40, seed=11)
    (one,) = collect(engine, [engine.submit(first, **GREEDY)])
    follow_up = first + tokens_of(one) + prompt(6, seed=12)
    other = prompt(30, seed=13)
    uids = [engine.submit(follow_up, **GREEDY), engine.submit(other, **GREEDY)]
    got = collect(engine, uids)
    assert_same_stream(got[0], solo(model, tok, follow_up, **GREEDY), "follow-up from the pool")
    assert_same_stream(got[1], solo(model, tok, other, **GREEDY), "unrelated prompt")
    assert got[0][-1].stats.prefill_tokens <= 7, "the follow-up prefilled what the pool held"
    assert got[1][-1].stats.prefill_tokens == len(other)
    assert pool.stats.hits == 1 and pool.stats.misses == 2 and pool.stats.reused_tokens >= len(first)
    assert 0 < pool.stats.nbytes <= 64 * 2**20
