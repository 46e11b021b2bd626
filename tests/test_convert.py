"""`convert` on Hugging Face and MLX folders, checked against mlx-lm's converter as the oracle:
same packed tensors bit for bit, same config layout, logits within 1e-5, and each side's
loader opens the other's output. Plus atomicity, streaming and the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.cli.main import main
from mlxinfer.base.errors import ConversionError, ModelNotFoundError, UnsupportedArchitectureError

IDS = np.random.default_rng(0).integers(0, 500, size=(2, 16))
TOL = 1e-5
REPO = Path(__file__).resolve().parents[1]


def tensors(folder: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


def assert_same_tensors(ours: dict[str, mx.array], ref: dict[str, mx.array]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, value in ref.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert mx.array_equal(ours[name], value).item(), f"{name} differs"


UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def quantized_layers(model) -> set[str]:
    """Checkpoint paths of the quantized layers (projections merged after loading counted as the originals)."""
    paths = set()
    for path, m in model.named_modules():
        if hasattr(m, "bits"):
            parent, _, name = path.rpartition(".")
            paths |= {f"{parent}.{n}" for n in UNFUSED[name]} if name in UNFUSED else {path}
    return paths


def logits(model) -> np.ndarray:
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def mlx_lm_logits(folder: Path) -> np.ndarray:
    import mlx_lm

    model, _ = mlx_lm.load(str(folder))
    return logits(model)


def quant_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    assert config.get("quantization") == config.get("quantization_config")
    return config.get("quantization")


def assert_nothing_written(output: Path) -> None:
    assert not output.exists()
    assert not [p for p in output.parent.glob(f".{output.name}.*")], "a partial folder was left behind"


# --- uniform quantization, recipes, float and MLX sources ---------------------------------------


@pytest.mark.parametrize("bits,group_size", [(2, 32), (3, 32), (4, 32), (5, 32), (6, 32), (8, 32), (4, 64), (4, 128)])
def test_uniform_quantization_equals_mlx_lm(hf_checkpoint, mlx_lm_quantized, tmp_path, bits, group_size):
    import mlx_lm
    from mlx_lm.utils import compute_bits_per_weight

    src = hf_checkpoint("llama")
    ref = mlx_lm_quantized(src, bits=bits, group_size=group_size)
    report = convert(src, tmp_path / "out", quantize=True, bits=bits, group_size=group_size)
    out = tmp_path / "out"

    assert_same_tensors(tensors(out), tensors(ref))
    assert quant_config(out) == quant_config(ref)
    ours = mlxinfer.load(out)[0]
    np.testing.assert_allclose(logits(ours), mlx_lm_logits(ref), atol=TOL, rtol=0)
    np.testing.assert_allclose(mlx_lm_logits(out), mlx_lm_logits(ref), atol=TOL, rtol=0)
    ref_model, _ = mlx_lm.load(str(ref))
    assert report.bits_per_weight == pytest.approx(compute_bits_per_weight(ref_model), rel=1e-9)
    # Layers mlx-lm leaves in float (input dim not divisible by the group) are the ones we report.
    unquantized = {p for p, m in ref_model.named_modules() if type(m).__name__ in ("Linear", "Embedding")}
    assert set(report.kept_float) == unquantized
    assert bool(unquantized) == (group_size == 128)
    assert any("unquantized" in line for line in report.lines()) == bool(unquantized)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4"])
def test_floating_point_modes_equal_mlx_lm(hf_checkpoint, tmp_path, mode):
    """--q-mode: MLX's microscaling formats (scales only, uint8), as mlx-lm's converter writes them."""
    from mlx_lm import convert as mlx_lm_convert

    src, out, ref = hf_checkpoint("llama"), tmp_path / "out", tmp_path / "ref"
    mlx_lm_convert(str(src), str(ref), quantize=True, q_mode=mode, dtype="float32")
    report = convert(src, out, q_mode=mode)
    assert_same_tensors(tensors(out), tensors(ref))
    assert quant_config(out) == quant_config(ref)
    assert not [k for k in tensors(out) if k.endswith(".biases")]
    np.testing.assert_allclose(logits(mlxinfer.load(out)[0]), mlx_lm_logits(ref), atol=TOL, rtol=0)
    np.testing.assert_allclose(mlx_lm_logits(out), mlx_lm_logits(ref), atol=TOL, rtol=0)
    assert any(mode in line for line in report.lines())


def recipe_predicate(config: dict):
    """mlx-lm quantizing each layer exactly as our config.json says (to compare bits, not choices)."""
    return lambda path, module: config.get(path, False)


@pytest.mark.parametrize("recipe", ["mixed-3-6", "mixed-4-6", "mixed-4-8"])
def test_recipes_match_mlx_lm(hf_checkpoint, mlx_lm_quantized, tmp_path, recipe):
    src = hf_checkpoint("llama", num_hidden_layers=4)
    report = convert(src, tmp_path / "out", recipe=recipe, group_size=32)
    out = tmp_path / "out"
    ours = quant_config(out)
    _, low, high = recipe.split("-")
    per_layer = {k: v for k, v in ours.items() if isinstance(v, dict)}
    assert set(per_layer) == quantized_layers(mlxinfer.load(out)[0])
    assert per_layer["model.embed_tokens"]["bits"] == per_layer["lm_head"]["bits"] == int(high)
    assert report.precisions[f"{high}-bit g32"] > 2 and report.precisions[f"{low}-bit g32"] > 2

    mlx_lm_recipe = recipe.replace("-", "_")
    if mlx_lm_recipe in ("mixed_3_6", "mixed_4_6"):
        theirs_folder = mlx_lm_quantized(src, bits=int(low), group_size=32, recipe=mlx_lm_recipe)
        theirs = quant_config(theirs_folder)
        # Same choice for every linear layer; we also keep the embedding high (mlx-lm keeps it low).
        for path, entry in per_layer.items():
            expected = int(high) if path == "model.embed_tokens" else theirs[path]["bits"]
            assert entry == {**theirs[path], "bits": expected}, path
        model = mlxinfer.load(theirs_folder)[0]  # mlxinfer opens mlx-lm's recipe output
        np.testing.assert_allclose(logits(model), mlx_lm_logits(theirs_folder), atol=TOL, rtol=0)

    same = mlx_lm_quantized(src, bits=int(low), group_size=32, recipe=recipe_predicate(ours))
    assert_same_tensors(tensors(out), tensors(same))
    assert quant_config(out) == quant_config(same)
    np.testing.assert_allclose(logits(mlxinfer.load(out)[0]), mlx_lm_logits(same), atol=TOL, rtol=0)
    np.testing.assert_allclose(mlx_lm_logits(out), mlx_lm_logits(same), atol=TOL, rtol=0)


def test_float_conversion_is_lossless_and_casts(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama")
    original = tensors(src)
    report = convert(src, tmp_path / "f32")
    assert_same_tensors(tensors(tmp_path / "f32"), original)
    assert quant_config(tmp_path / "f32") is None and report.bits_per_weight == 32
    np.testing.assert_allclose(
        logits(mlxinfer.load(tmp_path / "f32")[0]), logits(mlxinfer.load(src)[0]), atol=0, rtol=0
    )
    convert(src, tmp_path / "bf16", dtype="bfloat16")
    assert_same_tensors(tensors(tmp_path / "bf16"), {k: v.astype(mx.bfloat16) for k, v in original.items()})
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert np.isfinite(mlx_lm_logits(tmp_path / "bf16")).all()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "f32" / name).read_bytes() == (src / name).read_bytes()


def test_mlx_source_dequantize_requantize_and_copy(hf_checkpoint, mlx_lm_quantized, tmp_path):
    import mlx_lm
    from mlx_lm.utils import dequantize_model, quantize_model

    q4 = mlx_lm_quantized(hf_checkpoint("llama"), bits=4, group_size=32)
    model, _ = mlx_lm.load(str(q4))
    dequantize_model(model)
    floats = dict(tree_flatten(model.parameters()))

    convert(q4, tmp_path / "deq", dequantize=True)
    assert quant_config(tmp_path / "deq") is None
    assert_same_tensors(tensors(tmp_path / "deq"), floats)

    convert(q4, tmp_path / "q8", quantize=True, bits=8, group_size=64)
    config = {k: v for k, v in json.loads((q4 / "config.json").read_text()).items() if "quantization" not in k}
    requantized, _ = quantize_model(model, config, 64, 8)
    assert_same_tensors(tensors(tmp_path / "q8"), dict(tree_flatten(requantized.parameters())))
    np.testing.assert_allclose(mlx_lm_logits(tmp_path / "q8"), logits(requantized), atol=TOL, rtol=0)

    # Same settings as the source, or no options at all: the packed tensors pass through untouched.
    convert(q4, tmp_path / "same", quantize=True, bits=4, group_size=32)
    convert(q4, tmp_path / "copy")
    assert_same_tensors(tensors(tmp_path / "same"), tensors(q4))
    assert_same_tensors(tensors(tmp_path / "copy"), tensors(q4))


# --- output layout, streaming, report --------------------------------------------------------------


def test_sharded_output_streams_with_bounded_memory(hf_checkpoint, tmp_path):
    import mlx_lm

    src = hf_checkpoint("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    report = convert(src, tmp_path / "out", shard_size=1 << 20)
    out = tmp_path / "out"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 8 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors(out).values())
    for file in files:
        assert mx.load(str(out / file), return_metadata=True)[1] == {"format": "mlx"}
    assert_same_tensors(tensors(out), tensors(src))
    # Streaming: peak memory is a couple of shards plus working space, far below the model's size.
    assert report.peak_memory < total / 3, (report.peak_memory, total)
    model, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(logits(model), logits(mlx_lm.load(str(src))[0]), atol=TOL, rtol=0)


def test_report_and_progress_bar(hf_checkpoint, tmp_path, capsys):
    src = hf_checkpoint("llama")
    report = convert(src, tmp_path / "quiet", quantize=True, bits=8)
    assert capsys.readouterr().err == ""  # not a TTY: no progress bar
    report = convert(src, tmp_path / "bar", quantize=True, bits=8, progress=True)
    err = capsys.readouterr().err
    assert "100%" in err and "21/21 tensors" in err
    text = "\n".join(report.lines())
    assert report.output_bytes == sum(f.stat().st_size for f in (tmp_path / "bar").iterdir())
    assert report.source_bytes == (src / "model.safetensors").stat().st_size
    assert report.precisions == {"8-bit g64": 16, "float32": 5}
    for needle in ("bits/weight", "16 x 8-bit g64", "5 x float32", "peak memory", "time", "21 x float32"):
        assert needle in text


# --- CLI, safety and errors --------------------------------------------------------------------------


def run_cli(*args: str):
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def test_cli_converts_and_refuses_to_overwrite(hf_checkpoint, mlx_lm_quantized, tmp_path):
    src = hf_checkpoint("llama")
    out = tmp_path / "out"
    result = run_cli(src, "-o", out, "--bits", "8", "--group-size", "32")
    assert result.exit_code == 0, result.output
    assert "bits/weight" in result.output
    assert_same_tensors(tensors(out), tensors(mlx_lm_quantized(src, bits=8, group_size=32)))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    again = run_cli(src, "-o", out, "-q")
    assert again.exit_code == 1
    assert again.output.count("\n") == 1 and "--force" in again.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    forced = run_cli(src, "-o", out, "-q", "--force")
    assert forced.exit_code == 0, forced.output
    assert quant_config(out)["bits"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_force_never_replaces_the_source(hf_checkpoint, copy_checkpoint):
    src = copy_checkpoint(hf_checkpoint("llama"))
    with pytest.raises(ConversionError, match="would replace the source"):
        convert(src, src, force=True, quantize=True)
    assert (src / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "args,error",
    [
        (["--bits", "7"], "--bits 7 is not supported by MLX; choose one of 2, 3, 4, 5, 6, 8"),
        (["--group-size", "16"], "--group-size 16 is not supported by MLX"),
        (["--recipe", "mixed-9-9"], "unknown recipe 'mixed-9-9'"),
        (["--dtype", "float64"], "dtype 'float64' is not supported"),
        (["-q", "--dequantize"], "cannot be combined"),
        (["--shard-size", "lots"], "is not a size"),
        (["--q-mode", "int3"], "--q-mode 'int3' is not an MLX quantization mode; choose one of affine, mxfp4"),
        (["--q-mode", "mxfp4", "--bits", "8"], "--q-mode mxfp4 has --bits 4; drop --bits 8"),
        (["--q-mode", "nvfp4", "--recipe", "mixed-4-6"], "cannot be combined with --q-mode nvfp4"),
        (["--q-mode", "mxfp8", "--dequantize"], "cannot be combined"),
    ],
)
def test_bad_options_one_line_nothing_written(hf_checkpoint, tmp_path, args, error):
    result = run_cli(hf_checkpoint("llama"), "-o", tmp_path / "out", *args)
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and result.output.count("\n") == 1 and error in result.output
    assert_nothing_written(tmp_path / "out")


def test_bad_sources_one_line_nothing_written(hf_checkpoint, copy_checkpoint, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ModelNotFoundError, match="no model folder"):
        convert(tmp_path / "missing", out)
    with pytest.raises(ModelNotFoundError, match="no GGUF file"):
        convert(tmp_path / "missing.gguf", out)
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        convert("mlxinfer-tests/definitely-not-a-real-model", out)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        convert(text, out)
    alien = copy_checkpoint(hf_checkpoint("llama"))
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))
    with pytest.raises(UnsupportedArchitectureError, match="frobnicator"):
        convert(alien, out)
    assert_nothing_written(out)


def test_unwritable_output_location(hf_checkpoint, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConversionError, match="choose a writable -o folder") as e:
        convert(hf_checkpoint("llama"), blocker / "out", quantize=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConversionError, match="is not a folder"):
        convert(hf_checkpoint("llama"), blocker)
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(ConversionError, match="choose a writable -o folder"):
            convert(hf_checkpoint("llama"), locked / "out")
        assert list(locked.iterdir()) == []


def test_disk_full_leaves_nothing(hf_checkpoint, tmp_path, monkeypatch):
    import errno

    import mlxinfer.convert.writer as writer

    src, out = hf_checkpoint("llama"), tmp_path / "deep" / "out"
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ConversionError, match="not enough disk space"):
        convert(src, out)
    monkeypatch.undo()
    assert not (tmp_path / "deep").exists()

    def full(file, arrays, metadata=None):
        Path(file).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.mx, "save_safetensors", full)
    with pytest.raises(ConversionError, match="disk full"):
        convert(src, out)
    assert not (tmp_path / "deep").exists()

    def short(file, arrays, metadata=None):
        Path(file).write_bytes(b"x" * 9)

    monkeypatch.setattr(writer.mx, "save_safetensors", short)
    with pytest.raises(mlxinfer.MlxinferError, match="truncated"):
        convert(src, out)  # a write that silently came up short is caught by the verification
    assert not (tmp_path / "deep").exists()


def test_disk_full_while_copying_the_tokenizer(hf_checkpoint, tmp_path, monkeypatch):
    import errno

    import mlxinfer.convert.sources as sources

    def full(src, dst, *args, **kwargs):
        Path(dst).write_bytes(b"{")
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(sources.shutil, "copyfile", full)
    result = run_cli(hf_checkpoint("llama"), "-o", tmp_path / "deep" / "out")
    assert result.exit_code == 1
    assert result.output.count("\n") == 1, result.output
    assert result.output.startswith("error: disk full while writing the tokenizer files")
    assert not (tmp_path / "deep").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, where even root cannot write")
@pytest.mark.parametrize("out", ["/proc/x", "/proc/x/y"])
def test_unwritable_output_is_not_reported_as_a_full_disk(hf_checkpoint, out):
    result = run_cli(hf_checkpoint("llama"), "-o", out)
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "not writable" in result.output, result.output
    assert "disk space" not in result.output


def test_a_folder_that_appears_during_the_conversion_is_left_alone(hf_checkpoint, tmp_path, monkeypatch):
    import mlxinfer.convert.api as api

    out, verify = tmp_path / "out", api.verify

    def verify_then_someone_writes(*args):
        verify(*args)
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(api, "verify", verify_then_someone_writes)
    result = run_cli(hf_checkpoint("llama"), "-o", out, "-q")
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "was filled by something else" in result.output, result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the stage folder was left behind"


def test_ctrl_c_after_the_output_is_in_place_reports_success(hf_checkpoint, tmp_path, monkeypatch):
    out, rename = tmp_path / "out", os.rename

    def rename_then_ctrl_c(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if Path(dst) == out:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(os, "rename", rename_then_ctrl_c)
    result = run_cli(hf_checkpoint("llama"), "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert "Aborted" not in result.output and result.output.startswith("converted")
    assert quant_config(out)["bits"] == 4


def test_ctrl_c_during_eval_ppl_keeps_the_written_output(hf_checkpoint, tmp_path, monkeypatch):
    import mlxinfer.convert.perplexity as perplexity

    def interrupted(*args):
        raise KeyboardInterrupt

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    monkeypatch.setattr(perplexity, "compare", interrupted)
    result = run_cli(hf_checkpoint("llama"), "-o", tmp_path / "out", "-q", "--eval-ppl", text)
    assert result.exit_code == 0, result.output
    assert "perplexity: not measured (interrupted)" in result.output
    assert quant_config(tmp_path / "out")["bits"] == 4


PAUSED_CONVERT = """
import sys
import mlxinfer.convert.writer as writer
from mlxinfer.cli.main import main
save, saved = writer._save, []
def save_then_wait(file, arrays):
    save(file, arrays)
    saved.append(file)
    if len(saved) == 2:  # two shards on disk: say so, then wait for a line on stdin (or a signal)
        print("paused", flush=True)
        sys.stdin.readline()
writer._save = save_then_wait
main(["convert", sys.argv[1], "-o", sys.argv[2], "-q", "--shard-size", "8KB"])
"""


def start_paused_conversion(src: Path, out: Path) -> subprocess.Popen:
    """A conversion in another process, returned once it has written its second shard; it waits
    there until a line arrives on its stdin, so nothing the test does races its progress."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CONVERT, str(src), str(out)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    said = []
    for line in proc.stdout:  # anything before the marker (a one-time notice) is kept for the failure message
        if line == "paused\n":
            return proc
        said.append(line)
    raise AssertionError(f"the conversion ended before its second shard: {''.join(said)}")


def test_concurrent_conversions_to_one_output(hf_checkpoint, tmp_path):
    """Another process converts to the same folder: its live stage folder is not taken for
    an abandoned one, exactly one result lands, and the later one is refused in one line."""
    src, out = hf_checkpoint("llama"), tmp_path / "out"
    other = start_paused_conversion(src, out)
    ours = run_cli(src, "-o", out, "--bits", "8")
    assert ours.exit_code == 0, ours.output
    output = other.communicate("go on\n", timeout=120)[0]
    assert other.returncode == 1, output
    assert output.count("\n") == 1 and "was filled by something else" in output, output
    assert quant_config(out)["bits"] == 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killed_conversion_leaves_no_output(hf_checkpoint, tmp_path, sig):
    out = tmp_path / "out"
    proc = start_paused_conversion(hf_checkpoint("llama"), out)
    proc.send_signal(sig)
    proc.wait(timeout=60)  # stdin stays open: the conversion can only end by the signal
    output = proc.stdout.read()
    proc.stdin.close()
    proc.stdout.close()
    assert proc.returncode != 0, output
    assert not out.exists()
    if sig != signal.SIGKILL:  # a clean stop also removes the hidden partial folder
        assert_nothing_written(out)
    if sig == signal.SIGTERM:
        assert "error: conversion stopped by SIGTERM; nothing was written" in output
    if sig == signal.SIGKILL:  # the next conversion to the folder removes the stage folder left behind
        assert list(tmp_path.glob(".out.partial-*"))
        assert run_cli(hf_checkpoint("llama"), "-o", out, "-q").exit_code == 0
        assert not list(tmp_path.glob(".out.*"))


def test_eval_ppl_matches_transformers(hf_checkpoint, tmp_path):
    import torch
    from conftest import CORPUS
    from transformers import AutoModelForCausalLM

    src = hf_checkpoint("llama")
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(CORPUS[:15]))
    result = run_cli(src, "-o", tmp_path / "out", "--bits", "8", "--eval-ppl", text)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "perplexity" in line)
    source_ppl, converted_ppl = (float(x) for x in line.split()[2:5:2])

    ids = mlxinfer.load_tokenizer(src).encode(text.read_text())
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 512):
            chunk = torch.tensor([ids[start : start + 513]])
            loss = model(chunk, labels=chunk).loss.item()
            nll, count = nll + loss * (chunk.shape[1] - 1), count + chunk.shape[1] - 1
    assert source_ppl == pytest.approx(float(np.exp(nll / count)), rel=1e-3)
    assert converted_ppl == pytest.approx(source_ppl, rel=0.05)


@pytest.mark.parametrize("entry", [{"group_size": 32}, {"bits": "4", "group_size": 32}, "four"])
def test_per_layer_quantization_entry_without_integer_bits_is_one_line(hf_checkpoint, tmp_path, entry):
    """A mixed-precision folder whose config.json lost a layer's bits: one line naming the layer."""
    from mlxinfer.base.errors import MlxinferError

    src = tmp_path / "src"
    convert(hf_checkpoint("llama", num_hidden_layers=4), src, recipe="mixed-4-6", group_size=32)
    config = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config[key]["model.layers.0.self_attn.q_proj"] = entry
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlxinferError, match=r"model\.layers\.0\.self_attn\.q_proj") as e:
        convert(src, tmp_path / "out", dequantize=True)
    assert "\n" not in str(e.value)
