"""Llama 3 GGUFs written by llama.cpp's own converter (`convert_hf_to_gguf.py`, taken from the
llama-cpp-python sdist on PyPI), converted back with ours and compared with transformers on
the original checkpoint.

llama.cpp keeps Llama 3's rope scaling only as a `rope_freqs` tensor of per-frequency
divisors. The converted folder must run exactly those frequencies, and record Llama 3
settings that transformers and mlx-lm read as the same frequencies wherever such settings
exist. The checkpoints keep Llama 3's whole vocabulary because the converter recognises the
real tokenizer by the ids it gives; the prompt is long enough that the scaled low
frequencies turn by whole radians."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_hf_checkpoint, llama_cpp_gguf

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.convert.gguf_file import GGUFFile
from mlxinfer.convert.gguf_source import llama3_scaling
from mlxinfer.models.cache import make_cache
from mlxinfer.base.errors import CorruptCheckpointError

torch = pytest.importorskip("torch")

VOCAB = 128256
PROMPT = np.random.default_rng(3).integers(0, 128000, size=(1, 768))
LAST = 4  # positions whose logits are compared (a full row is 128256 floats)

def llama3(factor: float, low: float, high: float, original: int) -> dict:
    return {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": low,
        "high_freq_factor": high, "original_max_position_embeddings": original,
    }


SMALL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=131072)
# name: config overrides of a tiny Llama (scaled-down shapes, real rope settings)
CASES = {
    "meta-3.1": dict(SMALL, head_dim=128, rope_parameters=llama3(8.0, 1.0, 4.0, 8192)),
    "original-4096": dict(SMALL, head_dim=64, rope_parameters=llama3(8.0, 1.0, 4.0, 4096)),
    "factors-16-2-6": dict(SMALL, head_dim=128, rope_parameters=llama3(16.0, 2.0, 6.0, 16384)),
    "3.2-1b": dict(SMALL, head_dim=64, tie_word_embeddings=True, rope_parameters=llama3(32.0, 1.0, 4.0, 8192)),
    "3.2-3b": dict(
        SMALL, hidden_size=96, num_attention_heads=3, head_dim=128, tie_word_embeddings=True,
        rope_parameters=llama3(32.0, 1.0, 4.0, 8192),
    ),
}


@pytest.fixture(scope="module")
def from_llama_cpp(llama_cpp, llama31_tokenizer, tmp_path_factory) -> Callable[[str], tuple[Path, Path]]:
    """`from_llama_cpp(case)` -> (a random-weight checkpoint of CASES[case], the float32 GGUF
    llama.cpp's converter writes of it), built once per module. The checkpoint has the real
    Llama 3.1 tokenizer, which the converter must recognise."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(case: str) -> tuple[Path, Path]:
        if case not in made:
            folder = tmp_path_factory.mktemp(case)
            src = build_hf_checkpoint(folder / "hf", "llama", {**CASES[case], "vocab_size": VOCAB})
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(llama31_tokenizer / name, src / name)
            made[case] = src, llama_cpp_gguf(llama_cpp, src, folder / "model.gguf")
        return made[case]

    return make


def hf_model(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(PROMPT), logits_to_keep=LAST).logits.numpy()


def our_logits(folder: Path) -> np.ndarray:
    """The last positions' logits, the prompt prefilled through the KV cache as in generation."""
    model = mlxinfer.load(folder, dtype="float32")[0]
    cache = make_cache(model)
    model(mx.array(PROMPT[:, :-LAST]), cache)
    return np.array(model(mx.array(PROMPT[:, -LAST:]), cache))


def hf_frequencies(folder: Path) -> np.ndarray:
    """The inverse frequencies transformers runs for a folder's config.json."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig.from_pretrained(folder)
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu")[0].numpy()


def mlx_lm_frequencies(folder: Path) -> np.ndarray:
    """The inverse frequencies mlx-lm's Llama runs for a converted folder."""
    from mlx_lm.models.rope_utils import initialize_rope

    cfg = json.loads((folder / "config.json").read_text())
    rope = initialize_rope(cfg["head_dim"], cfg["rope_theta"], False, cfg.get("rope_scaling"),
                           cfg["max_position_embeddings"])
    return 1 / np.array(rope._freqs)


def with_rope_freqs(gguf_file: Path, out: Path, divisors: np.ndarray) -> Path:
    """A copy of llama.cpp's `gguf_file` with other `rope_freqs` values."""
    shutil.copyfile(gguf_file, out)
    with closing(GGUFFile(out)) as file:
        at = next(t.offset for t in file.tensors if t.name == "rope_freqs.weight")
    with open(out, "r+b") as f:
        f.seek(at)
        assert np.frombuffer(f.read(8), np.float32).tolist() == [1.0, 1.0]  # llama.cpp's: high frequencies kept
        f.seek(at)
        f.write(divisors.astype(np.float32).tobytes())
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_cpp_llama3_gguf_matches_transformers(from_llama_cpp, tmp_path, case):
    src, gguf_file = from_llama_cpp(case)
    out = tmp_path / "out"
    convert(gguf_file, out, dtype="float32")

    want = hf_logits(hf_model(src))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(our_logits(out), want, atol=1e-4, rtol=0)

    # Settings, not a frequency list: transformers and mlx-lm read them as the original's frequencies.
    recorded = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert recorded["rope_type"] == "llama3"
    original = hf_frequencies(src)
    np.testing.assert_allclose(hf_frequencies(out), original, rtol=1e-6)
    np.testing.assert_allclose(mlx_lm_frequencies(out), original, rtol=1e-6)


def test_rope_freqs_no_llama3_setting_gives_run_as_they_are(from_llama_cpp, tmp_path):
    """A rope_freqs tensor that no Llama 3 setting reproduces (here rewritten after llama.cpp's
    converter) runs with exactly its divisors: the oracle is transformers with its inverse
    frequencies set to the file's, and transformers and mlx-lm read the folder the same way."""
    src, written = from_llama_cpp("original-4096")
    divisors = np.linspace(1.0, 3.0, 32, dtype=np.float32) ** 2  # smooth, but not Llama 3's shape
    gguf_file = with_rope_freqs(written, tmp_path / "model.gguf", divisors)
    out = tmp_path / "out"
    convert(gguf_file, out, dtype="float32")

    model = hf_model(src)
    rotary = model.model.rotary_emb
    unscaled, _ = rotary.compute_default_rope_parameters(model.config)
    rotary.inv_freq = rotary.original_inv_freq = unscaled / torch.from_numpy(divisors)
    want = hf_logits(model)
    np.testing.assert_allclose(our_logits(out), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(hf_frequencies(out), rotary.inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(mlx_lm_frequencies(out), rotary.inv_freq.numpy(), rtol=1e-6)



@pytest.mark.parametrize("bad", [np.nan, 0.0, -2.0])
def test_damaged_rope_freqs_is_refused(from_llama_cpp, tmp_path, bad):
    """A divisor that is not a positive number is a damaged file, one line, nothing written."""
    divisors = np.ones(32, dtype=np.float32)
    divisors[20] = bad
    gguf_file = with_rope_freqs(from_llama_cpp("original-4096")[1], tmp_path / "model.gguf", divisors)
    with pytest.raises(CorruptCheckpointError, match="rope_freqs.weight' should hold 32 positive numbers") as e:
        convert(gguf_file, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


# (factor, low_freq_factor, high_freq_factor, original context, head_dim, rope_theta)
SETTINGS = [
    (8.0, 1.0, 4.0, 8192, 128, 500000.0),  # Llama 3.1
    (32.0, 1.0, 4.0, 8192, 64, 500000.0),  # Llama 3.2 1B
    (8.0, 1.0, 4.0, 4096, 64, 500000.0),
    (4.0, 2.0, 6.0, 16384, 128, 500000.0),
    (6.5, 0.5, 3.0, 32768, 128, 1000000.0),
    (16.0, 1.0, 4.0, 8192, 16, 10000.0),  # one blended frequency: Meta's low/high/original assumed
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_llama3_settings_derived_from_divisors_give_transformers_frequencies(setting):
    """The settings recorded for a rope_freqs tensor (here transformers' own divisors, in
    float32 as a GGUF holds them) make transformers compute the same frequencies."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factor, low, high, original, head_dim, theta = setting

    def frequencies(rope: dict) -> torch.Tensor:
        cfg = LlamaConfig(head_dim=head_dim, max_position_embeddings=131072, rope_parameters=rope | {"rope_theta": theta})
        return ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0]

    want = frequencies(llama3(factor, low, high, original))
    unscaled = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    recorded = llama3_scaling((unscaled / want).numpy(), theta, head_dim, None)
    assert recorded is not None and recorded["rope_type"] == "llama3"
    np.testing.assert_allclose(frequencies(recorded).numpy(), want.numpy(), rtol=1e-6)
