"""gpt-oss GGUFs written by llama.cpp's own converter (`convert_hf_to_gguf.py` from the
llama-cpp-python sdist, as test_convert_llama3_gguf fetches it), with float experts and with
MXFP4 ones, converted back with ours and compared with transformers on the checkpoints they
came from."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_convert import tensors
from family_checks import SMOLLM2_VOCAB, llama_cpp_gguf
from test_models_gpt_oss import PROMPT, build, hf_logits, hf_mxfp4_logits, to_mxfp4
from test_parity import TOL

import mlxinfer
from mlxinfer.convert import convert


@pytest.fixture(scope="module")
def ggufs(llama_cpp, smollm2_tokenizer, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{"float": (checkpoint, GGUF), "mxfp4": (its MXFP4 twin, GGUF)}: llama.cpp's
    `convert_hf_to_gguf.py` on random-weight checkpoints with SmolLM2's vocabulary (one the
    converter recognises)."""
    root = tmp_path_factory.mktemp("gguf")
    src = build(root / "float", {"vocab_size": SMOLLM2_VOCAB, "num_hidden_layers": 2})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2_tokenizer / name, src / name)
    made = {}
    for kind, folder in (("float", src), ("mxfp4", to_mxfp4(src, root / "mxfp4"))):
        made[kind] = folder, llama_cpp_gguf(llama_cpp, folder, root / f"{kind}.gguf")
    return made


def test_llama_cpp_ggufs_convert_back_to_the_transformers_model(ggufs, tmp_path):
    """Float experts and MXFP4 ones (repacked by llama.cpp into its own blocks): converted back,
    each runs as transformers runs the checkpoint it came from, past the sliding window; the
    MXFP4 experts come out bit for bit as converting the hub-style folder gives them."""
    ids = PROMPT[:, :200]
    for kind, oracle in (("float", hf_logits), ("mxfp4", hf_mxfp4_logits)):
        folder, gguf = ggufs[kind]
        out = tmp_path / kind
        convert(gguf, out)
        np.testing.assert_allclose(np.array(mlxinfer.load(out)[0](mx.array(ids))), oracle(folder, ids),
                                   atol=TOL, rtol=0)
    convert(ggufs["mxfp4"][0], tmp_path / "from-folder")
    from_gguf, from_folder = tensors(tmp_path / "mxfp4"), tensors(tmp_path / "from-folder")
    experts = [k for k in from_folder if ".experts." in k and not k.endswith(".bias")]
    assert len(experts) == 2 * 3 * 2  # layers x projections x (weight, scales)
    for name in experts:
        assert from_gguf[name].dtype == from_folder[name].dtype and mx.array_equal(from_gguf[name],
                                                                                 from_folder[name]).item(), name
