"""The compiled CPU quantized matmul (mlxinfer.kernels._cpu_qmm) against two independent oracles:
MLX's own `mx.quantized_matmul`, and numpy unpacking MLX's affine format (a little-endian
bit stream of `bits`-bit integers q per row, weight = q * scale + bias per group) and
multiplying in float64. Then the engine: greedy tokens with the fast path equal those of
the pure-MLX path (MLXINFER_CPU_QMM=off) on tiny 4- and 8-bit models and on SmolLM2.

Tolerance: the kernel accumulates in float32, so an output may differ from the exact
float64 product by a few float32 roundings of the sum of |x_k * w_k|; we allow
2e-5 * sum_k |x_k * w_k| (about 300 float32 epsilons) plus 1e-6.
"""

from __future__ import annotations

import itertools
import sys
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.kernels import quantized_matmul as qmm

ext = qmm.extension()
needs_extension = pytest.mark.skipif(ext is None, reason=f"CPU extension unavailable: {qmm.reason()}")

SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
IN_DIMS = {32: 96, 64: 192, 128: 384}  # 96 = 3 groups of 32: not a multiple of 64 inputs
OUT = 37  # no multiple of 8 or 16


def dequantize_numpy(packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> np.ndarray:
    """float64 [out, in] from MLX's packed format, unpacked bit by bit."""
    raw = np.array(packed).view(np.uint8)  # little-endian uint32 words -> their bytes in order
    stream = np.unpackbits(raw, axis=-1, bitorder="little")  # [out, in * bits]
    q = stream.reshape(raw.shape[0], -1, bits) @ (1 << np.arange(bits))  # [out, in]
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=-1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=-1)
    return q * s + b


def random_case(bits: int, group_size: int, dtype: mx.Dtype, rows: int, seed: int, out: int = OUT):
    rng = np.random.default_rng(seed)
    in_dims = IN_DIMS[group_size]
    w = mx.array(rng.standard_normal((out, in_dims)).astype(np.float32)).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.array(rng.standard_normal((rows, in_dims)).astype(np.float32))
    return x, packed, scales, biases


def tolerance(x: mx.array, w: np.ndarray) -> np.ndarray:
    return 2e-5 * (np.abs(np.array(x, dtype=np.float64)) @ np.abs(w).T) + 1e-6


@needs_extension
@pytest.mark.parametrize("bits,group_size", list(itertools.product(qmm.BITS, qmm.GROUP_SIZES)))
def test_matches_numpy_and_mlx(bits, group_size):
    for dtype, rows in itertools.product(SCALE_DTYPES, range(1, 9)):
        x, packed, scales, biases = random_case(bits, group_size, dtype, rows, seed=bits * 1000 + rows)
        got = np.array(ext.affine_quantized_matmul(x, packed, scales, biases, group_size, bits))
        w = dequantize_numpy(packed, scales, biases, group_size, bits)
        exact = np.array(x, dtype=np.float64) @ w.T
        tol = tolerance(x, w)
        assert got.shape == (rows, OUT)
        assert np.all(np.abs(got - exact) <= tol), (dtype, rows, np.abs(got - exact).max())
        with mx.stream(mx.cpu):
            theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group_size, bits=bits)
        assert np.all(np.abs(got - np.array(theirs.astype(mx.float32))) <= 2 * tol), (dtype, rows)


@needs_extension
def test_prompt_sized_products_match_numpy():
    """A short prompt's product (the GEMM's tiles of 4 rows, the last one of 1)."""
    x, packed, scales, biases = random_case(4, 32, mx.float16, rows=37, seed=5, out=300)
    got = np.array(ext.affine_quantized_matmul(x, packed, scales, biases, 32, 4))
    w = dequantize_numpy(packed, scales, biases, 32, 4)
    assert np.all(np.abs(got - np.array(x, dtype=np.float64) @ w.T) <= tolerance(x, w))


@needs_extension
@pytest.mark.parametrize("bits", [4, 8, 3])
def test_each_row_is_the_same_whatever_the_batch(bits):
    """Bitwise: row r of an R-row product equals the product of row r alone, for R = 1..8,
    across a matrix big enough to be split over threads (out * in >= 2**16)."""
    x, packed, scales, biases = random_case(bits, 64, mx.float16, rows=8, seed=bits, out=700)
    alone = [np.array(ext.affine_quantized_matmul(x[r : r + 1], packed, scales, biases, 64, bits)) for r in range(8)]
    for rows in range(1, 9):
        together = np.array(ext.affine_quantized_matmul(x[:rows], packed, scales, biases, 64, bits))
        for r in range(rows):
            assert np.array_equal(together[r], alone[r][0]), (rows, r)


ROW_EDGES = (1, 255, 256, 257, 511, 512, 513, 1024, 2049)  # across tiles of 3 and 4 rows and blocks of rows
GEMM_IN, GEMM_OUT = 768, 45  # 168-row blocks, panels of 8 outputs (45: the last one 5, a tile of 1)


@needs_extension
@pytest.mark.parametrize("bits,group_size", list(itertools.product(qmm.BITS, qmm.GROUP_SIZES)))
def test_gemm_matches_numpy_and_mlx_across_block_edges(bits, group_size):
    """Prompt-sized products (the GEMM from 5 rows) against numpy in float64 and the per-op MLX path, each
    scale dtype at three of the row counts; every row equal bit for bit to itself computed alone (the
    matvec loop) and within a batch that starts elsewhere (other tile and block edges)."""
    for i, rows in enumerate(ROW_EDGES):
        dtype = SCALE_DTYPES[i % len(SCALE_DTYPES)]
        x, packed, scales, biases = gemm_case(bits, group_size, dtype, rows, seed=i)
        got = np.array(ext.affine_quantized_matmul(x, packed, scales, biases, group_size, bits))
        w = dequantize_numpy(packed, scales, biases, group_size, bits)
        tol = tolerance(x, w)
        assert np.all(np.abs(got - np.array(x, dtype=np.float64) @ w.T) <= tol), (rows, dtype)
        with mx.stream(mx.cpu):
            theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group_size, bits=bits)
        assert np.all(np.abs(got - np.array(theirs.astype(mx.float32))) <= 2 * tol), (rows, dtype)
        for r in {0, rows // 2, rows - 1}:
            alone = ext.affine_quantized_matmul(x[r : r + 1], packed, scales, biases, group_size, bits)
            assert np.array_equal(np.array(alone)[0], got[r]), (rows, r)
        if rows > 100:
            shifted = ext.affine_quantized_matmul(x[37:], packed, scales, biases, group_size, bits)
            assert np.array_equal(np.array(shifted), got[37:]), rows


def gemm_case(bits: int, group_size: int, dtype: mx.Dtype, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((GEMM_OUT, GEMM_IN)).astype(np.float32)).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return mx.array(rng.standard_normal((rows, GEMM_IN)).astype(np.float32)), packed, scales, biases


@contextmanager
def simd(level: str):
    """Run the extension's loops capped at `level` inside the block."""
    ext.limit_simd(level)
    try:
        yield
    finally:
        ext.limit_simd("best")


def loops() -> list[str]:
    """The loops this CPU can run, narrowest first."""
    found = []
    for level in ("scalar", "avx2+fma", "avx512"):
        with simd(level):
            if ext.simd() == level:
                found.append(level)
    return found


@needs_extension
@pytest.mark.parametrize("bits", qmm.BITS)
def test_every_loop_is_bit_exact_with_the_scalar_one(bits):
    """The scalar loop models the vector ones operation for operation, so on any CPU a product
    is the same bits; checked for few rows (the block loops) and many (dequantize once + tiles),
    every group size (one, two or four chunks a group), every scale type, and an odd output
    count (a tile with one output); 257 rows end in a tile of 1 (AVX-512) or 2 (AVX2) rows."""
    levels = loops()
    assert {"scalar", ext.simd()} <= set(levels)
    for group_size, dtype, rows in itertools.product(qmm.GROUP_SIZES, SCALE_DTYPES, (3, 11, 257)):
        x, packed, scales, biases = random_case(bits, group_size, dtype, rows=rows, seed=7, out=301)
        results = {}
        for level in levels:
            with simd(level):
                results[level] = np.array(ext.affine_quantized_matmul(x, packed, scales, biases, group_size, bits))
        for level, y in results.items():
            assert np.array_equal(y, results["scalar"]), (level, group_size, dtype, rows)


def test_limit_simd_refuses_an_unknown_loop():
    if ext is None:
        pytest.skip("the CPU extension is not built")
    with pytest.raises(ValueError, match="limit_simd takes"):
        ext.limit_simd("neon")


@needs_extension
@pytest.mark.parametrize("rows", [3, 513])
def test_thread_count_does_not_change_results(rows):
    """The pool cuts a product by outputs (and from 5 rows by blocks of rows too) by its thread count."""
    x, packed, scales, biases = random_case(4, 32, mx.float32, rows=rows, seed=3, out=1000)
    threads = ext.threads()
    many = np.array(ext.affine_quantized_matmul(x, packed, scales, biases, 32, 4))
    try:
        for n in (1, 3):
            ext.set_threads(n)
            assert np.array_equal(many, np.array(ext.affine_quantized_matmul(x, packed, scales, biases, 32, 4))), n
    finally:
        ext.set_threads(threads)


@needs_extension
def test_batch_dims_half_inputs_and_strided_views():
    x, packed, scales, biases = random_case(4, 32, mx.float16, rows=6, seed=11)
    flat = ext.affine_quantized_matmul(x, packed, scales, biases, 32, 4)
    batched = ext.affine_quantized_matmul(x.reshape(2, 3, -1), packed, scales, biases, 32, 4)
    assert batched.shape == (2, 3, OUT) and mx.array_equal(batched.reshape(6, OUT), flat).item()
    half = ext.affine_quantized_matmul(x.astype(mx.float16), packed, scales, biases, 32, 4)
    assert half.dtype == mx.float16  # as mx.quantized_matmul: the promoted input type
    strided = mx.array(np.array(x).T.copy()).T  # same values, column-major view
    assert mx.array_equal(ext.affine_quantized_matmul(strided, packed, scales, biases, 32, 4), flat).item()


@needs_extension
def test_bad_arguments_raise_value_errors():
    x, packed, scales, biases = random_case(4, 32, mx.float32, rows=1, seed=0)
    with pytest.raises(ValueError, match="shapes do not match"):
        ext.affine_quantized_matmul(x[:, :64], packed, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="bits"):
        ext.affine_quantized_matmul(x, packed, scales, biases, 32, 7)
    with pytest.raises(ValueError, match="group_size"):
        ext.affine_quantized_matmul(x, packed, scales, biases, 16, 4)


@needs_extension
def test_gather_matches_mlx_gather_qmm_and_the_plain_product():
    """MoE decode: x [batch, 1, 1, in] against k experts each (gate/up), then x [batch, k, 1, in] (down)."""
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((6, 200, 96)).astype(np.float32)).astype(mx.bfloat16)
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    indices = mx.array([[3, 0], [5, 3], [1, 1]])
    for x in (mx.array(rng.standard_normal((3, 1, 1, 96)).astype(np.float32)),
              mx.array(rng.standard_normal((3, 2, 1, 96)).astype(np.float32))):
        got = qmm.gather_quantized_matmul(x, packed, scales, biases, indices, 32, 4)
        with mx.stream(mx.cpu):
            theirs = mx.gather_qmm(x, packed, scales, biases, rhs_indices=indices, transpose=True, group_size=32, bits=4)
        assert got.shape == theirs.shape == (3, 2, 1, 200)
        np.testing.assert_allclose(np.array(got), np.array(theirs.astype(mx.float32)), rtol=0, atol=1e-4)
        row = x[1, -1]  # batch 1, expert slot 1 (expert 3): the plain product of that row, bit for bit
        alone = ext.affine_quantized_matmul(row, packed[3], scales[3], biases[3], 32, 4)
        assert mx.array_equal(got[1, 1], alone).item()


def test_dispatch_by_rows_and_switch(monkeypatch):
    if ext is not None:  # every row count: no BLAS for quantized layers
        assert [qmm.implementation(r) for r in (1, 8, 256, 257, 4096)] == ["cpu-extension"] * 5
    else:
        assert [qmm.implementation(r) for r in (1, 7, 8)] == ["mlx", "mlx", "dequantize+blas"]
    monkeypatch.setenv("MLXINFER_CPU_QMM", "off")
    assert [qmm.implementation(r) for r in (1, 7, 8)] == ["mlx", "mlx", "dequantize+blas"]
    assert "MLXINFER_CPU_QMM=off" in qmm.describe() or ext is None
    monkeypatch.setenv("MLXINFER_CPU_QMM", "fast")
    with pytest.raises(InvalidOptionError, match="MLXINFER_CPU_QMM"):
        qmm.implementation(1)


def test_without_the_extension_doctor_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(qmm, "_loaded", [None])
    monkeypatch.setattr(qmm, "_why_not", ["not built"])
    assert qmm.implementation(1) == "mlx"
    assert "pip install -e ." in qmm.describe() and "not built" in qmm.describe()


def test_a_missing_extension_is_called_not_built(monkeypatch, tmp_path):
    """An install without a compiler has no module file at all: 'not built', not 'built but unloadable'."""
    import importlib.machinery

    monkeypatch.setattr(mlxinfer.kernels, "__path__", [str(tmp_path)])  # a package folder without the .so,
    monkeypatch.setattr(sys, "meta_path", [importlib.machinery.PathFinder])  # and no editable-install finder
    monkeypatch.delitem(sys.modules, "mlxinfer.kernels._cpu_qmm", raising=False)
    monkeypatch.delattr(mlxinfer.kernels, "_cpu_qmm", raising=False)
    monkeypatch.setattr(qmm, "_loaded", [])
    monkeypatch.setattr(qmm, "_why_not", [])
    monkeypatch.setattr(qmm, "REASON_FILE", tmp_path / "missing")
    assert qmm.extension() is None and qmm.reason() == "not built"


def test_why_it_was_not_built_is_said_once_at_the_first_run(monkeypatch, tmp_path, capsys):
    """setup.py leaves its reason beside the package; the first command says it with the fix, once."""
    import mlxinfer.cli.main as cli

    (tmp_path / "why").write_text("cmake not found\n")
    monkeypatch.setattr(qmm, "REASON_FILE", tmp_path / "why")
    monkeypatch.setattr(qmm, "_loaded", [None])
    monkeypatch.setattr(qmm, "_why_not", [qmm._not_built()])
    monkeypatch.setattr("mlxinfer.base.blas.hint", lambda: None)
    monkeypatch.setattr("mlxinfer.base.blas.core_hint", lambda: None)
    monkeypatch.setenv("MLXINFER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLXINFER_CPU_QMM", raising=False)
    cli.hints_once()
    first = capsys.readouterr().err
    assert "CPU extension is not built (cmake not found)" in first and "g++" in first and first.count("\n") == 1
    cli.hints_once()
    assert capsys.readouterr().err == ""


def greedy_tokens(folder, monkeypatch, mode: str, prompt: str, n: int) -> list[int]:
    monkeypatch.setenv("MLXINFER_CPU_QMM", mode)
    model, tokenizer = mlxinfer.load(folder)
    chunks = mlxinfer.stream_generate(model, tokenizer, prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
    return [c.token for c in chunks]


@needs_extension
@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_tokens_equal_the_pure_mlx_path(hf_checkpoint, tmp_path, monkeypatch, bits):
    src = hf_checkpoint("llama", head_dim=32, tie_word_embeddings=True)  # tied: the LM head is quantized too
    out = tmp_path / f"q{bits}"
    convert(src, out, quantize=True, bits=bits, group_size=32)
    fast = greedy_tokens(out, monkeypatch, "auto", "def add(a, b):", 24)
    slow = greedy_tokens(out, monkeypatch, "off", "def add(a, b):", 24)
    assert fast == slow and len(fast) == 24


@needs_extension
def test_moe_greedy_tokens_equal_the_pure_mlx_path(hf_checkpoint, tmp_path, monkeypatch):
    src = hf_checkpoint("qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)
    out = tmp_path / "moe-q4"
    convert(src, out, quantize=True, bits=4, group_size=32)
    fast = greedy_tokens(out, monkeypatch, "auto", "def add(a, b):", 16)
    slow = greedy_tokens(out, monkeypatch, "off", "def add(a, b):", 16)
    assert fast == slow


@needs_extension
def test_smollm2_greedy_tokens_equal_the_pure_mlx_path(smollm2_gguf, tmp_path, monkeypatch):
    out = tmp_path / "smollm2"
    convert(smollm2_gguf, out)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    fast = greedy_tokens(out, monkeypatch, "auto", question, 16)
    slow = greedy_tokens(out, monkeypatch, "off", question, 16)
    assert fast == slow


def test_doctor_reports_the_active_path():
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("quantized matmul:"))
    assert ("CPU extension (" in line) == (ext is not None)
    assert "4-bit matvec:" in result.output
    assert ("4-bit GEMM:" in result.output and "of the" in result.output) == (ext is not None)


@needs_extension
def test_logsumexp_matches_float64_and_mlx():
    """Against numpy in float64 (within 1e-6 plus a float32 sum's rounding over the row) on rows of every
    tail length, masked (-inf) entries, a row of nothing but -inf, and the scalar loop."""
    rng = np.random.default_rng(3)
    rows = [rng.normal(0, scale, n).astype(np.float32) for n in (1, 15, 16, 17, 1000, 49_152) for scale in (1, 8)]
    rows[6][::3] = -np.inf
    for level in loops():
        with simd(level):
            for x in rows:
                got = float(np.array(ext.logsumexp(mx.array(x[None])))[0, 0])
                m = np.max(x.astype(np.float64))
                want = m + np.log(np.sum(np.exp(x.astype(np.float64) - m)))
                assert abs(got - want) <= 1e-6 + 1e-10 * x.size * abs(want), (level, x.size, got, want)
            got = np.array(ext.logsumexp(mx.array(np.full((2, 20), -np.inf, np.float32))))
            assert got.shape == (2, 1) and np.all(got == -np.inf)
    batch = np.stack([rows[8], rows[8][::-1]])
    np.testing.assert_allclose(np.array(ext.logsumexp(mx.array(batch))),
                               np.array(mx.logsumexp(mx.array(batch), axis=-1, keepdims=True)), rtol=1e-6)
    with pytest.raises(ValueError, match="float32 rows"):
        ext.logsumexp(mx.zeros((3,)))


@needs_extension
def test_logsumexp_takes_the_extension_only_where_its_loop_is_vectorized(monkeypatch):
    """Its scalar loop is one std::exp at a time, as MLX's (and slower than it on arm64): with the
    loops capped below AVX-512 the sampler's logsumexp is MLX's."""
    from mlxinfer.kernels import cpu_logsumexp

    monkeypatch.delenv("MLXINFER_CPU_QMM", raising=False)
    taken = []
    real = ext.logsumexp
    monkeypatch.setattr(ext, "logsumexp", lambda x: taken.append(ext.simd()) or real(x))
    x = mx.array(np.random.default_rng(4).normal(0, 4, (2, 100)).astype(np.float32))
    want = np.array(mx.logsumexp(x, axis=-1, keepdims=True))
    for level in loops():
        with simd(level):
            np.testing.assert_allclose(np.array(cpu_logsumexp.logsumexp(x)), want, rtol=1e-6)
    assert taken == [level for level in loops() if level == "avx512"]
