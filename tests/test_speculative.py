"""Speculative decoding: greedy output identical to plain greedy, sampled output
distributed as the target's filtered distribution (chi-square against an
independent numpy computation), exact cache rollback for every cache type."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as scipy_stats

import mlxinfer
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.decode.sample import Sampler, SamplingConfig
from mlxinfer.decode.speculative import DraftLength, PromptLookup, verify
from mlxinfer.engine.generate import stream_generate

from test_sample import np_filtered


def tokens_of(chunks):
    return [c.token for c in chunks]


@pytest.fixture(scope="module")
def target(loaded):
    return loaded


@pytest.fixture(scope="module")
def other_draft(hf_checkpoint):
    model, _ = mlxinfer.load(hf_checkpoint("llama", head_dim=32, num_hidden_layers=1, seed=7), dtype="float32")
    return model


REPETITIVE = [5, 17, 99, 250, 3, 42, 7, 300, 12, 8] * 3
CACHES = {"growing": {}, "rotating": {"max_kv_size": 12}, "rotating-large": {"max_kv_size": 256}}


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("drafter", ["self", "other", "lookup"])
def test_greedy_speculation_is_exact(target, other_draft, drafter, cache):
    model, tok = target
    opts = dict(max_tokens=30, ignore_eos=True, **CACHES[cache])
    plain = tokens_of(stream_generate(model, tok, REPETITIVE, **opts))
    spec = {"self": dict(draft_model=model), "other": dict(draft_model=other_draft),
            "lookup": dict(prompt_lookup=True)}[drafter]
    chunks = list(stream_generate(model, tok, REPETITIVE, num_draft_tokens=4, **spec, **opts))
    assert tokens_of(chunks) == plain
    s = chunks[-1].stats
    assert s.drafted > 0 and s.rounds > 0
    assert s.plain_tps > 0 and s.speedup == s.decode_tps / s.plain_tps  # plain decoding was timed alongside
    assert sum(c.drafted for c in chunks) == s.accepted
    if drafter == "self":
        assert s.acceptance_rate == 1.0
    assert "".join(c.text for c in chunks) == tok.decode(plain)


@pytest.mark.parametrize("kind", ["growing", "rotating", "quantized", "rotating-quantized"])
def test_rollback_leaves_cache_as_if_only_accepted_tokens_were_seen(target, other_draft, kind):
    model, tok = target
    opts = {"growing": {}, "rotating": {"max_kv_size": 12}, "quantized": {"kv_bits": 8},
            "rotating-quantized": {"max_kv_size": 12, "kv_bits": 8}}[kind]
    cache = PromptCache.for_model(model, **opts)
    chunks = list(stream_generate(model, tok, REPETITIVE, prompt_cache=cache, draft_model=other_draft,
                                  max_tokens=20, ignore_eos=True))
    s = chunks[-1].stats
    assert s.accepted < s.drafted, "the other draft should be rejected sometimes"
    fed = REPETITIVE + tokens_of(chunks)[:-1]
    assert cache.tokens[: len(fed)] == fed[: len(cache.tokens)]
    fresh = PromptCache.for_model(model, **opts)
    model(mx.array(cache.tokens)[None], cache=fresh.caches)
    for a, b in zip(cache.caches, fresh.caches):
        assert a.offset == b.offset == len(cache.tokens)
        common = np.intersect1d(a.positions(), b.positions())
        assert len(common) >= min(a.size, b.size) - 1
        ia = np.searchsorted(np.sort(a.positions()), common)
        ib = np.searchsorted(np.sort(b.positions()), common)
        for pa, pb in zip(a.state, b.state):
            da = np.array(pa[0] if a.bits is None else mx.dequantize(*pa, group_size=a.group_size, bits=a.bits))
            db = np.array(pb[0] if b.bits is None else mx.dequantize(*pb, group_size=b.group_size, bits=b.bits))
            tol = 1e-4 + (float(np.array(pa[1]).max()) if a.bits else 0.0)
            np.testing.assert_allclose(da[:, :, ia], db[:, :, ib], atol=tol, rtol=0)


def joint_counts(samples: list[tuple[int, int]], vocab: int) -> np.ndarray:
    counts = np.zeros((vocab, vocab))
    for a, b in samples:
        counts[a, b] += 1
    return counts.ravel()


def chi2_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    n = counts.sum()
    exp = expected_probs * n
    assert counts[exp == 0].sum() == 0, "drew a token the target's filters exclude"
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    obs, e = obs[e > 0], e[e > 0]
    assert len(obs) >= 5
    chi2 = ((obs - e) ** 2 / e).sum()
    return float(scipy_stats.chi2.sf(chi2, len(obs) - 1))


@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_output_distribution_is_the_target(one_hot):
    """Fixed target rows p0, p1 and any draft: emitted (x1, x2) ~ p0 x p1."""
    rng = np.random.default_rng(0)
    V = 6
    p = rng.dirichlet(np.ones(V), size=3).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=2).astype(np.float32)
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=3))
    draft_rng = np.random.default_rng(1)
    samples = []
    for _ in range(4000):
        drafts = [int(draft_rng.choice(V, p=q[i] / q[i].sum())) for i in range(2)] if not one_hot else [1, 4]
        n, token = verify(mx.array(p), drafts, None if one_hot else mx.array(q), sampler)
        out = [*drafts[:n], token]
        samples.append((out[0], out[1]) if len(out) > 1 else None)
        if len(out) == 1:  # rejected at once: x2 comes from the next round, drawn from p1 here
            samples[-1] = (out[0], int(draft_rng.choice(V, p=p[1] / p[1].sum())))
    assert chi2_p(joint_counts(samples, V), np.outer(p[0], p[1]).ravel()) > 1e-3


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 0.95)])
@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_sampled_tokens_follow_target_distribution(hf_checkpoint, drafter, temperature, top_p):
    """End to end on a 12-token vocabulary: the joint law of the first two tokens
    equals the target's filtered distribution, computed in numpy from its logits."""
    V = 12
    model, tok = mlxinfer.load(hf_checkpoint("llama", vocab_size=V, head_dim=32), dtype="float32")
    draft, _ = mlxinfer.load(hf_checkpoint("llama", vocab_size=V, head_dim=32, num_hidden_layers=1, seed=3))
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    cfg = SamplingConfig(temperature=temperature, top_p=top_p)
    p1 = np_filtered(np.array(model(mx.array([prompt]))[0, -1:]), cfg)[0]
    nxt = np.array(model(mx.array([prompt + [t] for t in range(V)]))[:, -1])
    p2 = np.stack([np_filtered(nxt[t : t + 1], cfg)[0] for t in range(V)])
    expected = (p1[:, None] * p2).ravel()
    spec = dict(prompt_lookup=True) if drafter == "lookup" else dict(draft_model=draft)
    cache = PromptCache.for_model(model)
    samples, drafted = [], 0
    for seed in range(800):
        chunks = list(stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=2, ignore_eos=True,
                                      temperature=temperature, top_p=top_p, seed=seed, num_draft_tokens=2, **spec))
        samples.append((chunks[0].token, chunks[1].token))
        drafted += chunks[-1].stats.drafted
    assert drafted > 0
    assert chi2_p(joint_counts(samples, V), expected) > 1e-3


def test_prompt_lookup_proposals():
    lookup = PromptLookup()
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3], 3)[0] == [4, 9, 2]
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3], 1)[0] == [4]
    assert lookup.propose([1, 2, 3], 3)[0] == []
    assert lookup.propose([7, 1, 7, 2, 7], 2)[0] == [2, 7]  # most recent occurrence wins


def test_adaptive_length_follows_acceptance_and_pauses():
    length = DraftLength(8)
    length.update(4, 4)
    assert length.next() == 8  # a fully accepted round doubles k
    length.update(8, 8)
    assert length.next() == 8  # up to k_max
    length.update(8, 3)
    assert length.next() == 8  # a partly accepted round keeps it
    length.update(8, 0)
    assert length.next() == 4  # an empty one halves it
    length.update(4, 0)
    assert length.next() == 0 and length.paused == 8  # two in a row pause drafting
    length.skip(8)
    length.update(2, 0)
    length.update(1, 0)
    assert length.paused == 16  # a failed retry doubles the pause
    length.skip(16)
    length.update(1, 1)
    length.update(2, 0)
    length.update(1, 0)
    assert length.paused == 8  # an accepted token resets it


def test_bad_input(target, hf_checkpoint):
    model, tok = target
    with pytest.raises(InvalidOptionError) as e:
        list(stream_generate(model, tok, REPETITIVE, prompt_lookup=True, num_draft_tokens=0))
    assert "num_draft_tokens" in str(e.value)
    small, _ = mlxinfer.load(hf_checkpoint("llama", vocab_size=300))
    with pytest.raises(InvalidOptionError) as e:
        list(stream_generate(model, tok, REPETITIVE, draft_model=small))
    assert "300" in str(e.value) and "512" in str(e.value)
    with pytest.raises(InvalidOptionError):
        list(stream_generate(model, tok, REPETITIVE, draft_model=small, prompt_lookup=True))


def test_mode_chooser_runs_the_faster_mode_and_reprobes():
    from mlxinfer.decode.speculative import ModeChooser

    chooser = ModeChooser(probe=8, period=32, overhead=0.25)
    assert chooser.next_phase() == ("speculate", 8)
    chooser.record("speculate", 8, 1.0)  # 8 tok/s
    assert chooser.next_phase() == ("plain", 8)
    chooser.record("plain", 8, 0.8)  # 10 tok/s: a probe of speculation costs 8 * 0.25 = 2 token times
    assert chooser.next_phase() == ("plain", 32)
    chooser.record("plain", 32, 3.2)
    assert chooser.next_phase() == ("speculate", 8)
    chooser.record("speculate", 8, 1.0)  # loses again: plain's period doubles
    assert chooser.next_phase() == ("plain", 64)
    chooser.record("plain", 64, 6.4)
    assert chooser.next_phase() == ("speculate", 8)
    chooser.record("speculate", 8, 0.1)  # 80 tok/s: averages to 44, now the faster
    assert chooser.next_phase() == ("speculate", round(8 * (44 / 10 - 1) / 0.25))  # a plain probe costs 27 token times
    chooser.record("speculate", 64, 64 / 44)
    assert chooser.next_phase() == ("plain", 8)
    chooser.record("plain", 8, 8.0)  # 1 tok/s: averages to 5.5, far slower
    mode, period = chooser.next_phase()  # a re-probe of plain would cost 8 * (44/5.5 - 1) = 56 token times
    assert mode == "speculate" and period == round(56 / 0.25)
    chooser.give_up()
    assert [chooser.next_phase()[0] for _ in range(3)] == ["plain"] * 3


class Slowed:
    """A model whose every forward pass takes `delay` seconds longer."""

    def __init__(self, model, delay: float):
        self.inner, self.delay = model, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner(*args, **kwargs)


def instant(x: mx.array) -> mx.array:
    """A "model" whose step takes microseconds, however loaded the machine."""
    return mx.zeros((1, 1, 8))


@pytest.mark.timed_draft_judgement
def test_a_draft_no_cheaper_than_the_target_is_not_used(target, other_draft):
    from mlxinfer.decode.speculative import draft_can_win

    model, tok = target
    slow_target, slow_draft = Slowed(model, 0.01), Slowed(other_draft, 0.1)
    assert not draft_can_win(slow_draft, slow_target) and draft_can_win(other_draft, slow_target)
    assert draft_can_win(slow_draft, instant)  # a sub-5 ms target step is too short to judge by: the chooser decides
    opts = dict(max_tokens=20, ignore_eos=True)
    chunks = list(stream_generate(slow_target, tok, REPETITIVE, draft_model=slow_draft, **opts))
    assert tokens_of(chunks) == tokens_of(stream_generate(model, tok, REPETITIVE, **opts))
    assert chunks[-1].stats.drafted == 0 and chunks[-1].stats.plain_tps > 0
