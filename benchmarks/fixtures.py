"""What several benchmarks share, so that none imports another: the random-weight models they
build (transformers and tokenizers are bench-only dependencies) and the word-level tokenizer
those models read."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA_50M = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
)
HYBRID_58M = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=False,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    full_attention_interval=4,
)


def build_llama_50m(folder: Path) -> Path:
    """A random-weight float32 Llama of ~58M parameters (transformers is a bench-only dependency)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_50M)).float()
    model.save_pretrained(folder)
    write_word_tokenizer(folder, LLAMA_50M["vocab_size"])
    return folder


def build_hybrid(folder: Path) -> Path:
    """A random-weight float32 Qwen3.5 text model (6 Gated DeltaNet layers, 2 attention layers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **HYBRID_58M)).float().save_pretrained(folder)
    write_word_tokenizer(folder, HYBRID_58M["vocab_size"])
    return folder


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ids t0..t{vocab_size-1} (random prompts need no real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1", "bos_token": "t0"}))
