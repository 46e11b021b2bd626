"""Out-of-range values never reach MLX: token ids (prompt ids, logit_bias keys, chat
options, saved sessions) are checked against the model's vocabulary, and every numeric
option against its type and range, each failing as one InvalidOptionError before any
work. The cases that used to crash the process run in a subprocess, so a crash fails
the test instead of killing pytest."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxinfer.engine.chat import ChatSession
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.engine.options import split_options
from mlxinfer.engine.generate import stream_generate
from mlxinfer.decode.sample import SamplingConfig

from conftest import VOCAB

ROOT = Path(__file__).resolve().parents[1]


def config_only(model) -> SimpleNamespace:
    """A stand-in that has what validation reads (the model's config, and whether it takes images)
    and nothing else: any work past validation (building a cache, running a layer) fails with
    AttributeError, not InvalidOptionError."""
    return SimpleNamespace(config=model.config, image_token_id=model.image_token_id)


def rejected(fact: str, run) -> str:
    with pytest.raises(InvalidOptionError) as e:
        run()
    message = str(e.value)
    assert fact in message and "\n" not in message, message
    return message


BAD_SAMPLING = [
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=1e-300), "temperature"),  # 1/t overflows float32: NaN logits
    (dict(top_p=math.nan), "top_p"),
    (dict(min_p=math.inf), "min_p"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=2**40), "top_k"),  # MLX slices with 32-bit integers
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-math.inf), "frequency_penalty"),
    (dict(presence_penalty=1e300), "presence_penalty"),  # inf in float32, and inf * 0 = NaN
    (dict(penalty_window="64"), "penalty_window"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(logit_bias=[(3, 1.0)]), "logit_bias"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={3: math.nan}), "logit_bias[3]"),
    (dict(logit_bias={3: "high"}), "logit_bias[3]"),
]

# Finite values that overflowed float32 in the sampler (token 0, again and again): each refused
# with the field, the value and the limit.
OUT_OF_RANGE = [
    (dict(temperature=100.5), "temperature must be 0 (greedy) or in [1e-06, 100], got 100.5"),
    (dict(repetition_penalty=1e-38), "repetition_penalty must be in [0.01, 100], got 1e-38"),
    (dict(repetition_penalty=101), "repetition_penalty must be in [0.01, 100], got 101"),
    (dict(presence_penalty=3.4e38), "presence_penalty must be in [-2, 2], got 3.4e+38"),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2], got -2.5"),
    (dict(logit_bias={3: 3e38}), "logit_bias[3] must be in [-100, 100], got 3e+38"),
    (dict(logit_bias={3: -100.5}), "logit_bias[3] must be in [-100, 100], got -100.5"),
    (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias has 301 entries; at most 300"),
]
BAD_SAMPLING += OUT_OF_RANGE


@pytest.mark.parametrize("bad,fact", BAD_SAMPLING)
def test_sampling_config_rejects(bad, fact):
    rejected(fact, lambda: SamplingConfig(**bad))


def test_seed_range_is_what_mlx_random_key_takes():
    import mlx.core as mx

    for seed in (0, 2**64 - 1):
        SamplingConfig(seed=seed)
        mx.random.key(seed)
    for seed in (-1, 2**64):
        with pytest.raises(TypeError):
            mx.random.key(seed)


BAD_GENERATION = [
    (dict(max_tokens="3"), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(max_kv_size=2.5), "max_kv_size"),
    (dict(max_kv_size=1), "max_kv_size"),
    (dict(kv_bits=3), "kv_bits"),
    (dict(kv_bits="4"), "kv_bits"),
    (dict(kv_bits=4, kv_group_size=0), "kv_group_size"),
    (dict(kv_bits=4, kv_group_size=16), "kv_group_size"),
    (dict(prefill_step=0), "prefill_step"),
    (dict(prefill_step=None), "prefill_step"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=2**40), "logprobs"),
    (dict(logprobs=1.0), "logprobs"),
    (dict(num_draft_tokens=0, prompt_lookup=True), "num_draft_tokens"),
    (dict(num_draft_tokens="4", prompt_lookup=True), "num_draft_tokens"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(prompt_lookup=1), "prompt_lookup"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(draft_cache="cache"), "draft_cache"),
    (dict(stop=[str(i) for i in range(17)]), "stop holds 17 strings; at most 16"),
    (dict(stop=["x" * 1001]), "a stop string has 1001 characters; at most 1000"),
]


@pytest.mark.parametrize("bad,fact", BAD_SAMPLING + BAD_GENERATION)
def test_stream_generate_rejects_before_any_work(loaded, bad, fact):
    model, tok = loaded
    rejected(fact, lambda: next(stream_generate(config_only(model), tok, [5, 6], **bad)))


@pytest.mark.parametrize(
    "prompt,fact",
    [([VOCAB], str(VOCAB)), ([10**7], str(10**7)), ([-5, 3], "-5"), ([3, 1.5], "1.5"), ([True], "True"),
     (["3"], "'3'"), (7, "int")],
)
@pytest.mark.parametrize("source", [{}, {"prompt_lookup": True}, {"draft_model": "TARGET"}])
def test_prompt_ids_are_checked_against_the_vocabulary(loaded, prompt, fact, source):
    """Plain and speculative decoding take their prompt through one check."""
    model, tok = loaded
    source = {k: model if v == "TARGET" else v for k, v in source.items()}
    message = rejected(fact, lambda: next(stream_generate(config_only(model), tok, prompt, **source)))
    assert "prompt" in message


@pytest.mark.parametrize("key", [VOCAB, 10**7])
def test_logit_bias_keys_are_checked_against_the_vocabulary(loaded, key):
    model, tok = loaded
    message = rejected(str(key), lambda: next(stream_generate(config_only(model), tok, [5], logit_bias={key: 5.0})))
    assert f"[0, {VOCAB})" in message
    SamplingConfig(logit_bias={key: 5.0})  # the range needs a model: split_options checks it with one
    rejected("logit_bias", lambda: split_options({"logit_bias": {key: 5.0}}, VOCAB))
    split_options({"logit_bias": {VOCAB - 1: 5.0}}, VOCAB)


def test_chat_options_are_checked_when_set(loaded, tmp_path):
    model, tok = loaded
    rejected("logit_bias", lambda: ChatSession(model, tok, logit_bias={VOCAB: 1.0}))
    session = ChatSession(model, tok, max_tokens=2)
    rejected("logit_bias", lambda: session.set_option("logit_bias", {10**7: 1.0}))
    rejected("seed", lambda: session.set_option("seed", -1))
    rejected("temperature", lambda: session.set_option("temperature", math.inf))
    session.set_option("logit_bias", {VOCAB - 1: 1.0})
    session.save(tmp_path / "chat.json")
    data = json.loads((tmp_path / "chat.json").read_text())
    for bias, fact in [({"600": 5.0}, "600"), ({"-3": 1.0}, "'-3'"), ({"x": 1.0}, "'x'"), ({"3": None}, "None")]:
        data["request"]["sampling"]["logit_bias"] = bias
        (tmp_path / "bad.json").write_text(json.dumps(data))
        rejected(fact, lambda: ChatSession.load(tmp_path / "bad.json", model, tok))


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


CRASHED_BEFORE = [
    "mlxinfer.generate(model, tok, 'hello', max_tokens=2, logit_bias={%d: 5.0})" % VOCAB,  # heap corruption
    "mlxinfer.generate(model, tok, 'hello', max_tokens=2, logit_bias={10**7: 5.0})",  # segfault
    "mlxinfer.generate(model, tok, [10**7], max_tokens=2)",  # segfault
    "mlxinfer.generate(model, tok, [-5, 3], max_tokens=2)",  # read out of range, silently
    "mlxinfer.generate(model, tok, [10**7], max_tokens=2, prompt_lookup=True)",
    "list(ChatSession(model, tok, logit_bias={10**7: 5.0}).send('hi'))",
]


@pytest.mark.parametrize("call", CRASHED_BEFORE)
def test_former_crashes_are_one_line_errors_in_a_fresh_process(tiny, call):
    done = run_python(f"""
        import mlxinfer
        from mlxinfer.engine.chat import ChatSession
        from mlxinfer.base.errors import InvalidOptionError
        model, tok = mlxinfer.load({str(tiny)!r}, dtype="float32")
        try:
            {call}
        except InvalidOptionError as e:
            print("rejected:", e)
        else:
            print("accepted")
    """)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.startswith("rejected:") and "not a token id" in done.stdout, done.stdout


def test_repl_survives_loading_a_chat_with_a_bad_bias(tiny, loaded, tmp_path):
    """`/load` of a chat whose options hold an out-of-range bias: one line, and the chat goes on."""
    model, tok = loaded
    session = ChatSession(model, tok, max_tokens=2)
    session.save(tmp_path / "bad.json")
    data = json.loads((tmp_path / "bad.json").read_text())
    data["request"]["sampling"]["logit_bias"] = {str(10**7): 5.0}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    script = f"/load {tmp_path / 'bad.json'}\nhello\n/exit\n"
    done = subprocess.run([sys.executable, "-m", "mlxinfer", "chat", "-m", str(tiny), "--temp", "0",
                           "--max-tokens", "3"], input=script, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "MLXINFER_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    errors = [line for line in done.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(10**7) in errors[0] and "logit_bias" in errors[0], done.stdout
    assert done.stdout.count("[TTFT") == 1, done.stdout  # the reply to "hello" after the failed /load


# any mix of option values: an InvalidOptionError before any work, or a generation that succeeds

INTS = st.one_of(st.integers(-3, 600), st.integers(-(2**70), 2**70))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3))
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.just([1]), st.just({}))
OPTIONS = {
    "temperature": st.one_of(FLOATS, st.just(0.0), JUNK),
    "top_p": st.one_of(FLOATS, JUNK),
    "top_k": st.one_of(INTS, JUNK),
    "min_p": st.one_of(FLOATS, JUNK),
    "repetition_penalty": st.one_of(FLOATS, JUNK),
    "presence_penalty": st.one_of(FLOATS, JUNK),
    "frequency_penalty": st.one_of(FLOATS, JUNK),
    "penalty_window": st.one_of(INTS, JUNK),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(INTS, st.text(max_size=2)), FLOATS, max_size=3), JUNK),
    "seed": st.one_of(INTS, st.integers(2**63, 2**65), JUNK),
    "max_tokens": st.one_of(st.integers(-2, 4), JUNK),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=2), JUNK),
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "max_kv_size": st.one_of(st.integers(-1, 8), JUNK),
    "kv_bits": st.one_of(st.sampled_from([2, 4, 8]), JUNK),
    "kv_group_size": st.one_of(st.sampled_from([0, 16, 32, 64]), JUNK),
    "prefill_step": st.one_of(st.integers(-1, 4), JUNK),
    "logprobs": st.one_of(INTS, JUNK),
    "num_draft_tokens": st.one_of(st.integers(-1, 6), JUNK),
    "prompt_lookup": st.one_of(st.booleans(), JUNK),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=st.fixed_dictionaries({}, optional=OPTIONS),
       prompt=st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-2, 10**8)), min_size=1, max_size=6))
def test_any_options_give_an_option_error_or_a_generation(loaded, options, prompt):
    model, tok = loaded
    try:
        chunks = list(stream_generate(model, tok, prompt, **{"max_tokens": 3, **options}))
    except InvalidOptionError as e:
        assert "\n" not in str(e)
        return
    assert all(0 <= c.token < VOCAB for c in chunks if c.token is not None)
    assert chunks[-1].finish_reason in ("stop", "length")


VALID = {
    "temperature": st.one_of(st.just(0.0), st.floats(1e-6, 100)),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.one_of(st.integers(0, 4), st.integers(VOCAB - 1, 2**31 - 1)),
    "min_p": st.floats(0, 0.99),
    "repetition_penalty": st.floats(0.01, 100),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "penalty_window": st.one_of(st.integers(1, 4), st.just(2**31 - 1)),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    "seed": st.one_of(st.integers(0, 5), st.just(2**64 - 1)),
    "max_tokens": st.integers(0, 5),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2),
    "ignore_eos": st.booleans(),
    "max_kv_size": st.integers(2, 6),
    "kv_bits": st.sampled_from([4, 8]),
    "kv_group_size": st.just(32),
    "prefill_step": st.one_of(st.integers(1, 3), st.just(2**31 - 1)),
    "logprobs": st.one_of(st.integers(0, 3), st.just(2**31 - 1)),
    "num_draft_tokens": st.one_of(st.integers(1, 6), st.just(2**31 - 1)),
    "prompt_lookup": st.booleans(),
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=st.fixed_dictionaries({}, optional=VALID),
       prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
def test_valid_options_at_their_edges_generate(loaded, options, prompt):
    """Values inside the ranges, down to the smallest rotating cache and up to the 32-bit
    limits, combined with speculation and a quantized cache, all generate, and every number
    they report is finite."""
    model, tok = loaded
    chunks = list(stream_generate(model, tok, prompt, **options))
    assert all(0 <= c.token < VOCAB for c in chunks if c.token is not None)
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(len(c.top_logprobs or ()) <= VOCAB for c in chunks)
    json.dumps([(c.logprob, c.top_logprobs) for c in chunks], allow_nan=False)
