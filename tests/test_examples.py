"""The README's examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_next_token_example(hf_checkpoint):
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "next_token.py"), str(hf_checkpoint("llama")), "hello there"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert "Warning" not in run.stderr, run.stderr  # e.g. mlx imported before mlxinfer (test_blas)
    out = run.stdout
    lines = out.splitlines()
    assert lines[0].endswith("top 5 next tokens:") and len(lines) == 6
    probs = [float(line.split()[0]) for line in lines[1:]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001


def python_sources() -> list[tuple[str, str]]:
    """(where, code) of every example script and every Python block of the README and docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [(f"{page.relative_to(ROOT)}'s Python block {i + 1}", b) for page in pages
              for i, b in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M))]
    return [*((f"examples/{p.name}", p.read_text()) for p in sorted((ROOT / "examples").glob("*.py"))), *blocks]


@pytest.mark.parametrize("where, code", python_sources(), ids=[w for w, _ in python_sources()])
def test_examples_import_mlxinfer_before_mlx(where, code):
    """As the README's Linux note says: MLX imported first keeps its slow reference BLAS."""
    imports = re.findall(r"^\s*(?:import|from)\s+(mlxinfer|convert|mlx)\b", code, flags=re.M)
    if "mlx" in imports:
        ours = [imports.index(m) for m in ("mlxinfer", "convert") if m in imports]
        assert ours and min(ours) < imports.index("mlx"), where


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "mlxinfer", "--help"], capture_output=True, text=True, check=True)
    assert "On-device LLM inference" in out.stdout


def test_stream_example(hf_checkpoint):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "stream.py"), str(hf_checkpoint("llama")), "hello there"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    stats = out.strip().splitlines()[-1]
    assert stats.startswith("[") and "prompt tokens" in stats and "finish:" in stats


def test_bench_command_json(hf_checkpoint):
    import json

    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    result = CliRunner().invoke(main, ["bench", str(hf_checkpoint("llama")), "--prompt-tokens", "16",
                                       "--gen-tokens", "4", "--repeat", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["runs"] == 2 and data["decode_tps"][0] > 0 and data["prefill_tps"][1] <= data["prefill_tps"][2]
    text = CliRunner().invoke(main, ["bench", str(hf_checkpoint("llama")), "--prompt-tokens", "16",
                                     "--gen-tokens", "4", "--repeat", "1"])
    assert text.exit_code == 0 and "decode tok/s" in text.output


def test_cli_error_is_one_line(tmp_path):
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    result = CliRunner().invoke(main, ["bench", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.strip().startswith("error:") and len(result.output.strip().splitlines()) == 1


def test_batch_example_equals_each_prompt_alone(hf_checkpoint):
    import json

    import mlxinfer

    folder = hf_checkpoint("llama")
    prompts = ["hello there", "the quick brown fox jumps", "a"]
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "batch.py"), str(folder), *prompts],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["prompt"])
    model, tokenizer = mlxinfer.load(folder)
    assert [r["text"] for r in rows] == [mlxinfer.generate(model, tokenizer, p, max_tokens=32) for p in prompts]
