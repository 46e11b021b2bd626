"""SmolLM3 (every 4th layer without RoPE) against transformers on random-weight checkpoints:
logits, chunked prefill, greedy decoding against teacher forcing, batching, the prompt-cache
pool and speculative decoding (family_checks); mlx-lm's quantized checkpoint; llama.cpp's GGUF
of it converted back; and its chat template's thinking switch with our reasoning split."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ASSETS, LLAMA_CPP, asset_lock, fetch_sdist
from family_checks import (  # noqa: F401  (the test_ functions run here, on this module's `variant`)
    assert_llama_cpp_gguf_matches_transformers,
    real_vocab_checkpoint,
    test_batched_equals_alone,
    test_chunked_prefill_matches_transformers,
    test_greedy_matches_teacher_forcing,
    test_pool_reuse_equals_fresh,
    test_speculative_equals_plain,
)
from test_parity import assert_matches_mlx_lm, assert_matches_transformers, tokens

import mlxinfer
from mlxinfer.engine.generate import stream_generate
from mlxinfer.text.reasoning import effort_kwargs, thinking_switch

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # SmolLM3Config's defaults lie beyond our vocabulary
VARIANTS = {
    "default": dict(IDS, num_hidden_layers=4, tie_word_embeddings=True),  # layer 3 without RoPE
    # a layer of its own choosing without RoPE, sliding (transformers slides the NoPE layers), all biases
    "sliding-bias": dict(IDS, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1], use_sliding_window=True,
                         sliding_window=8, attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hf_checkpoint):
    folder = hf_checkpoint("smollm3", **VARIANTS[request.param])
    return request.param, folder, *mlxinfer.load(folder, dtype="float32")


def test_logits_match_transformers_and_nope_layers_matter(variant):
    name, folder, model, _ = variant
    assert_matches_transformers(folder, model)
    nope = [i for i, layer in enumerate(model.layers) if layer.self_attn.rope is None]
    assert nope == ([3] if name == "default" else [1])
    assert [layer.window for layer in model.layers] == ([None] * 4 if name == "default" else [None, 8, None, None])
    ids = mx.array(tokens())
    before = np.array(model(ids))
    for i in nope:  # RoPE where the checkpoint has none: other logits
        model.layers[i].self_attn.rope = model.layers[0].self_attn.rope
    try:
        assert np.abs(np.array(model(ids)) - before).max() > 1e-3
    finally:
        for i in nope:
            model.layers[i].self_attn.rope = None


def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(variant, mlx_lm_quantized):
    assert_matches_mlx_lm(mlx_lm_quantized(variant[1], bits=4, group_size=32), 4)


def test_llama_cpp_gguf_matches_transformers(llama_cpp, tmp_path):
    """llama.cpp keeps no NoPE list in the file (it leaves RoPE out of every 4th layer): the
    converted config must say the same, and the logits be transformers'."""
    src = real_vocab_checkpoint(tmp_path / "hf", "smollm3", dict(num_hidden_layers=4, tie_word_embeddings=True))
    config = assert_llama_cpp_gguf_matches_transformers(llama_cpp, src, tmp_path, "smollm3")
    assert config["model_type"] == "smollm3" and config["no_rope_layer_interval"] == 4


# --- thinking: SmolLM3's chat template with our reasoning split ---

TEMPLATE = "models/templates/HuggingFaceTB-SmolLM3-3B.jinja"  # in llama.cpp's tree
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def smollm3_template() -> str:
    """SmolLM3's chat template as llama.cpp ships it for its tests (Unsloth's edit of the
    original: the same switch, `enable_thinking`, and `/think` or `/no_think` in the system
    message), read from the llama-cpp-python sdist."""
    name, version = LLAMA_CPP
    cached = ASSETS / f"smollm3-template-{version}.jinja"
    with asset_lock(cached.name):
        if not cached.is_file():
            sdist = fetch_sdist(f"{name}=={version}")
            with tarfile.open(sdist) as tar:
                member = tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/{TEMPLATE}")
                cached.with_suffix(".partial").write_bytes(member.read())
            cached.with_suffix(".partial").rename(cached)
    return cached.read_text()


@pytest.fixture(scope="module")
def thinker(hf_checkpoint, smollm3_template, smollm2_tokenizer, tmp_path_factory) -> Path:
    """A random SmolLM3 with the SmolLM2 tokenizer (no registry package ships SmolLM3's own; its
    ChatML tokens are the same) under SmolLM3's chat template."""
    src = hf_checkpoint("smollm3", **dict(VARIANTS["default"], vocab_size=49152, max_position_embeddings=1024))
    folder = tmp_path_factory.mktemp("smollm3") / "model"
    shutil.copytree(src, folder)
    for file in smollm2_tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": smollm3_template}))
    return folder


def test_thinking_switch_renders_transformers_prompts_and_the_split_follows(thinker):
    """The prompts, thinking on and off (`enable_thinking` false, or `/no_think` in the system
    message, where the template writes an empty closed block), are transformers' rendering of the
    template. Under each, a reply that opens `<think>` is cut at the tags, and one that answers
    first is all answer, a closing tag later in it included."""
    from transformers import AutoTokenizer

    model, tok = mlxinfer.load(thinker, dtype="float32")
    hf = AutoTokenizer.from_pretrained(thinker)
    assert thinking_switch(tok, False) == {"enable_thinking": False}
    assert effort_kwargs(tok, "none") == {"enable_thinking": False}

    def rendered(messages, **kwargs) -> list[int]:
        return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                      **kwargs)

    on, off = rendered(ASK), rendered(ASK, enable_thinking=False)
    assert "Reasoning Mode: /think\n" in hf.decode(on) and hf.decode(on).endswith("<|im_start|>assistant\n")
    assert hf.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    no_think = [{"role": "system", "content": "Be brief. /no_think"}, *ASK]
    assert hf.decode(rendered(no_think)).endswith("<think>\n\n</think>\n")

    # a reply that thinks first; one that answers first and writes the closing tag later (answer text)
    thinks = {"type": "regex", "pattern": r"<think>\nfour\n</think>\nIt is [a-z]{3,6}"}
    answers = {"type": "regex", "pattern": r"It is [a-z]{3,6}\n</think>\nyes"}
    for messages, kwargs, expected in ((ASK, {}, on), (ASK, {"enable_thinking": False}, off),
                                       (no_think, {}, rendered(no_think))):
        for reply in (thinks, answers):
            common = dict(temperature=0.0, max_tokens=80, chat_template_kwargs=kwargs, response_format=reply)
            raw = "".join(c.text for c in stream_generate(model, tok, messages, split_reasoning=False, **common))
            chunks = list(stream_generate(model, tok, messages, **common))
            assert chunks[-1].stats.prompt_tokens == len(expected) and chunks[-1].finish_reason == "stop"
            parts = "".join(c.reasoning for c in chunks), "".join(c.text for c in chunks)
            if reply is thinks:
                assert raw.startswith("<think>\nfour\n</think>\nIt is ")
                assert parts == ("four", raw.partition("</think>\n")[2])
            else:
                assert raw.startswith("It is ") and raw.endswith("\n</think>\nyes") and parts == ("", raw)
