"""KV caches against independent oracles: a full cache with an explicitly
windowed mask (numpy-built), the float cache for quantized ones, and direct
tensor comparison after rollback."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_cache


class SinkWindowOracle(KVCache):
    """Keeps everything and masks explicitly: sinks plus the newest `window` tokens."""

    def __init__(self, keep: int, window: int):
        super().__init__()
        self.keep, self.window = keep, window

    def make_mask(self, queries, window):
        q = np.arange(self.offset, self.offset + queries)[:, None]
        k = np.arange(self.offset + queries)[None]
        return mx.array((k <= q) & ((k < self.keep) | (k > q - self.window)))


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    m, _ = mlxinfer.load(hf_checkpoint("llama", head_dim=32, num_attention_heads=4), dtype="float32")
    return m


def run(model, caches, ids, chunks):
    out, pos = [], 0
    for n in chunks:
        out.append(model(mx.array(ids[:, pos : pos + n]), cache=caches))
        pos += n
    return np.array(mx.concatenate(out, axis=1))


CHUNKS = {
    "decode": [1] * 40,
    "prefill-longer-than-window": [20, 1, 1, 1, 9, 1, 1, 1, 1, 4],
    "mixed": [3, 1, 6, 1, 1, 2, 1, 1, 1, 1, 11, 1, 1, 1, 1, 1, 1, 1, 1, 4],
}


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("chunks", sorted(CHUNKS))
def test_rotating_cache_equals_explicit_window(model, keep, chunks):
    ids = np.random.default_rng(0).integers(0, 500, (1, 40))
    max_size = 10
    ours = run(model, [RotatingKVCache(max_size, keep) for _ in model.layers], ids, CHUNKS[chunks])
    oracle = run(model, [SinkWindowOracle(keep, max_size - keep) for _ in model.layers], ids, CHUNKS[chunks])
    np.testing.assert_allclose(ours, oracle, atol=1e-4, rtol=0)


def test_rotating_cache_window_larger_than_sequence_equals_growing(model):
    ids = np.random.default_rng(1).integers(0, 500, (2, 24))
    a = run(model, make_cache(model, max_kv_size=64), ids, [7] + [1] * 17)
    b = run(model, make_cache(model), ids, [7] + [1] * 17)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_rotating_memory_stays_flat(model):
    caches = make_cache(model, max_kv_size=16)
    ids = np.random.default_rng(2).integers(0, 500, (1, 60))
    run(model, caches, ids, [8] + [1] * 52)
    c = caches[0]
    assert c.size == 16 and c.offset == 60
    assert c.nbytes == 16 * c.bytes_per_token
    # 2 (k, v) * kv_heads * head_dim * 4 bytes
    assert c.bytes_per_token == 2 * 2 * 32 * 4


@pytest.mark.parametrize("bits,tol", [(8, 0.05), (4, 0.5)])
@pytest.mark.parametrize("rotating", [False, True])
def test_quantized_cache_close_to_float(model, bits, tol, rotating):
    ids = np.random.default_rng(3).integers(0, 500, (1, 30))
    size = 12 if rotating else None
    chunks = [9] + [1] * 21
    q = run(model, make_cache(model, max_kv_size=size, kv_bits=bits), ids, chunks)
    f = run(model, make_cache(model, max_kv_size=size), ids, chunks)
    err = np.abs(q - f).max()
    assert err < tol, f"{bits}-bit cache logits differ by {err}"
    assert err > 0, "quantized cache produced bit-identical logits: it is not quantizing"
    qc, fc = make_cache(model, kv_bits=bits)[0], KVCache()
    k = mx.random.normal((1, 2, 5, 32))
    qc.update_and_fetch(k, k), fc.update_and_fetch(k, k)
    assert qc.bytes_per_token < fc.bytes_per_token


def test_quantized_attention_matches_numpy():
    from mlxinfer.kernels import quantized_attention

    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 3, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 7, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 7, 64)).astype(np.float32)
    kq, vq = mx.quantize(mx.array(k), 64, 8), mx.quantize(mx.array(v), 64, 8)
    kd = np.array(mx.dequantize(*kq, group_size=64, bits=8))
    vd = np.array(mx.dequantize(*vq, group_size=64, bits=8))
    out = np.array(quantized_attention(mx.array(q), tuple(kq), tuple(vq), 0.125, "causal", 64, 8))
    kd, vd = np.repeat(kd, 2, axis=1), np.repeat(vd, 2, axis=1)
    s = q @ kd.transpose(0, 1, 3, 2) * 0.125
    allowed = np.arange(7)[None] <= np.arange(4, 7)[:, None]
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, p @ vd, atol=1e-5)


def dense(parts, cache) -> np.ndarray:
    if cache.bits is None:
        return np.array(parts[0])
    return np.array(mx.dequantize(*parts, group_size=cache.group_size, bits=cache.bits))


@pytest.mark.parametrize("kind", ["growing", "rotating", "quantized", "rotating-quantized"])
def test_trim_equals_never_seen(model, kind):
    """After rolling back rejected tokens, the cache holds what a cache that only
    saw the accepted tokens holds, and the model continues identically."""
    opts = {"growing": {}, "rotating": {"max_kv_size": 12}, "quantized": {"kv_bits": 8},
            "rotating-quantized": {"max_kv_size": 12, "kv_bits": 8}}[kind]
    rng = np.random.default_rng(5)
    accepted = rng.integers(0, 500, (1, 30))
    rejected = rng.integers(0, 500, (1, 4))
    a, b = make_cache(model, **opts), make_cache(model, **opts)
    run(model, a, accepted[:, :20], [14, 1, 1, 1, 1, 1, 1])
    model(mx.array(np.concatenate([accepted[:, 20:22], rejected], 1)), cache=a)
    for c in a:
        assert c.trim(4) == 4
    run(model, b, accepted[:, :22], [14, 1, 1, 1, 1, 1, 1, 2])
    for ca, cb in zip(a, b):
        assert ca.offset == cb.offset == 22
        pa, pb = ca.positions(), cb.positions()
        common = np.intersect1d(pa, pb)
        assert len(common) >= min(cb.size, ca.size)
        ia, ib = np.searchsorted(np.sort(pa), common), np.searchsorted(np.sort(pb), common)
        for sa, sb in zip(ca.state, cb.state):
            xa, xb, tol = dense(sa, ca), dense(sb, cb), 1e-5
            if ca.bits:  # chunking changes float rounding, which may flip one quantization step
                tol += float(np.array(sa[1]).max())
            np.testing.assert_allclose(xa[:, :, ia], xb[:, :, ib], atol=tol, rtol=0)
    rest = mx.array(accepted[:, 22:])
    atol = 1e-3 if opts.get("kv_bits") else 1e-4
    np.testing.assert_allclose(np.array(model(rest, cache=a)), np.array(model(rest, cache=b)), atol=atol)


def test_bad_cache_options():
    from mlxinfer.base.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError):
        QuantizedKVCache(bits=3)
    with pytest.raises(InvalidOptionError):
        RotatingKVCache(4, keep=4)
