"""The CPU extension's tiled attention (`attention`: the fused layer's and the per-op decode path's)
against two independent oracles: numpy in float64 (softmax of the masked scores, each query over
the slots up to its own position, the last `window` of them with a window), and MLX's own
`mx.fast.scaled_dot_product_attention`. Then what the kernel promises beyond the numbers: every
loop (AVX-512, AVX2, scalar) the same bits, a row the same alone or batched and on any number of
threads, and a position the same whether it comes in a prompt chunk or a decode step.

Shapes sit at the kernel's edges: 32-key blocks and 256-key segments (lengths 31-33, 255-257),
a query tile's 8 (AVX2: 6) queries and a task's 96, head dims of 64, 80 (a 16-lane tail), 72 (AVX2
only) and 36 (the scalar loop), grouped-query ratios 1 to 8 and a single KV head.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from test_cpu_qmm import ext, loops, needs_extension, simd

SCALE = 0.125


def attention_numpy(q: np.ndarray, caches: list[tuple[np.ndarray, np.ndarray, int]], scale: float,
                    window: int = 0) -> np.ndarray:
    """float64: query t of row b (the newest `tokens` of its `live` slots) over the slots up to its own."""
    rows, heads, tokens, dims = q.shape
    out = np.zeros(q.shape)
    for b, (k, v, live) in enumerate(caches):
        group = heads // k.shape[1]
        hi = live - tokens + np.arange(tokens) + 1
        lo = np.maximum(0, hi - window) if window else np.zeros(tokens, int)
        slot = np.arange(live)
        allowed = (slot[None] >= lo[:, None]) & (slot[None] < hi[:, None])
        keys = np.repeat(k[0, :, :live], group, axis=0).astype(np.float64)
        values = np.repeat(v[0, :, :live], group, axis=0).astype(np.float64)
        s = np.where(allowed, np.einsum("htd,hjd->htj", q[b].astype(np.float64), keys) * scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("htj,hjd->htd", p / p.sum(-1, keepdims=True), values)
    return out


def case(seed: int, live: tuple[int, ...], tokens: int = 1, heads: int = 8, kv_heads: int = 2, dims: int = 64,
         spare: int = 5, sharp: bool = False):
    """q [rows, heads, tokens, dims] and each row's (keys, values, live) in buffers `spare` slots longer;
    `sharp`: at scale 1, scores spread over hundreds (terms below e^-87 of the largest appear)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(live), heads, tokens, dims)).astype(np.float32) * (6 if sharp else 1)
    caches = [tuple(rng.standard_normal((1, kv_heads, n + spare, dims)).astype(np.float32) for _ in "kv") + (n,)
              for n in live]
    return q, caches


def run(q, caches, scale=SCALE, window=0) -> np.ndarray:
    return np.array(ext.attention(mx.array(q), [mx.array(a) for k, v, _ in caches for a in (k, v)],
                                  [n for _, _, n in caches], scale, window))


# (live per row, tokens, heads, kv_heads, dims, window)
NUMPY_CASES = [
    ((7, 300, 1), 1, 8, 2, 64, 0),
    ((33,), 33, 8, 8, 64, 0),       # ratio 1, a chunk that is the whole cache
    ((257,), 5, 9, 3, 64, 0),       # SmolLM2's heads
    ((600, 40), 40, 8, 1, 80, 0),   # one KV head (ratio 8), dims with a 16-lane tail
    ((3000,), 100, 4, 2, 128, 0),   # several segments and query groups
    ((512,), 1, 8, 4, 72, 0),
    ((90,), 9, 6, 3, 36, 0),        # the scalar loop
    ((300,), 40, 8, 2, 64, 33),     # a window inside and across blocks
    ((1000, 70), 70, 4, 1, 64, 256),
    ((5000,), 1, 8, 2, 64, 1),      # a window of one slot: the query's own
]


@needs_extension
@pytest.mark.parametrize("live,tokens,heads,kv_heads,dims,window", NUMPY_CASES)
def test_attention_matches_numpy(live, tokens, heads, kv_heads, dims, window):
    q, caches = case(1, live, tokens, heads, kv_heads, dims)
    np.testing.assert_allclose(run(q, caches, window=window), attention_numpy(q, caches, SCALE, window), atol=2e-6)


@needs_extension
def test_scores_far_apart_match_numpy():
    """Small integers, so every score is an exact integer (scale 1) and only the softmax can err:
    scores spread over a hundred, and keys 300, 301 and 520 raised by 120 over the rest, so the
    running maximum jumps past e^87 (the old sums vanish) and most terms fall below the floor."""
    rng = np.random.default_rng(2)
    q = rng.integers(-2, 3, (1, 8, 64, 64)).astype(np.float32)
    q[..., 0] = 3
    k, v = rng.integers(-2, 3, (1, 2, 700, 64)).astype(np.float32), rng.standard_normal((1, 2, 700, 64))
    k[:, :, [300, 301, 520], 0] = 42
    caches = [(k, v.astype(np.float32), 700)]
    np.testing.assert_allclose(run(q, caches, scale=1.0), attention_numpy(q, caches, 1.0), atol=2e-6)


@needs_extension
@pytest.mark.parametrize("tokens,window", [(1, 0), (37, 0), (37, 100)])
def test_attention_matches_mlx_per_op(tokens, window):
    """The per-op path's own attention (mx.fast.scaled_dot_product_attention on the live slots with
    the causal, windowed mask), within 2e-5."""
    q, caches = case(3, (1500,), tokens=tokens, heads=9, kv_heads=3)
    k, v, live = caches[0]
    slot, position = np.arange(live), np.arange(live - tokens, live)[:, None]
    mask = (slot <= position) & ((slot > position - window) if window else True)
    with mx.stream(mx.cpu):
        theirs = mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k[:, :, :live]), mx.array(v[:, :, :live]),
                                                      scale=SCALE, mask=mx.array(mask))
    np.testing.assert_allclose(run(q, caches, window=window), np.array(theirs), atol=2e-5)


# Block, segment, tile and task edges, decode's segment tasks (one row, few KV heads, long cache).
EDGE_CASES = [
    ((1, 31, 32, 33), 1, 8, 2, 64, 0),
    ((255, 256, 257), 1, 9, 3, 80, 0),
    ((4097,), 3, 8, 1, 128, 0),
    ((300,), 40, 8, 2, 64, 33),
    ((100, 1000), 100, 6, 3, 72, 0),
    ((800,), 97, 12, 2, 64, 0),
]


@needs_extension
@pytest.mark.parametrize("live,tokens,heads,kv_heads,dims,window", EDGE_CASES)
def test_every_attention_loop_is_bit_exact_with_the_scalar_one(live, tokens, heads, kv_heads, dims, window):
    """attention_loop.h runs the same operations on each lane in every loop: the same bits on any CPU."""
    levels = loops()
    assert {"scalar", ext.simd()} <= set(levels)
    q, caches = case(4, live, tokens, heads, kv_heads, dims, sharp=True)
    results = {}
    for level in levels:
        with simd(level):
            results[level] = run(q, caches, scale=1.0, window=window)
    for level, y in results.items():
        assert np.array_equal(y, results["scalar"]), level


@contextmanager
def threads(n: int):
    before = ext.threads()
    ext.set_threads(n)
    try:
        yield
    finally:
        ext.set_threads(before)


@needs_extension
def test_rows_are_the_same_alone_batched_and_on_any_thread_count():
    """Bitwise, on every loop: rows of different lengths (one long enough to be spread over the
    threads) alone, together, on one thread and on four."""
    for tokens in (1, 20):
        q, caches = case(5, (40, 5000, 20), tokens=tokens)
        for level in ("best", "scalar"):
            with simd(level):
                batch = run(q, caches)
                alone = [run(q[b : b + 1], caches[b : b + 1])[0] for b in range(len(caches))]
                with threads(1):
                    one = run(q, caches)
                with threads(4):
                    four = run(q, caches)
            assert all(np.array_equal(batch[b], alone[b]) for b in range(len(caches))), (tokens, level)
            assert np.array_equal(batch, one) and np.array_equal(batch, four), (tokens, level)


@needs_extension
@pytest.mark.parametrize("window", [0, 300])
def test_a_position_decoded_equals_it_in_a_prompt_chunk(window):
    """Query t of a 40-token chunk over 3000 slots (tiles of many queries, each task merging its
    segments as it goes) against the same query alone over the first 2961 + t slots (a decode step:
    on four threads every segment a task of its own, merged afterwards; on one, as the chunk)."""
    q, caches = case(6, (3000,), tokens=40, heads=8, kv_heads=2)
    k, v, live = caches[0]
    for level in ("best", "scalar"):
        with simd(level):
            chunk = run(q, caches, window=window)
            for n in (1, 4):
                with threads(n):
                    for t in (0, 17, 39):
                        step = run(q[:, :, t : t + 1], [(k, v, live - 39 + t)], window=window)
                        assert np.array_equal(step[0, :, 0], chunk[0, :, t]), (level, n, t)


@needs_extension
def test_attention_reads_strided_buffers_and_refuses_bad_arguments():
    q, caches = case(7, (12,), tokens=3, spare=0)
    k, v, n = caches[0]
    strided = mx.array(np.ascontiguousarray(k.transpose(0, 1, 3, 2))).transpose(0, 1, 3, 2)  # dims not innermost
    got = np.array(ext.attention(mx.array(q), [strided, mx.array(v)], [n], SCALE))
    np.testing.assert_allclose(got, attention_numpy(q, caches, SCALE), atol=2e-6)
    with pytest.raises(ValueError, match="live slots"):
        ext.attention(mx.array(q), [mx.array(k), mx.array(v)], [13], SCALE)
    with pytest.raises(ValueError, match="live slots"):  # fewer live slots than new tokens
        ext.attention(mx.array(q), [mx.array(k), mx.array(v)], [2], SCALE)
    with pytest.raises(ValueError, match="a length for each"):
        ext.attention(mx.array(q), [mx.array(k)], [12], SCALE)
    with pytest.raises(ValueError, match="float32"):
        ext.attention(mx.array(q).astype(mx.float16), [mx.array(k), mx.array(v)], [12], SCALE)
    with pytest.raises(ValueError, match="window"):
        ext.attention(mx.array(q), [mx.array(k), mx.array(v)], [12], SCALE, -1)


def test_doctor_says_which_attention_runs_where(monkeypatch):
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    def line() -> str:
        result = CliRunner().invoke(main, ["doctor"])
        assert result.exit_code == 0, result.output
        return next(line for line in result.output.splitlines() if line.startswith("attention:"))

    assert ("CPU extension, tiled" in line()) == (ext is not None)
    monkeypatch.setenv("MLXINFER_CPU_QMM", "off")
    assert "MLX's attention per op" in line()
