"""The generation loop against oracles: greedy recomputation from full-sequence
logits (numpy argmax), mlx-lm's greedy generate, explicit sink-window masks; the
log-probabilities a constrained reply reports against the `regex` package's partial
matching, and a model whose logits are all NaN."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
import regex
from scipy.special import logsumexp

import mlxinfer
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.engine.prompt_file import load_prompt_cache, save_prompt_cache
from mlxinfer.decode.sources import chosen_logprobs
from mlxinfer.base.errors import InvalidOptionError, SamplingError
from mlxinfer.engine.text_stream import StopMatcher, top_logprobs
from mlxinfer.engine.generate import stream_generate

from conftest import VOCAB
from test_cache import SinkWindowOracle


def tokens_of(chunks) -> list[int]:
    return [c.token for c in chunks if c.token is not None]


def greedy_by_recompute(model, prompt: list[int], n: int, cache_factory=None) -> list[int]:
    """Recompute the whole sequence's logits at every step; take numpy's argmax."""
    seq = list(prompt)
    for _ in range(n):
        cache = cache_factory() if cache_factory else None
        logits = np.array(model(mx.array([seq]), cache=cache)[0, -1])
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


PROMPT = [5, 17, 99, 250, 3, 42, 7, 300, 12, 8]


@pytest.mark.parametrize("opts", [{}, {"max_kv_size": 64}, {"prefill_step": 3}])
def test_greedy_equals_recomputation(loaded, opts):
    model, tok = loaded
    out = tokens_of(stream_generate(model, tok, PROMPT, max_tokens=20, ignore_eos=True, **opts))
    assert out == greedy_by_recompute(model, PROMPT, 20)


def test_generating_on_two_threads_in_turn_equals_recomputation(loaded):
    """An app that generates on its main thread, then on a worker (a server's engine thread):
    MLX streams belong to the thread that made them, so each thread needs its own."""
    import threading

    model, tok = loaded
    want = greedy_by_recompute(model, PROMPT, 8)
    opts = dict(max_tokens=8, ignore_eos=True)
    got = [tokens_of(stream_generate(model, tok, PROMPT, **opts))]
    worker = threading.Thread(target=lambda: got.append(tokens_of(stream_generate(model, tok, PROMPT, **opts))))
    worker.start()
    worker.join()
    assert got == [want, want]


@pytest.mark.parametrize("prefill_step", [4, 64])
def test_greedy_small_window_equals_recomputation_over_kept_tokens(loaded, prefill_step):
    """max_kv_size=12 keeps 4 sink tokens and a window of the newest 8."""
    model, tok = loaded
    out = tokens_of(stream_generate(model, tok, PROMPT, max_tokens=20, ignore_eos=True, max_kv_size=12,
                                    prefill_step=prefill_step))
    ref = greedy_by_recompute(model, PROMPT, 20, lambda: [SinkWindowOracle(4, 8) for _ in model.layers])
    assert out == ref


def test_quantized_cache_tokens_and_logprobs_close(loaded):
    model, tok = loaded
    f = list(stream_generate(model, tok, PROMPT, max_tokens=10, ignore_eos=True))
    q = list(stream_generate(model, tok, PROMPT, max_tokens=10, ignore_eos=True, kv_bits=8))
    assert abs(f[0].logprob - q[0].logprob) < 0.05


def test_greedy_equals_mlx_lm(tiny, loaded):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tok = loaded
    ref_model, ref_tok = mlx_lm.load(str(tiny))
    ref = [r.token for r in mlx_lm.stream_generate(ref_model, ref_tok, mx.array(PROMPT), max_tokens=24,
                                                   sampler=make_sampler(0.0))]
    ours = tokens_of(stream_generate(model, tok, PROMPT, max_tokens=24, ignore_eos=True))
    assert ours[: len(ref)] == ref and len(ref) >= 1


def test_text_prompt_chat_prompt_and_stats(loaded):
    model, tok = loaded
    chunks = list(stream_generate(model, tok, [{"role": "user", "content": "hello there"}], max_tokens=6,
                                  ignore_eos=True, logprobs=3))
    expected_prompt = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=True)
    s = chunks[-1].stats
    assert s.prompt_tokens == len(expected_prompt) == s.prefill_tokens
    assert s.generated_tokens == 6 and s.finish_reason == "length" and chunks[-1].finish_reason == "length"
    assert s.ttft > 0 and s.prefill_tps > 0 and s.decode_tps > 0 and s.peak_memory > 0 and s.cache_bytes > 0
    for c in chunks:
        assert c.top_logprobs and c.top_logprobs[0][1] >= c.logprob - 1e-6
    text = mlxinfer.generate(model, tok, "hello there", max_tokens=6, ignore_eos=True)
    ids = tokens_of(stream_generate(model, tok, "hello there", max_tokens=6, ignore_eos=True))
    assert text == tok.decode(ids)


def test_eos_stops_and_is_not_emitted(loaded):
    model, tok = loaded
    free = tokens_of(stream_generate(model, tok, PROMPT, max_tokens=8, ignore_eos=True))
    eos = free[3]
    tok.eos_token_ids.insert(0, eos)
    try:
        chunks = list(stream_generate(model, tok, PROMPT, max_tokens=8))
    finally:
        tok.eos_token_ids.remove(eos)
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token == eos
    assert "".join(c.text for c in chunks) == tok.decode(free[:3])


def test_stop_string_spanning_tokens(loaded):
    model, tok = loaded
    ids = tokens_of(stream_generate(model, tok, PROMPT, max_tokens=16, ignore_eos=True))
    full = tok.decode(ids)
    assert len(full) > 6
    stop = full[3:7]
    text = mlxinfer.generate(model, tok, PROMPT, max_tokens=16, ignore_eos=True, stop=[stop])
    assert text == full[: full.index(stop)]


def test_stop_matcher_never_emits_a_stop_prefix():
    m = StopMatcher(["</end>"])
    out = [m.push(p) for p in ["hello </", "en", "d> tail"]]
    assert out == [("hello ", False), ("", False), ("", True)]
    m = StopMatcher(["ab"])
    assert m.push("xa") == ("x", False) and m.push("c") == ("ac", False)


def test_prompt_cache_reuses_prefix_and_matches_fresh(loaded, tmp_path):
    model, tok = loaded
    cache = PromptCache.for_model(model)
    first = list(stream_generate(model, tok, PROMPT, prompt_cache=cache, max_tokens=5, ignore_eos=True))
    turn2 = PROMPT + tokens_of(first) + [9, 10, 11]
    second = list(stream_generate(model, tok, turn2, prompt_cache=cache, max_tokens=5, ignore_eos=True))
    assert second[-1].stats.prefill_tokens == 4  # the last generated token (never fed) + 3 new
    fresh = tokens_of(stream_generate(model, tok, turn2, max_tokens=5, ignore_eos=True))
    assert tokens_of(second) == fresh
    # diverging prompt: trims back to the common prefix
    third = PROMPT[:6] + [1, 2]
    out = list(stream_generate(model, tok, third, prompt_cache=cache, max_tokens=5, ignore_eos=True))
    assert out[-1].stats.prefill_tokens == 2
    assert tokens_of(out) == tokens_of(stream_generate(model, tok, third, max_tokens=5, ignore_eos=True))
    # save and load: resume without re-prefill
    path = tmp_path / "chat.safetensors"
    save_prompt_cache(path, cache, {"model": "tiny"})
    loaded_cache = load_prompt_cache(path)
    assert loaded_cache.tokens == cache.tokens and loaded_cache.metadata["model"] == "tiny"
    fourth = cache.tokens + [20, 21]
    a = list(stream_generate(model, tok, fourth, prompt_cache=loaded_cache, max_tokens=5, ignore_eos=True))
    assert a[-1].stats.prefill_tokens == 2
    assert tokens_of(a) == tokens_of(stream_generate(model, tok, fourth, max_tokens=5, ignore_eos=True))


def test_rotating_prompt_cache_round_trip(loaded, tmp_path):
    model, tok = loaded
    cache = PromptCache.for_model(model, max_kv_size=12)
    list(stream_generate(model, tok, PROMPT * 2, prompt_cache=cache, max_tokens=4, ignore_eos=True))
    save_prompt_cache(tmp_path / "r.safetensors", cache)
    again = load_prompt_cache(tmp_path / "r.safetensors")
    nxt = cache.tokens + [33, 34]
    a = tokens_of(stream_generate(model, tok, nxt, prompt_cache=cache, max_tokens=6, ignore_eos=True))
    b = tokens_of(stream_generate(model, tok, nxt, prompt_cache=again, max_tokens=6, ignore_eos=True))
    assert a == b


@pytest.mark.parametrize(
    "kwargs,fact",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=PROMPT, temperature=-1), "temperature"),
        (dict(prompt=PROMPT, top_p=2.0), "top_p"),
        (dict(prompt=PROMPT, max_tokens=-1), "max_tokens"),
        (dict(prompt=PROMPT, bogus=1), "bogus"),
        (dict(prompt=PROMPT, kv_bits=3), "kv_bits"),
    ],
)
def test_bad_input(loaded, kwargs, fact):
    model, tok = loaded
    with pytest.raises(InvalidOptionError) as e:
        list(stream_generate(model, tok, **kwargs))
    assert fact in str(e.value) and "\n" not in str(e.value)


def test_prompt_longer_than_context(hf_checkpoint):
    model, tok = mlxinfer.load(hf_checkpoint("llama", max_position_embeddings=16))
    with pytest.raises(InvalidOptionError) as e:
        list(stream_generate(model, tok, list(range(1, 30)), max_tokens=2))
    msg = str(e.value)
    assert "29" in msg and "16" in msg and "--max-kv-size" in msg
    out = list(stream_generate(model, tok, list(range(1, 30)), max_tokens=2, max_kv_size=8, ignore_eos=True))
    assert out[-1].stats.generated_tokens == 2


@pytest.mark.parametrize("rep,pres,freq,bias", [
    (1.5, 0.3, 0.2, {}),
    (0.01, -2.0, -2.0, {7: 100.0, 300: -100.0}),  # every option at the end of its range: nothing overflows
    (100.0, 2.0, 2.0, {7: -100.0, 300: 100.0}),
])
def test_greedy_with_penalties_equals_numpy_recomputation(loaded, rep, pres, freq, bias):
    model, tok = loaded
    window = 6
    seq = list(PROMPT)
    for _ in range(12):
        logits = np.array(model(mx.array([seq]))[0, -1], dtype=np.float64)
        counts = np.bincount(seq[-window:], minlength=logits.size)
        seen = counts > 0
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
        logits -= pres * seen + freq * counts
        for t, b in bias.items():
            logits[t] += b
        seq.append(int(logits.argmax()))
    chunks = list(stream_generate(model, tok, PROMPT, max_tokens=12, ignore_eos=True, repetition_penalty=rep,
                                  presence_penalty=pres, frequency_penalty=freq, penalty_window=window,
                                  logit_bias=bias, logprobs=3))
    assert tokens_of(chunks) == seq[len(PROMPT):]
    json.dumps([(c.logprob, c.top_logprobs) for c in chunks], allow_nan=False)


# ---- log-probabilities are finite; an empty distribution is an error, never token 0 --------------------------

def test_chosen_and_top_logprobs_of_non_finite_rows_are_their_limits():
    """Against numpy's log-softmax of each row's limit (NaN as -inf, +inf rows even among
    their +inf): the drawn token's log-probability is finite, and the top list holds only
    tokens that could be drawn."""
    inf, nan = np.inf, np.nan
    rows = np.array([[nan, 1.0, 2.0, -inf, 0.5], [1.0, inf, nan, inf, -inf], [-inf, 3.0, -inf, -inf, -inf]], np.float32)
    limit = np.where(np.isnan(rows), -inf, rows.astype(np.float64))
    limit[1] = np.where(limit[1] == inf, 0.0, -inf)
    expected = limit - logsumexp(limit, axis=-1, keepdims=True)
    tokens = np.array([2, 3, 1])
    chosen, whole = chosen_logprobs(mx.array(rows), mx.array(tokens))
    np.testing.assert_allclose(np.array(chosen), expected[np.arange(3), tokens], atol=1e-6)
    for i in range(3):
        top = top_logprobs(whole[i], 5)
        legal = np.isfinite(expected[i])
        assert len(top) == legal.sum() and all(legal[t] for t, _ in top)
        np.testing.assert_allclose([lp for _, lp in top], np.sort(expected[i][legal])[::-1], atol=1e-6)


PATTERN = "[qz]+"  # in the test tokenizer, exactly two tokens spell only q and z: "q" and "z"
REGEX = {"type": "regex", "pattern": PATTERN}


def legal_after(tok, text: str) -> set[int]:
    """What may follow `text` under PATTERN, by the `regex` package: a token whose text keeps
    a partial match, and end of sequence once the text matches whole."""
    ends = set(tok.eos_token_ids) if re.fullmatch(PATTERN, text) else set()
    spelled = {t: tok.decode([t]) for t in range(VOCAB)}
    return ends | {t for t, s in spelled.items() if s and regex.fullmatch(PATTERN, text + s, partial=True)}


def check_constrained_logprobs(tok, chunks, k: int) -> None:
    """Every token's log-probability and top list finite (JSON without NaN or Infinity), and
    the top list exactly the legal tokens when fewer than k are legal."""
    text, seen = "", 0
    for c in chunks:
        if c.token is None:
            continue
        json.dumps({"logprob": c.logprob, "top": c.top_logprobs}, allow_nan=False)
        legal = legal_after(tok, text)
        assert len(legal) < k and c.token in legal
        assert {t for t, _ in c.top_logprobs} == legal, (text, c.top_logprobs)
        assert c.top_logprobs[0][1] >= c.logprob - 1e-6
        text += tok.decode([c.token]) if c.token not in tok.eos_token_ids else ""
        seen += 1
    assert seen >= 2


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}])
def test_constrained_logprobs_list_only_legal_tokens(loaded, sampling):
    model, tok = loaded
    chunks = list(stream_generate(model, tok, PROMPT, max_tokens=6, logprobs=5, response_format=REGEX, **sampling))
    check_constrained_logprobs(tok, chunks, 5)


def test_batched_constrained_logprobs_list_only_legal_tokens(loaded):
    """Beside an unconstrained sequence, so the masked row goes through the batched step."""
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    held = engine.submit(PROMPT, max_tokens=6, logprobs=5, response_format=REGEX)
    free = engine.submit(PROMPT[::-1], max_tokens=6, logprobs=5, ignore_eos=True)
    chunks: dict[int, list] = {held: [], free: []}
    for uid, chunk in engine.stream():
        chunks[uid].append(chunk)
    check_constrained_logprobs(tok, chunks[held], 5)
    assert all(len(c.top_logprobs) == 5 for c in chunks[free] if c.token is not None)


class NaNLogits:
    """The model, but every logit NaN (what a float16 model whose activations overflowed gives)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs) * float("nan")


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "seed": 1}, {"response_format": REGEX}],
                         ids=["greedy", "sampled", "constrained"])
def test_an_empty_distribution_ends_the_generation_with_an_error(loaded, options):
    model, tok = loaded
    chunks = []
    with pytest.raises(SamplingError, match="sampling distribution is empty") as e:
        for chunk in stream_generate(NaNLogits(model), tok, PROMPT, max_tokens=4, **options):
            chunks.append(chunk)
    assert chunks == [] and "\n" not in str(e.value)



@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "seed": 1}, {"response_format": REGEX}],
                         ids=["greedy", "sampled", "constrained"])
def test_an_empty_distribution_ends_a_batched_sequence_with_an_error(loaded, options):
    model, tok = loaded
    engine = BatchGenerator(NaNLogits(model), tok)
    engine.submit(PROMPT, max_tokens=3, **options)
    chunks = [chunk for _, chunk in engine.stream()]
    assert [(c.token, c.finish_reason) for c in chunks] == [(None, "error")]
    assert "sampling distribution is empty" in chunks[0].error
