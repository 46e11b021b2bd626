"""Sampling filters against numpy implementations of their definitions, and
draw frequencies against the filtered distribution (chi-square, fixed seed); rows
that are not finite against their limit written in numpy, through the sampler, the
fused reference and the Metal kernel (compiled and run on the CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.kernels import sampling
from mlxinfer.kernels.emulate import build, compiler
from mlxinfer.decode.sample import NO_TOKEN, Sampler, SamplingConfig, filtered_probs


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


# ---- rows that are not finite ---------------------------------------------------------------------------------

inf, nan = np.inf, np.nan
NON_FINITE = np.array([
    [nan, 1.0, 2.0, nan, 0.5, -inf, 1.5, 0.0],  # NaN supports nothing: as -inf
    [1.0, inf, 3.0, nan, inf, -inf, inf, 2.0],  # three +inf: even odds among them, nothing else
    [3e38, 2.9e38, -3e38, 1e38, -inf, nan, 3e38, 0.0],  # finite, at float32's edge
    [-inf] * 8,  # nothing left to draw from ...
    [nan] * 8,
    [nan, -inf, nan, -inf, -inf, nan, -inf, nan],
], np.float32)
EMPTY = [3, 4, 5]
DRAWN = [i for i in range(len(NON_FINITE)) if i not in EMPTY]
EXTREME = {
    "temperature": SamplingConfig(temperature=0.7),
    "cold": SamplingConfig(temperature=1e-6),  # a finite logit over it overflows float32
    "combined": SamplingConfig(temperature=0.8, top_k=3, top_p=0.9, min_p=0.02),
}


def np_limit(logits: np.ndarray) -> np.ndarray:
    """The definition: NaN is -inf; a row holding +inf is the limit of softmax as those logits
    grow (0 at each +inf, -inf elsewhere); rows of finite numbers as they are (in float64)."""
    x = np.where(np.isnan(logits), -inf, logits.astype(np.float64))
    top = x == inf
    return np.where(top.any(-1, keepdims=True), np.where(top, 0.0, -inf), x)


def test_greedy_takes_the_limits_argmax_and_no_token_from_an_empty_row():
    tokens = np.array(Sampler(SamplingConfig())(mx.array(NON_FINITE))).tolist()
    expected = [NO_TOKEN if i in EMPTY else int(np.argmax(np_limit(NON_FINITE[i]))) for i in range(len(NON_FINITE))]
    assert tokens == expected


@pytest.mark.parametrize("name", sorted(EXTREME))
def test_filtered_distribution_of_non_finite_rows_is_their_limits(name):
    cfg = EXTREME[name]
    ours = np.array(filtered_probs(mx.array(NON_FINITE), cfg))
    np.testing.assert_allclose(ours[DRAWN], np_filtered(np_limit(NON_FINITE[DRAWN]), cfg), atol=1e-6)
    assert not ours[EMPTY].any(), "a row with nothing to draw from has no distribution"


@pytest.mark.parametrize("name", sorted(EXTREME))
def test_draws_from_non_finite_rows_follow_their_limits(name):
    """Every draw is a token the limit distribution gives mass to (chi-square where it
    gives mass to several); an empty row draws NO_TOKEN, never token 0."""
    cfg = SamplingConfig(**{**EXTREME[name].__dict__, "seed": 99})
    draws = 3000
    for i, row in enumerate(NON_FINITE):
        tokens = np.array(Sampler(cfg)(mx.broadcast_to(mx.array(row[None]), (draws, row.size))))
        if i in EMPTY:
            assert (tokens == NO_TOKEN).all(), f"row {i}"
            continue
        expected = np_filtered(np_limit(row[None]), cfg)[0]
        assert tokens.min() >= 0 and expected[tokens].min() > 0, f"row {i}: drew a token of no mass"
        support = expected > 0
        if support.sum() > 1:
            counts = np.bincount(tokens, minlength=row.size)[support]
            assert stats.chisquare(counts, expected[support] * draws).pvalue > 1e-3, f"row {i}"


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) to build the Metal emulation")
def test_metal_kernel_draws_non_finite_rows_as_the_reference_does(tmp_path):
    """The Metal source, compiled for the CPU: NaN, +inf and empty rows as the reference reads
    them, token for token, at the same uniforms."""
    rng = np.random.default_rng(10)
    logits = mx.array(np.repeat(NON_FINITE, 4, axis=0))
    emulated = None
    for params in (sampling.SamplingParams(0.7), sampling.SamplingParams(1e-6), sampling.SamplingParams(0.8, 3, 0.9),
                   sampling.SamplingParams(1.0, min_p=0.1)):
        for _ in range(3):
            u = mx.array(rng.random(logits.shape[0]).astype(np.float32))
            launch = sampling.launch(logits, u, params, threads=64)
            emulated = emulated or build(sampling.KERNEL, launch, tmp_path)
            got = emulated.run(launch)[0]
            assert got.tolist() == np.array(sampling.reference(logits, u, params)).tolist(), params
            rows = np.repeat(np.arange(len(NON_FINITE)), 4)
            assert all((got[j] == NO_TOKEN) == (rows[j] in EMPTY) for j in range(got.size))
            limit = np_limit(np.array(logits))
            assert all(np.isfinite(limit[j, got[j]]) for j in range(got.size) if got[j] != NO_TOKEN)

