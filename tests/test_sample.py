"""Sampling filters against numpy implementations of their definitions, and
draw frequencies against the filtered distribution (chi-square, fixed seed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mlxinfer.errors import InvalidOptionError
from mlxinfer.sample import Sampler, SamplingConfig, filtered_probs


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_filtered(logits: np.ndarray, cfg: SamplingConfig, history: np.ndarray | None = None) -> np.ndarray:
    """The definitions, one by one, in transformers' order."""
    x = logits.astype(np.float64).copy()
    if history is not None:
        for b in range(x.shape[0]):
            counts = np.bincount(history[b], minlength=x.shape[1])
            seen = counts > 0
            x[b, seen] = np.where(x[b, seen] > 0, x[b, seen] / cfg.repetition_penalty, x[b, seen] * cfg.repetition_penalty)
            x[b] -= cfg.presence_penalty * seen + cfg.frequency_penalty * counts
    for t, bias in cfg.logit_bias.items():
        x[:, t] += bias
    x = x / cfg.temperature
    if cfg.top_k:
        kth = np.sort(x, -1)[:, -cfg.top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    if cfg.top_p < 1:
        p = softmax(x)
        for b in range(x.shape[0]):
            order = np.argsort(-p[b], kind="stable")
            mass = 0.0
            keep = np.zeros(x.shape[1], bool)
            for i in order:
                if mass >= cfg.top_p:
                    break
                keep[i] = True
                mass += p[b, i]
            x[b, ~keep] = -np.inf
    if cfg.min_p:
        p = softmax(x)
        x = np.where(p >= cfg.min_p * p.max(-1, keepdims=True), x, -np.inf)
    return softmax(x)


CONFIGS = {
    "temperature": SamplingConfig(temperature=0.7),
    "top_k": SamplingConfig(temperature=1.0, top_k=5),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.8),
    "min_p": SamplingConfig(temperature=1.0, min_p=0.1),
    "combined": SamplingConfig(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
    "penalties": SamplingConfig(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    "bias": SamplingConfig(temperature=1.0, logit_bias={3: 5.0, 7: -100.0}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_filtered_distribution_matches_definition(name):
    cfg = CONFIGS[name]
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32) * 3
    history = np.random.default_rng(1).integers(0, 50, (3, 20)) if name == "penalties" else None
    ours = np.array(filtered_probs(mx.array(logits), cfg, mx.array(history) if history is not None else None))
    np.testing.assert_allclose(ours, np_filtered(logits, cfg, history), atol=1e-6)


def test_greedy_is_argmax():
    logits = np.random.default_rng(2).standard_normal((4, 100)).astype(np.float32)
    tokens = np.array(Sampler(SamplingConfig())(mx.array(logits)))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "combined"])
def test_sample_frequencies_follow_filtered_distribution(name):
    cfg = CONFIGS[name]
    logits = np.random.default_rng(3).standard_normal((1, 30)).astype(np.float32) * 0.7
    expected = np_filtered(logits, cfg)[0]
    sampler = Sampler(SamplingConfig(**{**cfg.__dict__, "seed": 1234}))
    draws = 20000
    batch = mx.broadcast_to(mx.array(logits), (draws, 30))
    counts = np.bincount(np.array(sampler(batch)), minlength=30)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the filters excluded"
    f_exp = expected * draws
    big = f_exp >= 5  # pool rare tokens into one bin, as the test requires
    obs = np.append(counts[big], counts[~big].sum()).astype(np.float64)
    exp = np.append(f_exp[big], f_exp[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert len(obs) >= 4, "distribution too peaked for the test to mean anything"
    exp = exp * obs.sum() / exp.sum()
    chi2 = (((obs - exp) ** 2) / exp).sum()
    p = stats.chi2.sf(chi2, df=len(obs) - 1)
    assert p > 1e-3, f"chi-square p={p:.2e}"


def test_same_seed_same_tokens():
    logits = mx.array(np.random.default_rng(4).standard_normal((1, 100)).astype(np.float32))
    cfg = SamplingConfig(temperature=1.0, seed=7)
    s1, s2 = Sampler(cfg), Sampler(cfg)
    a = [s1(logits).item() for _ in range(20)]
    b = [s2(logits).item() for _ in range(20)]
    assert a == b and len(set(a)) > 1


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1), dict(min_p=-0.1),
     dict(repetition_penalty=0)],
)
def test_bad_values_rejected(bad):
    with pytest.raises(InvalidOptionError) as e:
        SamplingConfig(**bad)
    assert list(bad)[0] in str(e.value)
