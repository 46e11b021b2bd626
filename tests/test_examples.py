"""The README's examples run as written."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_next_token_example(hf_checkpoint):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "next_token.py"), str(hf_checkpoint("llama")), "hello there"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    lines = out.splitlines()
    assert lines[0].endswith("top 5 next tokens:") and len(lines) == 6
    probs = [float(line.split()[0]) for line in lines[1:]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "mlxinfer.cli", "--help"], capture_output=True, text=True, check=True)
    assert "On-device LLM inference" in out.stdout
