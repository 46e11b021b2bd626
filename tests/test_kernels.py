"""Kernels: references against numpy implementations of the definitions; the Metal
sources assembled exactly as MLX assembles them (checked against MLX's own
generated source), compiled as C++17 against the Metal shim and executed over
small grids on the CPU, against the references; dispatch and `mlxinfer doctor`."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats
from test_sample import np_filtered

from mlxinfer import kernels
from mlxinfer.cli import doctor
from mlxinfer.cli.main import main
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.kernels import attention, sampling, verification
from mlxinfer.kernels.common import inverse_cdf
from mlxinfer.kernels.emulate import build, compiler
from mlxinfer.kernels.metal import Launch, MetalKernel
from mlxinfer.decode.sample import SamplingConfig

needs_cxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) to build the Metal emulation")


# ---- numpy definitions ---------------------------------------------------------------------------------------

def np_dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Affine groups: element i of a row is bits-wide field i % (32/bits) of word i // (32/bits), low bits first."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    levels = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    levels = levels.reshape(*packed.shape[:-1], -1).astype(np.float64)
    return levels * np.repeat(scales, group, axis=-1) + np.repeat(biases, group, axis=-1)


def np_attention(q, k, v, scale, allowed):
    """softmax(q k^T * scale) v over allowed keys; q [B, H, T, D], k/v [B, Hkv, S, D], allowed [T, S]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), k) * scale
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bhsd->bhtd", w / w.sum(-1, keepdims=True), v)


def np_draw(weights: np.ndarray, u: float) -> int:
    """The first index whose running sum exceeds u * total."""
    running = np.cumsum(weights.astype(np.float64))
    return int(np.searchsorted(running, u * running[-1], side="right"))


def np_verify(p, drafts, q, u):
    """The speculative sampling rule, step by step."""
    n = 0
    for i, x in enumerate(drafts):
        qx = 1.0 if q is None else q[i, x]
        if not u[i] < p[i, x] / qx:
            break
        n += 1
    if n == len(drafts):
        weights = p[n]
    else:
        draft = np.eye(p.shape[1])[drafts[n]] if q is None else q[n]
        weights = np.maximum(p[n] - draft, 0)
        weights = weights if weights.sum() > 0 else p[n]
    return n, np_draw(weights, u[len(drafts)])


# ---- random inputs -------------------------------------------------------------------------------------------

def ring_cache(rng, bits=4, group=32, B=2, H=4, Hkv=2, T=3, D=64, capacity=40, length=37, window=20, keep=2):
    """A quantized ring buffer: `length` live slots of `capacity`, holding token positions out of order
    (sinks first, then a rotated window), and the rotating cache's mask for T new queries."""
    newest = 100
    kept = np.concatenate([np.arange(keep), np.arange(newest - (length - keep), newest)])
    slots = np.concatenate([kept[:keep], np.roll(kept[keep:], 7)])
    qpos = np.arange(newest - T, newest)
    allowed = (slots[None] <= qpos[:, None]) & ((slots[None] < keep) | (slots[None] > qpos[:, None] - window))
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, capacity, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, capacity, D)).astype(np.float32)
    kq = tuple(mx.quantize(mx.array(k), group_size=group, bits=bits))
    vq = tuple(mx.quantize(mx.array(v), group_size=group, bits=bits))
    return q, kq, vq, allowed, length


def sampling_rows(rng, B=8, V=300):
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    logits[1, :40] = logits[1, 0]  # ties at the top: every cut-off falls inside a tie
    logits[2, ::3] = -np.inf       # tokens already excluded (logit bias)
    return mx.array(logits), mx.array(rng.random(B).astype(np.float32))


SAMPLING = [sampling.SamplingParams(0.7), sampling.SamplingParams(1.0, top_k=5), sampling.SamplingParams(1.0, top_k=45),
            sampling.SamplingParams(1.3, top_p=0.8), sampling.SamplingParams(1.0, min_p=0.1),
            sampling.SamplingParams(0.8, 12, 0.9, 0.02)]


def verify_trials(rng, V=50, trials=40):
    for i in range(trials):
        k = i % 5
        p = rng.dirichlet(np.full(V, 0.3), size=k + 1).astype(np.float32)
        q = None if i % 2 else rng.dirichlet(np.full(V, 0.3), size=max(k, 1))[:k].astype(np.float32)
        if q is not None and k:
            drafts = [int(rng.choice(V, p=q[j] / q[j].sum())) for j in range(k)]
        else:
            drafts = [int(np.argmax(p[j])) if i % 4 == 1 else int(rng.integers(V)) for j in range(k)]
        if i == 3:
            p[0] = np.eye(V)[drafts[0]]  # p == one-hot q: residual all zero, falls back to p
            drafts[0] = int(np.argmax(p[0]))
        yield p, drafts, q, rng.random(k + 1).astype(np.float32)


# ---- references against the definitions ---------------------------------------------------------------------

@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_attention_reference_reads_the_ring_in_place(bits, group):
    rng = np.random.default_rng(0)
    q, kq, vq, allowed, length = ring_cache(rng, bits=bits, group=group)
    k, v = (np_dequantize(*(np.array(a) for a in parts), bits, group) for parts in (kq, vq))
    np.testing.assert_allclose(k, np.array(mx.dequantize(*kq, group_size=group, bits=bits)), atol=1e-5)
    expected = np_attention(q, k[:, :, :length], v[:, :, :length], 0.125, allowed)
    got = attention.reference(mx.array(q), kq, vq, 0.125, mx.array(allowed), group, bits, length)
    np.testing.assert_allclose(np.array(got), expected, atol=2e-5)


def test_attention_reference_causal_string_mask():
    rng = np.random.default_rng(1)
    q, kq, vq, _, length = ring_cache(rng, bits=8, group=64, length=40)
    k, v = (np_dequantize(*(np.array(a) for a in parts), 8, 64) for parts in (kq, vq))
    causal = np.arange(length)[None] <= np.arange(length - 3, length)[:, None]
    got = kernels.quantized_attention(mx.array(q), kq, vq, 0.125, "causal", 64, 8)
    np.testing.assert_allclose(np.array(got), np_attention(q, k, v, 0.125, causal), atol=2e-5)


def test_inverse_cdf_is_the_definition():
    rng = np.random.default_rng(2)
    w = rng.random((50, 30)).astype(np.float32) * (rng.random((50, 30)) < 0.5)
    w[0] = 0
    w[0, 7] = 1  # a single token
    u = rng.random(50).astype(np.float32)
    got = np.array(inverse_cdf(mx.array(w), mx.array(u)))
    assert got.tolist() == [np_draw(w[i], u[i]) for i in range(50)]
    assert np.array(inverse_cdf(mx.array(w[:1]), mx.array([0.9999999], mx.float32))).tolist() == [7]


@pytest.mark.parametrize("params", [s for s in SAMPLING if s.top_k <= 30], ids=str)
def test_sampling_reference_follows_the_filtered_distribution(params):
    logits = np.random.default_rng(3).standard_normal((1, 30)).astype(np.float32) * 0.7
    cfg = SamplingConfig(params.temperature, params.top_p, params.top_k, params.min_p)
    expected = np_filtered(logits, cfg)[0]
    draws = 20000
    u = mx.random.uniform(shape=(draws,), key=mx.random.key(5))
    counts = np.bincount(np.array(sampling.reference(mx.broadcast_to(mx.array(logits), (draws, 30)), u, params)),
                         minlength=30)
    assert counts[expected == 0].sum() == 0, "drew a token the filters exclude"
    keep = expected > 0
    chi2 = stats.chisquare(counts[keep], expected[keep] * draws)
    assert chi2.pvalue > 1e-3


def test_verify_reference_is_the_rule():
    for p, drafts, q, u in verify_trials(np.random.default_rng(4)):
        got = verification.reference(mx.array(p), drafts, None if q is None else mx.array(q), mx.array(u))
        assert tuple(np.array(got).tolist()) == np_verify(p, drafts, q, u)


# ---- dispatch ------------------------------------------------------------------------------------------------

def test_selection_honours_setting_metal_and_disabling(monkeypatch):
    monkeypatch.setattr(kernels, "metal_available", lambda: False)
    assert set(kernels.selection().values()) == {"reference"}
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    assert set(kernels.selection().values()) == {"metal"}
    monkeypatch.setenv("MLXINFER_KERNELS", "reference")
    assert set(kernels.selection().values()) == {"reference"}
    monkeypatch.setenv("MLXINFER_KERNELS", "auto")
    kernels.disable("sampling", "test")
    try:
        assert kernels.selection() == {"attention": "metal", "sampling": "reference", "verify": "metal"}
    finally:
        kernels.enable_all()
    monkeypatch.setenv("MLXINFER_KERNELS", "fast")
    with pytest.raises(InvalidOptionError, match="MLXINFER_KERNELS"):
        kernels.selection()


def test_dispatchers_call_the_kernel_when_selected(monkeypatch):
    """With Metal 'available', each dispatcher routes to the kernel (stubbed here), except shapes it does not take."""
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(kernels, "_checked", set(kernels.NAMES))  # self-checks done: count only real calls
    called = []
    for module in (attention, sampling, verification):
        monkeypatch.setattr(module, "metal", lambda *a, m=module: called.append(m.__name__) or m.reference(*a))
    rng = np.random.default_rng(5)
    q, kq, vq, allowed, length = ring_cache(rng)
    kernels.quantized_attention(mx.array(q), kq, vq, 0.1, mx.array(allowed), 32, 4, length)
    kernels.quantized_attention(mx.array(np.repeat(q, 4, axis=2)), kq, vq, 0.1, None, 32, 4, length)  # 12 queries
    kernels.sample(*sampling_rows(rng), SAMPLING[0])
    kernels.verify(mx.array(rng.dirichlet(np.ones(9), 2).astype(np.float32)), [3], None, mx.array([0.5, 0.5]))
    assert [c.rsplit(".", 1)[1] for c in called] == ["attention", "sampling", "verification"]


def test_first_use_self_check_disables_a_wrong_kernel(monkeypatch):
    """Before a process first runs a kernel it is checked against the reference; a wrong one (stubbed
    'Metal' sampling kernel off by one token) is disabled with a warning and the reference answers."""
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(kernels, "_checked", set())
    monkeypatch.setattr(sampling, "metal", lambda *a: (sampling.reference(*a) + 1) % a[0].shape[-1])
    monkeypatch.setattr(verification, "metal", lambda *a: verification.reference(*a))
    rng = np.random.default_rng(6)
    logits, u = sampling_rows(rng)
    try:
        with pytest.warns(RuntimeWarning, match="kernel 'sampling' disagrees"):
            tokens = kernels.sample(logits, u, SAMPLING[0])
        assert np.array_equal(np.array(tokens), np.array(sampling.reference(logits, u, SAMPLING[0])))
        p = mx.array(rng.dirichlet(np.ones(9), 2).astype(np.float32))
        kernels.verify(p, [3], None, mx.array([0.5, 0.5]))  # a right kernel passes its check silently
        assert kernels.selection() == {"attention": "metal", "sampling": "reference", "verify": "metal"}
        assert kernels._checked == {"sampling", "verify"}
    finally:
        kernels.enable_all()


# ---- the Metal sources: assembled as MLX does, compiled and run on the CPU -----------------------------------

def mlx_generated_source(kernel: MetalKernel, launch: Launch, capfd, folder) -> str:
    """The source MLX itself generates for this launch: without Metal it still builds it while exporting
    a function (verbose prints it), which is all we need from it."""
    def call(*inputs):
        return kernel._kernel(inputs=list(inputs), template=list(launch.template), grid=launch.grid,
                              threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
                              output_dtypes=launch.output_dtypes, verbose=True)

    capfd.readouterr()
    mx.export_function(str(folder / "kernel.mlxfn"), call, *launch.inputs)
    printed = capfd.readouterr().out
    return re.search(r"```\n(.*)\n```", printed, re.DOTALL).group(1)


def attention_launches(rng):
    for bits, group, D, masked in [(4, 32, 64, True), (8, 64, 128, False)]:
        q, kq, vq, allowed, length = ring_cache(rng, bits=bits, group=group, D=D)
        args = (mx.array(q), kq, vq, 0.125, mx.array(allowed) if masked else None, group, bits, length)
        yield args, attention.launch(*args, simdgroups=2)


@needs_cxx
def test_assembled_source_is_what_mlx_generates(capfd, tmp_path):
    rng = np.random.default_rng(6)
    launches = [(attention.KERNEL, launch) for _, launch in attention_launches(rng)]
    launches.append((sampling.KERNEL, sampling.launch(*sampling_rows(rng), SAMPLING[-1], threads=64)))
    p = mx.array(rng.dirichlet(np.ones(20), 3).astype(np.float32))
    launches.append((verification.KERNEL, verification.launch(p, [1, 2], None, mx.array([0.1, 0.2, 0.3]), 64)))
    for kernel, launch in launches:
        assert kernel.assemble(launch).source.strip() == mlx_generated_source(kernel, launch, capfd, tmp_path).strip()


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@needs_cxx
def test_attention_kernel_emulated(builds):
    for args, launch in attention_launches(np.random.default_rng(7)):
        got = build(attention.KERNEL, launch, builds).run(launch)[0]
        np.testing.assert_allclose(got, np.array(attention.reference(*args)), atol=1e-5)


@needs_cxx
def test_sampling_kernel_emulated(builds):
    rng = np.random.default_rng(8)
    logits, u = sampling_rows(rng)
    emulated = None
    for params in SAMPLING:
        launch = sampling.launch(logits, u, params, threads=64)
        emulated = emulated or build(sampling.KERNEL, launch, builds)
        for draw in range(3):
            u = mx.array(rng.random(logits.shape[0]).astype(np.float32))
            launch = sampling.launch(logits, u, params, threads=64)
            assert emulated.run(launch)[0].tolist() == np.array(sampling.reference(logits, u, params)).tolist()


@needs_cxx
def test_verify_kernel_emulated(builds):
    emulated = None
    for p, drafts, q, u in verify_trials(np.random.default_rng(9)):
        args = (mx.array(p), drafts, None if q is None else mx.array(q), mx.array(u))
        launch = verification.launch(*args, threads=64)
        emulated = emulated or build(verification.KERNEL, launch, builds)
        assert emulated.run(launch)[0].tolist() == np.array(verification.reference(*args)).tolist()


@needs_cxx
def test_emulation_catches_a_barrier_not_every_thread_reaches(builds):
    body = """
  threadgroup float shared[64];
  shared[thread_position_in_threadgroup.x] = x[thread_position_in_grid.x];
  if (thread_position_in_threadgroup.x < 16) metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  out[thread_position_in_grid.x] = shared[0];
"""
    bad = MetalKernel("divergent_barrier", ("x",), ("out",), body)
    launch = Launch([mx.zeros(64)], [], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32])
    with pytest.raises(RuntimeError, match="barrier"):
        build(bad, launch, builds).run(launch)


# ---- mlxinfer doctor -----------------------------------------------------------------------------------------

def test_doctor_on_linux_reports_references():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "MLX:" in result.output and mx.__version__ in result.output
    assert "reference implementations are in use" in result.output


def test_doctor_disables_a_kernel_that_disagrees(monkeypatch):
    """On 'Metal' (stubbed: the kernels are the references, one deliberately off) the broken one is disabled
    and its dispatcher falls back to the reference."""
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(attention, "metal", lambda *a: attention.reference(*a))
    monkeypatch.setattr(verification, "metal", lambda *a: verification.reference(*a))
    monkeypatch.setattr(sampling, "metal", lambda *a: (sampling.reference(*a) + 1) % a[0].shape[-1])
    monkeypatch.setattr(doctor.mx, "device_info", lambda: {"device_name": "stub", "memory_size": 2**34,
                                                           "max_recommended_working_set_size": 2**33})
    monkeypatch.setattr(doctor.mx, "set_wired_limit", lambda n: 0)
    try:
        lines = doctor.report(doctor.SMALL, repeat=1)
        assert kernels.selection() == {"attention": "metal", "sampling": "reference", "verify": "metal"}
    finally:
        kernels.enable_all()
    text = "\n".join(lines)
    assert "warning: kernel 'sampling' disabled" in text
    assert "unified memory:" in text and "16.0 GiB" in text
    assert "in use: attention metal, sampling reference, verify metal" in text
