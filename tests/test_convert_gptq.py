"""`convert --method gptq`: GPTQ against a NumPy reference of the paper's Algorithm 1 (Frantar et
al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers"),
written here from the paper with MLX's own `mx.quantize` as the quantization grid; its layer-wise
error against plain rounding's; and on the real SmolLM2-135M weights, perplexity against plain
rounding at the same size and mlx-lm's logits for the folder it writes."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from perplexity_oracle import perplexity
from mlx.utils import tree_map

from click.testing import CliRunner

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.cli.main import main
from mlxinfer.convert import convert
from mlxinfer.convert.calibrate import gptq, pack, read_calibration, windows
from mlxinfer.convert.quantize import QuantSpec
from mlxinfer.convert.texts import evaluation_text
from mlxinfer.loading.checkpoint import load_model
from mlxinfer.text.tokenizer import load_tokenizer_from_dir


def _grid(group: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale and bias of each row of one group as MLX's affine quantization chooses them."""
    _, s, b = mx.quantize(mx.array(group, dtype=mx.float32), group.shape[1], bits)
    return np.asarray(s, dtype=np.float64)[:, 0], np.asarray(b, dtype=np.float64)[:, 0]


def reference_gptq(w: np.ndarray, h: np.ndarray, bits: int, group: int, damp: float = 0.01) -> np.ndarray:
    """Algorithm 1 of the paper without its lazy batching (the paper: mathematically the same),
    grouping as its §Additional details describe: a group's grid is set when its first column is
    reached, from the weights as updated so far. Returns the dequantized weights."""
    w = w.copy()
    h = h + damp * np.mean(np.diag(h)) * np.eye(len(h))
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # H^-1 <- Cholesky(H^-1)^T, upper triangular
    q = np.zeros_like(w)
    for j in range(w.shape[1]):
        if j % group == 0:
            scale, bias = _grid(w[:, j : j + group], bits)
        codes = np.clip(np.round((w[:, j] - bias) / scale), 0, 2**bits - 1)
        q[:, j] = scale * codes + bias
        err = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j:] -= np.outer(err, hinv[j, j:])
    return q


def _problem(seed: int, rows: int = 48, cols: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """A weight matrix and the Hessian 2XᵀX/n of correlated inputs (as a layer's are)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * 0.05
    mix = rng.standard_normal((cols, cols)) / np.sqrt(cols) + np.eye(cols)
    x = rng.standard_normal((4 * cols, cols)) @ mix * rng.uniform(0.1, 3, cols)
    return w, 2 * x.T @ x / len(x)


def _dequantized(packed) -> np.ndarray:
    return np.asarray(packed.dequantize(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_packing(bits):
    w = mx.random.normal((8, 128), key=mx.random.key(bits))
    packed, s, b = mx.quantize(w, 32, bits)
    codes = np.round((np.asarray(mx.dequantize(packed, s, b, 32, bits)) - np.repeat(np.asarray(b), 32, 1))
                     / np.repeat(np.asarray(s), 32, 1)).astype(np.uint32)
    np.testing.assert_array_equal(pack(codes, bits), np.asarray(packed))


@pytest.mark.parametrize(("seed", "bits", "group"), [(0, 4, 64), (1, 3, 32), (2, 2, 128), (3, 8, 64)])
def test_gptq_is_the_papers_algorithm(seed, bits, group):
    w, h = _problem(seed)
    ours = _dequantized(gptq(w, h, QuantSpec(bits, group), fit=False))
    expected = reference_gptq(w, h, bits, group)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_error_below_plain_rounding(seed, bits):
    w, h = _problem(10 + seed)
    rtn = np.asarray(mx.dequantize(*mx.quantize(mx.array(w, dtype=mx.float32), 64, bits), 64, bits), np.float64)
    ours = _dequantized(gptq(w, h, QuantSpec(bits, 64)))

    def error(q):
        d = w - q
        return np.trace(d @ h @ d.T)

    assert error(ours) < 0.8 * error(rtn)


def test_calibration_windows_are_seeded_and_disjoint():
    ids = list(range(10_000))
    first, again = windows(ids, 2048, 512), windows(ids, 2048, 512)
    np.testing.assert_array_equal(first, again)
    assert first.shape == (4, 512)
    assert len(set(first.ravel().tolist())) == first.size  # no token twice
    assert windows(ids[:300], 2048, 512).shape == (1, 300)  # a short text: all of it


def test_jsonl_chats_and_bad_lines(tmp_path):
    good = tmp_path / "chats.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n\n")
    assert read_calibration(good).chats == ([{"role": "user", "content": "hi"}],)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no messages"}\n')
    with pytest.raises(InvalidOptionError, match="line 1"):
        read_calibration(bad)
    assert read_calibration(None).name == "python-reference"


@pytest.mark.parametrize("options", [
    {"method": "awq2"},
    {"method": "gptq", "q_mode": "mxfp4"},
    {"method": "gptq", "dequantize": True},
    {"calibration_tokens": 64},
    {"method": "gptq", "calibration_tokens": 1},
])
def test_refusals(tiny, tmp_path, options):
    with pytest.raises(InvalidOptionError):
        convert(tiny, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_calibration_file_needs_a_method(tiny, tmp_path):
    text = tmp_path / "c.txt"
    text.write_text("some text")
    with pytest.raises(InvalidOptionError, match="--method"):
        convert(tiny, tmp_path / "out", quantize=True, calibration=text)


def test_cli_gptq_on_chats_is_deterministic(tiny, tmp_path):
    """A chat JSONL calibrates through the model's template; two runs write the same bytes; the
    quantized layers of the blocks differ from plain rounding's, the embedding does not."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: why is the sky "
                                                                                  "blue?"},
                                                      {"role": "assistant", "content": "Rayleigh scattering."}]})
                             + "\n" for i in range(40)))
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        result = CliRunner().invoke(main, ["convert", str(tiny), "-o", str(out), "--bits", "4", "--method", "gptq",
                                           "--calibration", str(chats), "--calibration-tokens", "256"])
        assert result.exit_code == 0, result.output
        outs.append(out)
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()
    method = json.loads((outs[0] / "config.json").read_text())["quantization_method"]
    assert method == {"method": "gptq", "calibration": "chats.jsonl", "calibration_tokens": 256}
    rtn = tmp_path / "rtn"
    convert(tiny, rtn, quantize=True, bits=4)
    ours, plain = mx.load(str(outs[0] / "model.safetensors")), mx.load(str(rtn / "model.safetensors"))
    assert set(ours) == set(plain)
    assert mx.array_equal(ours["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])
    assert not mx.array_equal(ours["model.layers.0.self_attn.q_proj.weight"],
                              plain["model.layers.0.self_attn.q_proj.weight"])


@pytest.fixture(scope="module")
def smollm2_float(smollm2_gguf, tmp_path_factory):
    """The demo GGUF dequantized: the float source every method quantizes."""
    out = tmp_path_factory.mktemp("smollm2_float") / "float"
    convert(smollm2_gguf, out, dequantize=True)
    return out


EVAL_TOKENS = 1024  # two windows of 512


@pytest.mark.parametrize("bits", [3, 4])
def test_smollm2_gptq_beats_plain_rounding(smollm2_float, tmp_path, bits):
    ids = load_tokenizer_from_dir(smollm2_float).encode(evaluation_text())[: EVAL_TOKENS + 1]
    scores = {}
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        extra = {"calibration_tokens": 512} if method == "gptq" else {}
        convert(smollm2_float, out, bits=bits, group_size=64, quantize=True, method=method, **extra)
        scores[method] = perplexity(load_model(out, dtype="float32"), ids)
        config = json.loads((out / "config.json").read_text())
        assert config["quantization"]["bits"] == bits
        if method == "gptq":
            assert config["quantization_method"] == {"method": "gptq", "calibration": "python-reference",
                                                     "calibration_tokens": 512}
            gptq_folder = out
    assert scores["gptq"] < scores["rtn"], scores
    if bits == 4:
        _same_logits_in_mlx_lm(gptq_folder, ids[:8])


def _same_logits_in_mlx_lm(folder, ids):
    """mlx-lm reads the folder as we do: both in float32 (as test_convert_smollm2 compares them)."""
    mlx_lm = pytest.importorskip("mlx_lm.utils")
    theirs, _ = mlx_lm.load_model(folder)
    theirs.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.float16 else p, theirs.parameters()))
    ours = load_model(folder, dtype="float32")
    tokens = mx.array([ids])
    np.testing.assert_allclose(np.asarray(ours(tokens)), np.asarray(theirs(tokens)), atol=5e-4, rtol=0)


def test_mixture_of_experts_refused_in_one_line(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)
    with pytest.raises(InvalidOptionError, match="plain linear layers.*--method rtn") as caught:
        convert(src, tmp_path / "out", bits=4, group_size=32, method="gptq")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def _weighted_error(w: np.ndarray, c: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> np.ndarray:
    """Per row: sum_j c_j (w_j - Q(w_j))^2, with codes rounded to nearest on the grid (scale, bias)."""
    codes = np.clip(np.round((w - bias[:, None]) / scale[:, None]), 0, 2**bits - 1)
    return (c * np.square(w - (scale[:, None] * codes + bias[:, None]))).sum(axis=1)


def _heavy_tailed(seed: int, rows: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_t(3, (rows, n)) * 0.02, rng.uniform(0.1, 3, n) ** 2


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fitted_grid_is_never_worse_than_mlx_and_nears_a_brute_force_optimum(bits):
    from mlxinfer.convert.grid import fitted, mlx_grid

    w, c = _heavy_tailed(bits, 32, 32)
    ours = _weighted_error(w, c, *fitted(w, c, bits, mx.float32), bits)
    mlx = _weighted_error(w, c, *mlx_grid(w, bits, mx.float32), bits)
    assert np.all(ours <= mlx * (1 + 1e-9))
    assert ours.sum() < 0.8 * mlx.sum()
    # brute force: every (scale, bias) on a dense grid around each row's range, codes nearest
    best = np.full(len(w), np.inf)
    for row in range(len(w)):
        lo, hi = w[row].min(), w[row].max()
        scales = np.linspace(0.3, 1.5, 241) * (hi - lo) / (2**bits - 1)
        biases = lo + np.linspace(-0.5, 0.5, 241) * (hi - lo) / 2
        s, b = np.meshgrid(scales, biases)
        errs = _weighted_error(np.broadcast_to(w[row], (s.size, w.shape[1])), c, s.ravel(), b.ravel(), bits)
        best[row] = errs.min()
    assert ours.sum() < 1.1 * best.sum()


@pytest.mark.parametrize("seed", range(3))
def test_gptq_with_fitted_grids_beats_gptq_on_mlx_grids(seed):
    w, h = _problem(20 + seed)
    w = w * np.random.default_rng(seed).standard_t(3, w.shape)  # heavy tails, as trained weights have

    def error(q):
        d = w - q
        return np.trace(d @ h @ d.T)

    fit = error(_dequantized(gptq(w, h, QuantSpec(3, 64))))
    plain = error(_dequantized(gptq(w, h, QuantSpec(3, 64), fit=False)))
    assert fit < 0.9 * plain
