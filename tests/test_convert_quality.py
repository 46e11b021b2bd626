"""What `convert --eval-ppl` and `inspect` say about a quantization, against oracles computed
apart: KL divergence and top-token agreement from transformers' float logits and mlx-lm's
loading of the output, through torch's own `kl_div`; bits per weight from the safetensors files'
byte spans over transformers' parameter count; the per-layer bits from config.json."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.base.safetensors import safetensors_header
from mlxinfer.cli.main import main

torch = pytest.importorskip("torch")


def run_cli(*args):
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def line(output: str, label: str) -> str:
    return next(text for text in output.splitlines() if text.strip().startswith(label))


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


def stored_bytes(folder: Path) -> int:
    """Bytes of every tensor in the folder's safetensors files, from their headers' byte spans."""
    headers = [safetensors_header(f) for f in folder.glob("*.safetensors")]
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for h in headers for e in h.values())


@pytest.fixture(scope="module")
def converted(hf_checkpoint, tmp_path_factory):
    from conftest import CORPUS

    src = hf_checkpoint("llama")
    folder = tmp_path_factory.mktemp("quality")
    text = folder / "eval.txt"
    text.write_text(" ".join(CORPUS[:15]))
    result = run_cli(src, "-o", folder / "out", "--bits", "2", "--group-size", "64", "--eval-ppl", text)
    assert result.exit_code == 0, result.output
    return src, folder / "out", text.read_text(), result.output


def test_kl_divergence_and_same_top_token_match_torch(converted):
    import mlx.core as mx
    import mlx_lm
    from transformers import AutoModelForCausalLM

    src, out, text, output = converted
    kl, same = numbers(line(output, "KL:"))[:2]
    ids = mlxinfer.load_tokenizer(src).encode(text)
    assert len(ids) <= 513  # one window
    with torch.no_grad():
        source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        p = torch.log_softmax(source(torch.tensor([ids[:-1]])).logits[0].float(), dim=-1)
    model, _ = mlx_lm.load(str(out))
    q = torch.log_softmax(torch.from_numpy(np.array(model(mx.array([ids[:-1]]))[0].astype(mx.float32))), dim=-1)
    # kl_div(input=log q, target=log p) sums p * (log p - log q): KL(source || converted)
    want = torch.nn.functional.kl_div(q, p, reduction="sum", log_target=True).item() / p.shape[0]
    reverse = torch.nn.functional.kl_div(p, q, reduction="sum", log_target=True).item() / p.shape[0]
    assert want > 0.1 and abs(reverse - want) > 5e-4  # the test tells a zero and the wrong direction apart
    assert kl == pytest.approx(want, abs=2e-5)  # the report's 5 decimals
    assert same / 100 == pytest.approx((p.argmax(-1) == q.argmax(-1)).float().mean().item(), abs=1 / len(ids))


def test_bits_per_weight_counts_every_stored_byte_over_the_float_parameters(converted):
    from transformers import AutoModelForCausalLM

    src, out, _, output = converted
    parameters = AutoModelForCausalLM.from_pretrained(src).num_parameters()
    assert numbers(line(output, "bits/weight:"))[0] == pytest.approx(stored_bytes(out) * 8 / parameters, abs=5e-4)
    assert "embedding and LM head included" in line(output, "bits/weight:")


def test_the_bits_chosen_per_layer_are_summarised_from_config_json(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama", num_hidden_layers=4)
    result = run_cli(src, "-o", tmp_path / "out", "--recipe", "mixed-3-6", "--group-size", "32")
    assert result.exit_code == 0, result.output
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    layers = {k: v["bits"] for k, v in quant.items() if isinstance(v, dict)}
    high, low = sum(b == 6 for b in layers.values()), sum(b == 3 for b in layers.values())
    assert high and low and high + low == len(layers)
    summary = line(result.output, "quantized:")
    assert f"{low} x 3-bit g32" in summary and f"{high} x 6-bit g32" in summary
    assert f"({len(layers)} layers)" in summary
    assert "embedding 6-bit g32; LM head 6-bit g32" in summary  # untied: both named


def test_eval_ppl_takes_the_builtin_evaluation_text(roomy, tmp_path):
    from mlxinfer.convert import texts

    result = run_cli(roomy, "-o", tmp_path / "out", "--bits", "8", "--eval-ppl", "python-reference")
    assert result.exit_code == 0, result.output
    ids = mlxinfer.load_tokenizer(roomy).encode(texts.evaluation_text())
    assert f"of {min(len(ids), 4097) - 1} positions" in line(result.output, "KL:")
    assert "python-reference" in CliRunner().invoke(main, ["convert", "--help"]).output


def test_a_missing_eval_text_is_one_line_before_any_work(hf_checkpoint, tmp_path):
    result = run_cli(hf_checkpoint("llama"), "-o", tmp_path / "out", "-q", "--eval-ppl", tmp_path / "nope.txt")
    assert result.exit_code != 0 and "cannot read --eval-ppl file" in result.output
    assert not (tmp_path / "out").exists()


def test_inspect_says_how_the_weights_were_quantized(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    src, written, _, _ = converted
    out = shutil.copytree(written, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    config["quantization_method"] = {"method": "gptq", "calibration": "python-reference", "target_bpw": 3.5}
    (out / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["inspect", "-m", str(out), "hi", "--steps", "1"])
    assert result.exit_code == 0, result.output
    weights = line(result.output, "weights:")
    parameters = AutoModelForCausalLM.from_pretrained(src).num_parameters()
    assert numbers(weights)[0] == pytest.approx(stored_bytes(out) * 8 / parameters, abs=5e-4)
    assert "16 x 2-bit g64 (16 layers); embedding 2-bit g64; LM head 2-bit g64" in weights
    assert "method gptq (calibration: python-reference, target_bpw: 3.5)" in weights
    as_json = json.loads(CliRunner().invoke(main, ["inspect", "-m", str(out), "hi", "--steps", "1", "--json"]).output)
    assert as_json["weights"]["method"]["method"] == "gptq"


def test_the_summary_names_the_tied_embedding_of_a_real_gguf(smollm2_gguf, tmp_path):
    """SmolLM2's Q4_1 GGUF converted as stored: the summary counts what the gguf package reads."""
    gguf = pytest.importorskip("gguf")
    from mlxinfer.convert import convert

    matrices = {t.name: t.tensor_type.name for t in gguf.GGUFReader(smollm2_gguf).tensors if len(t.shape) == 2}
    types = list(matrices.values())
    assert matrices["token_embd.weight"] == "Q8_0" and types.count("Q8_0") == 1
    assert "output.weight" not in matrices  # tied: the embedding is the output layer
    report = convert(smollm2_gguf, tmp_path / "out")
    assert report.quantized == (f"{types.count('Q4_1')} x 4-bit g32, 1 x 8-bit g32 ({len(types)} layers); "
                                "embedding 8-bit g32, also the LM head")
