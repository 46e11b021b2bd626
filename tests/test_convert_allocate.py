"""`convert --target-bpw`: per-tensor bits from measured sensitivity under a size budget.

Oracles: the written files' own bytes (safetensors headers, read here) for the size; a brute
force over every assignment of a tiny problem, with the rounding errors computed here from
mx.quantize/mx.dequantize and numpy, for the choice; perplexity of plain rounding and of the
fixed recipes on real text for the quality; mlx-lm's loader for the output's logits."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from perplexity_oracle import perplexity
from test_convert_smollm2 import assert_mlx_lm_gives_our_logits
from click.testing import CliRunner

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.cli.main import main
from mlxinfer.convert import allocate, convert, texts
from mlxinfer.loading.checkpoint import load_model
from mlxinfer.text.tokenizer import load_tokenizer_from_dir

SPECS = [(bits, group) for bits in (2, 3, 4, 5, 6, 8) for group in (32, 64, 128)]


def stored(folder: Path) -> tuple[int, dict[str, tuple[str, list[int]]]]:
    """Bytes of every tensor in the folder's safetensors files, and each tensor's dtype and shape,
    read from the files' headers (8-byte length, then JSON with each tensor's data offsets)."""
    total, tensors = 0, {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                total += end - start
                tensors[name] = (entry["dtype"], entry["shape"])
    return total, tensors


def parameters(folder: Path) -> int:
    return sum(int(np.prod(shape)) for _, shape in stored(folder)[1].values())


def bits_per_weight(out: Path, source: Path) -> float:
    return stored(out)[0] * 8 / parameters(source)


def rounding_error(w: np.ndarray, bits: int, group: int, rows: np.ndarray, cols: np.ndarray) -> float:
    """sum_ij (W - Q(W))_ij^2 rows_i cols_j, Q by MLX's affine quantization with float16 scales."""
    packed = mx.quantize(mx.array(w, dtype=mx.float16), group, bits)
    q = np.array(mx.dequantize(*packed, group, bits).astype(mx.float32))
    return float(rows @ np.square(q - w) @ cols)


def options_for(ws, rows, cols) -> list[list[tuple[int, float]]]:
    """Each tensor's (bytes, error) per setting: packed weight plus float16 scales and biases."""
    return [[(w.size * b // 8 + 2 * 2 * w.size // g, rounding_error(w, b, g, r, c)) for b, g in SPECS]
            for w, r, c in zip(ws, rows, cols)]


def totals(options, pick) -> tuple[int, float]:
    return sum(o[k][0] for o, k in zip(options, pick)), sum(o[k][1] for o, k in zip(options, pick))


@pytest.mark.parametrize("seed", range(3))
def test_choice_beats_every_uniform_assignment_and_nears_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal((8, 128)).astype(np.float32) * s for s in (1.0, 0.3, 2.0)]
    rows = [rng.uniform(0.1, 2, 8) for _ in ws]
    cols = [rng.uniform(0.1, 2, 128) * s for s in (1.0, 10.0, 0.1)]
    options = options_for(ws, rows, cols)
    sizes = sorted({totals(options, p)[0] for p in itertools.product(range(len(SPECS)), repeat=3)})
    for budget in sizes[:: max(1, len(sizes) // 12)]:
        pick = allocate.choose(options, budget)
        size, error = totals(options, pick)
        assert size <= budget
        for k in range(len(SPECS)):
            u_size, u_error = totals(options, [k] * 3)
            if u_size <= budget:
                assert error <= u_error, (budget, SPECS[k])
        best = min(e for s, e in (totals(options, p) for p in itertools.product(range(len(SPECS)), repeat=3))
                   if s <= budget)
        assert error <= 1.25 * best + 1e-9, (budget, error, best)


def test_the_tensor_whose_inputs_are_100x_larger_gets_more_bits():
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((16, 128)).astype(np.float32) for _ in range(2)]
    rows = [np.ones(16), np.ones(16)]
    cols = [np.full(128, 100.0), np.ones(128)]
    options = options_for(ws, rows, cols)
    four = options[0][SPECS.index((4, 64))][0]
    pick = allocate.choose(options, 2 * four)
    (bits_a, _), (bits_b, _) = SPECS[pick[0]], SPECS[pick[1]]
    assert bits_a > bits_b


def test_weighted_error_is_the_fisher_weighted_rounding_error():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    rows, cols = rng.uniform(0, 1, 32).astype(np.float32), rng.uniform(0, 1, 64).astype(np.float32)
    ours = allocate.weighted_error(mx.array(w), allocate.QuantSpec(3, 32), mx.float16,
                                   [allocate.Use(mx.array(rows), mx.array(cols))])
    assert ours == pytest.approx(rounding_error(w, 3, 32, rows, cols), rel=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_sensitivity_is_torchs_gradients_and_inputs(hf_checkpoint, tied):
    """The block-by-block pass against one backward pass of the transformers model in torch: per
    linear layer, the squared gradient of the text's summed NLL on each output summed over tokens
    and the mean squared input averaged over windows; the embedding's rows read and the squared
    gradient on its output; a tied embedding's LM-head use from the logits and the final hidden state."""
    import torch
    from transformers import AutoModelForCausalLM

    from mlxinfer.convert.sources import open_folder

    src = hf_checkpoint("llama", head_dim=32, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, hf.config.vocab_size, 24).tolist() for _ in range(2)]
    seen: dict[str, list] = {}

    def keep(name):
        def hook(module, args, output):
            output.retain_grad()
            seen.setdefault(name, []).append((args[0], output))
        return hook

    linears = {name: m for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, m in linears.items():
        m.register_forward_hook(keep(name))
    hf.model.embed_tokens.register_forward_hook(keep("model.embed_tokens#lookup"))
    for w in windows:
        ids = torch.tensor([w])
        logits = hf(ids[:, :-1]).logits[0]
        torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()

    def expected(name):
        calls = seen[name]
        g2 = sum(y.grad.reshape(-1, y.shape[-1]).square().sum(0) for _, y in calls).numpy()
        x2 = sum(x.detach().reshape(-1, x.shape[-1]).double().square().mean(0) for x, _ in calls).numpy() / len(calls)
        return g2, x2

    paths = [n for n in linears if n != "lm_head"] + ["model.embed_tokens"] + ([] if tied else ["lm_head"])
    uses = allocate.measure(open_folder(src), windows, paths)
    for name in linears:
        g2, x2 = expected(name)
        use = uses["model.embed_tokens" if name == "lm_head" and tied else name][0]
        np.testing.assert_allclose(np.asarray(use.rows), g2, rtol=2e-3, atol=1e-9 * g2.max())
        np.testing.assert_allclose(np.asarray(use.cols), x2, rtol=2e-4)
    reads = np.zeros(hf.config.vocab_size)
    for w in windows:
        np.add.at(reads, w[:-1], 1 / (len(w) - 1) / len(windows))
    lookup = uses["model.embed_tokens"][-1]
    g2 = sum(y.grad.reshape(-1, y.shape[-1]).square().sum(0) for _, y in seen["model.embed_tokens#lookup"]).numpy()
    np.testing.assert_allclose(np.asarray(lookup.rows), reads, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lookup.cols), g2, rtol=2e-3)
    assert len(uses["model.embed_tokens"]) == (2 if tied else 1)


# --- whole conversions -----------------------------------------------------------------------------

FEW = 512  # calibration tokens: enough to rank the tensors, quick to measure


def test_tiny_model_meets_the_target_and_records_the_method(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama", head_dim=32)
    report = convert(src, tmp_path / "out", target_bpw=5.0, calibration_tokens=FEW)
    assert bits_per_weight(tmp_path / "out", src) <= 5.0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_method"] == {"method": "allocate", "target_bpw": 5.0,
                                             "calibration": "python-reference", "calibration_tokens": 512}
    assert report.method == config["quantization_method"]
    assert any("method:     allocate" in line for line in report.lines())


def test_calibration_file_and_cli(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama", head_dim=32)
    text = tmp_path / "notes.txt"
    text.write_text(texts.evaluation_text()[:20000], encoding="utf-8")
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "out"), "--target-bpw", "6",
                                       "--calibration-tokens", "512", "--calibration", str(text)])
    assert result.exit_code == 0, result.output
    assert "method:     allocate (target_bpw: 6" in result.output
    method = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_method"]
    assert method["calibration"] == "notes.txt" and method["calibration_tokens"] == 512
    assert bits_per_weight(tmp_path / "out", src) <= 6.0


@pytest.mark.parametrize("kwargs, words", [
    ({"target_bpw": 4.0, "bits": 4}, "drop --bits"),
    ({"target_bpw": 4.0, "group_size": 64}, "drop --group-size"),
    ({"target_bpw": 4.0, "recipe": "mixed-3-6"}, "drop --recipe"),
    ({"target_bpw": 4.0, "q_mode": "mxfp4"}, "drop --q-mode"),
    ({"target_bpw": 9.0}, "at most 8.5"),
    ({"target_bpw": 0.0}, "out of range"),
    ({"target_bpw": 1.0}, "below the smallest"),
    ({"calibration": "x.txt"}, "pass --method gptq or --target-bpw, or drop --calibration"),
])
def test_refusals(hf_checkpoint, tmp_path, kwargs, words):
    src = hf_checkpoint("llama", head_dim=32)
    with pytest.raises(InvalidOptionError, match=words) as e:
        convert(src, tmp_path / "out", **kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


# --- the real SmolLM2-135M weights -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_float(smollm2_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "float"
    convert(smollm2_gguf, out, dequantize=True)
    return out


def eval_perplexity(folder: Path, source: Path) -> float:
    ids = load_tokenizer_from_dir(source).encode(texts.evaluation_text())[: 2 * 512 + 1]
    return perplexity(load_model(folder, dtype="float32"), ids)


@pytest.fixture(scope="module")
def smollm2_outputs(smollm2_float, tmp_path_factory) -> dict[str, Path]:
    """Plain rounding at 4-bit g64, 3-bit g32 and 3-bit g64, and an allocation at each one's size
    (computed from its files) and at 3.5 bits/weight, on 512 calibration tokens."""
    src, root = smollm2_float, tmp_path_factory.mktemp("allocated")
    outputs = {}
    for bits, group in ((4, 64), (3, 32), (3, 64)):
        plain = outputs[f"{bits}g{group}"] = root / f"{bits}g{group}"
        convert(src, plain, quantize=True, bits=bits, group_size=group)
        if (bits, group) != (3, 64):
            target = bits_per_weight(plain, src)
            convert(src, root / f"at{bits}g{group}", target_bpw=target, calibration_tokens=FEW)
            outputs[f"at {bits}g{group}"] = root / f"at{bits}g{group}"
    convert(src, root / "3.5", target_bpw=3.5, calibration_tokens=FEW)
    outputs["3.5"] = root / "3.5"
    return outputs


@pytest.mark.parametrize("rival", ["4g64", "3g32"])
def test_smollm2_allocation_beats_plain_rounding_of_the_same_size(smollm2_float, smollm2_outputs, rival):
    src, plain, ours = smollm2_float, smollm2_outputs[rival], smollm2_outputs[f"at {rival}"]
    target = bits_per_weight(plain, src)
    assert target - 0.02 <= bits_per_weight(ours, src) <= target
    assert eval_perplexity(ours, src) < eval_perplexity(plain, src)


def test_smollm2_at_3_5_bits_beats_plain_3_bit(smollm2_float, smollm2_outputs):
    """3-bit g64 is 3.5 bits/weight with float16 scales: the same size, spent evenly."""
    src, ours = smollm2_float, smollm2_outputs["3.5"]
    assert 3.48 <= bits_per_weight(ours, src) <= 3.5
    assert bits_per_weight(smollm2_outputs["3g64"], src) >= bits_per_weight(ours, src)
    assert eval_perplexity(ours, src) < 0.8 * eval_perplexity(smollm2_outputs["3g64"], src)


def test_smollm2_allocated_folder_loads_in_mlx_lm_with_our_logits(smollm2_outputs):
    out = smollm2_outputs["at 3g32"]
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert len({(v["bits"], v["group_size"]) for v in quant.values() if isinstance(v, dict)}) > 1  # mixed, per layer
    assert_mlx_lm_gives_our_logits(out)


def test_allocation_and_gptq_compose(hf_checkpoint, tmp_path):
    """--target-bpw chooses the precisions, then GPTQ rounds the block layers at them: the same
    per-layer precisions as the allocation alone, a different rounding, the target still met."""
    src = hf_checkpoint("llama", head_dim=32)
    convert(src, tmp_path / "alone", target_bpw=4.5, calibration_tokens=FEW)
    convert(src, tmp_path / "both", target_bpw=4.5, method="gptq", calibration_tokens=FEW)
    alone, both = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("alone", "both"))
    assert both["quantization_method"] == {"method": "allocate+gptq", "target_bpw": 4.5,
                                           "calibration": "python-reference", "calibration_tokens": FEW}
    assert both["quantization"] == alone["quantization"]
    assert bits_per_weight(tmp_path / "both", src) <= 4.5
    a, b = (mx.load(str(tmp_path / name / "model.safetensors")) for name in ("alone", "both"))
    block = [k for k in a if ".layers." in k and k.endswith(".weight") and a[k].dtype == mx.uint32]
    assert block and any(not mx.array_equal(a[k], b[k]).item() for k in block)
