"""The CPU decode-layer primitives (`kernels.decode_layer`): a one-token step of a standard
block as two ops. Oracles: transformers' logits on random-weight checkpoints of every kind of
block they cover (float32), and the per-op path on the same model (quantized weights, where
transformers has no counterpart). Every check also counts the primitives' calls, so a silent
fallback to the per-op path fails it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_batch import GREEDY, assert_batch_equals_solo, prompts_for
from test_cpu_qmm import ext, loops, needs_extension, simd
from test_parity import TOL, hf_logits

import mlxinfer
from mlxinfer.convert import convert
from mlxinfer.models.cache import LayerRows, make_cache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.kernels import decode_layer
from mlxinfer.kernels import quantized_matmul as qmm

# The primitives run only where the extension is built and not switched off (MLXINFER_CPU_QMM=off).
needs_primitives = pytest.mark.skipif(
    ext is None or qmm.mode() == "off",
    reason="MLXINFER_CPU_QMM=off" if ext is not None else f"CPU extension unavailable: {qmm.reason()}")

CHUNKS = (9, 7)  # prompt chunks before single tokens
LENGTH = 40
REL = 2e-5  # of the largest logit: the primitives against the per-op path (another summation order)

# What a fused step must get right: biases, GELU, scaled RoPE tables, q/k norms, layers without
# RoPE, partial rotation, grouped heads, YaRN's attention factor on the rotated half.
VARIANTS = {
    "llama-gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
    "llama-bias-gelu-llama3": ("llama", dict(
        attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "qwen2-yarn": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "smollm3-nope": ("smollm3", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, num_hidden_layers=4)),
    "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    # (1 + w) norms, sandwich norms, q/k norms, GELU, a scale of its own, sliding layers (rotating caches
    # of 8 entries: prompt chunks past the window take the per-op path, single tokens the primitives)
    "gemma3": ("gemma3_text", dict(head_dim=32, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma2-no-softcap": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=None, final_logit_softcapping=None)),
}


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The row count of every fused step taken while the test runs."""
    seen: list[int] = []
    real = decode_layer.layer_in

    def counted(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(decode_layer, "layer_in", counted)
    return seen


def decode_logits(model, ids: list[int], chunks: tuple[int, ...] = CHUNKS) -> np.ndarray:
    """Logits of `ids`: prompt chunks of the given sizes (the second attends to the first's cache
    and causally within itself), then one token at a time."""
    cache, out, at = make_cache(model), [], 0
    for n in [*chunks] + [1] * (len(ids) - sum(chunks)):
        out.append(model(mx.array([ids[at : at + n]]), cache=cache))
        at += n
    return np.array(mx.concatenate(out, axis=1))[0]


def per_op(model, ids: list[int], monkeypatch, chunks: tuple[int, ...] = CHUNKS) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setattr(decode_layer, "available", lambda x: False)
        return decode_logits(model, ids, chunks)


def ids_of(seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=LENGTH).tolist()


@needs_primitives
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fused_steps_match_transformers_and_the_per_op_path(name, hf_checkpoint, monkeypatch, calls):
    model_type, overrides = VARIANTS[name]
    folder = hf_checkpoint(model_type, **overrides)
    model, _ = mlxinfer.load(folder, dtype="float32")
    ids = ids_of()
    fused = decode_logits(model, ids)
    steps = LENGTH - sum(CHUNKS) + len(CHUNKS)
    if "sliding_window" not in overrides:
        assert calls == [1] * steps * len(model.layers), "a layer's step was not fused"
    assert len(calls) >= (LENGTH - sum(CHUNKS)) * len(model.layers), "a layer's decode step was not fused"
    ref = hf_logits(folder, np.array([ids]))[0]
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(fused, ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(fused, per_op(model, ids, monkeypatch), atol=REL * np.abs(ref).max(), rtol=0)


@needs_primitives
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_fused_steps_match_the_per_op_path(bits, hf_checkpoint, tmp_path, monkeypatch, calls):
    src = hf_checkpoint("qwen2", tie_word_embeddings=True)  # biases beside quantized weights
    convert(src, tmp_path / "q", quantize=True, bits=bits, group_size=32)
    model, _ = mlxinfer.load(tmp_path / "q")
    ids = ids_of(4)
    fused = decode_logits(model, ids)
    assert calls, "no decode step was fused"
    slow = per_op(model, ids, monkeypatch)
    np.testing.assert_allclose(fused, slow, atol=REL * np.abs(slow).max(), rtol=0)
    assert (fused.argmax(-1) == slow.argmax(-1)).all()


@needs_primitives
def test_prompt_chunks_of_any_size_take_the_fused_step(hf_checkpoint, tmp_path, monkeypatch):
    """A 600-token prompt chunk of a quantized model is one fused step per layer (its products the
    extension's GEMM) and gives the per-op path's logits; a float32 model's chunk past
    decode_layer.FLOAT_ROWS takes the per-op path (no GEMM for float weights there)."""
    tokens: list[int] = []
    real = decode_layer.layer_in
    monkeypatch.setattr(decode_layer, "layer_in", lambda x, *a, **k: tokens.append(x.shape[1]) or real(x, *a, **k))
    src = hf_checkpoint("qwen2", tie_word_embeddings=True, max_position_embeddings=1024)
    convert(src, tmp_path / "q", quantize=True, bits=4, group_size=32)
    model, _ = mlxinfer.load(tmp_path / "q")
    ids = np.random.default_rng(9).integers(3, 500, size=610).tolist()
    fused = decode_logits(model, ids, chunks=(600, 7))
    assert tokens[: 2 * len(model.layers)] == [600] * len(model.layers) + [7] * len(model.layers)
    slow = per_op(model, ids, monkeypatch, chunks=(600, 7))
    np.testing.assert_allclose(fused, slow, atol=REL * np.abs(slow).max(), rtol=0)
    tokens.clear()
    model, _ = mlxinfer.load(src, dtype="float32")
    decode_logits(model, ids[: decode_layer.FLOAT_ROWS + 12], chunks=(decode_layer.FLOAT_ROWS + 1, 9))
    assert tokens[: len(model.layers)] == [9] * len(model.layers)


@needs_primitives
def test_every_loop_gates_as_the_per_op_path(hf_checkpoint, monkeypatch, calls):
    """SwiGLU's gating under each loop the CPU has: 120 intermediate units are seven 16-lane
    AVX-512 vectors and a scalar tail of 8, and all 120 in the narrower loops' scalar one."""
    model, _ = mlxinfer.load(hf_checkpoint("llama", intermediate_size=120), dtype="float32")
    ids = ids_of(8)
    slow = per_op(model, ids, monkeypatch)
    for level in loops():
        calls.clear()
        with simd(level):
            fused = decode_logits(model, ids)
        assert calls, f"no decode step was fused under {level}"
        np.testing.assert_allclose(fused, slow, atol=REL * np.abs(slow).max(), rtol=0, err_msg=level)


@needs_primitives
def test_a_dropped_model_frees_its_arrays_at_once(hf_checkpoint, calls):
    """The plans a model's blocks keep make no reference cycle: deleting the model after a fused
    step gives its memory back without waiting for the garbage collector (a cycle kept a converted
    model's weights alive into the next job and doubled its measured peak)."""
    import gc

    path = hf_checkpoint("llama")
    before = mx.get_active_memory()
    model, _ = mlxinfer.load(path, dtype="float32")
    decode_logits(model, ids_of(7))
    assert calls and mx.get_active_memory() > before
    gc.disable()
    try:
        del model
        assert mx.get_active_memory() - before < 1 << 10  # not the model's megabytes (a few constants stay cached)
    finally:
        gc.enable()


@needs_primitives
@pytest.mark.parametrize("bits", [None, 4])
def test_a_batch_of_rows_gets_each_rows_own_numbers(bits, hf_checkpoint, tmp_path, calls):
    """Sequences of mixed lengths decoded together equal each alone, in tokens and logprobs
    (the engine's check: 1e-4) and, for one step, bit for bit; float32 and 4-bit weights."""
    src = hf_checkpoint("qwen3", head_dim=32)
    if bits is None:
        model, tok = mlxinfer.load(src, dtype="float32")
    else:
        convert(src, tmp_path / "q", quantize=True, bits=bits, group_size=32)
        model, tok = mlxinfer.load(tmp_path / "q")
    widest = assert_batch_equals_solo(model, tok, [(ids, GREEDY) for ids in prompts_for(model)])
    assert widest > 1 and max(calls) > 1
    prompts = [ids_of(seed)[: 5 + 7 * seed] for seed in range(3)]
    assert_rows_alone_equal_together(model, prompts)


def assert_rows_alone_equal_together(model, prompts: list[list[int]], adapters: list[str | None] | None = None):
    """One step of each prompt's last token, all rows together and each alone (after the rest was
    prefilled alone): the last layer's outputs are equal bit for bit (a float LM head is MLX's
    matmul, which sums a batch in another order)."""
    from mlxinfer.models.lora import selecting

    names = adapters or [None] * len(prompts)

    def caches() -> list[PromptCache]:
        out = [PromptCache(make_cache(model)) for _ in prompts]
        for c, ids, name in zip(out, prompts, names):
            with selecting(model, [name]):
                c.prefill(model, ids[:-1])
        return out

    def hidden(rows: list[PromptCache], ids: list[int], rows_names: list[str | None]) -> np.ndarray:
        layers = [LayerRows([c.caches[i] for c in rows]) for i in range(len(model.layers))]
        with selecting(model, rows_names):
            return np.array(model.model.blocks(model.model.embed(mx.array(ids)[:, None]), layers))[:, 0]

    together = hidden(caches(), [ids[-1] for ids in prompts], names)
    alone = [hidden([c], [ids[-1]], [name])[0] for c, ids, name in zip(caches(), prompts, names)]
    assert all(np.array_equal(together[b], alone[b]) for b in range(len(prompts)))


@needs_primitives
def test_thread_count_does_not_change_a_step(hf_checkpoint):
    model, _ = mlxinfer.load(hf_checkpoint("llama", hidden_size=256, intermediate_size=512), dtype="float32")
    ids = ids_of(5)
    threads = ext.threads()
    try:
        ext.set_threads(1)
        one = decode_logits(model, ids)
    finally:
        ext.set_threads(threads)
    assert np.array_equal(one, decode_logits(model, ids))


@needs_primitives
@pytest.mark.parametrize("bits", [None, 4])
def test_a_position_gets_the_same_numbers_in_a_prompt_chunk_and_a_decode_step(bits, hf_checkpoint, tmp_path, calls):
    """Every part of a fused step is computed per token in one fixed order (the products row by row,
    attention query by query), so the last layer's output at each position is the same bits whether
    the prompt came as one chunk, as chunks of other sizes, or a token at a time."""
    src = hf_checkpoint("qwen3", head_dim=32)
    if bits is None:
        model, _ = mlxinfer.load(src, dtype="float32")
    else:
        convert(src, tmp_path / "q", quantize=True, bits=bits, group_size=32)
        model, _ = mlxinfer.load(tmp_path / "q")
    ids = ids_of(9)

    def hidden(chunks: list[int]) -> np.ndarray:
        cache, out, at = make_cache(model), [], 0
        for n in chunks:
            out.append(model.model.blocks(model.model.embed(mx.array([ids[at : at + n]])), cache))
            at += n
        return np.array(mx.concatenate(out, axis=1))[0]

    whole = hidden([LENGTH])
    assert calls, "the chunk was not fused"
    for chunks in ([9, 7] + [1] * (LENGTH - 16), [1] * LENGTH):
        assert np.array_equal(hidden(chunks), whole), chunks


@needs_primitives
def test_layers_the_primitives_cannot_run_take_the_per_op_path(hf_checkpoint, calls):
    """Gemma 2's soft-capped scores and MoE feed-forwards are not fused (their own family tests
    check their numbers)."""
    for model_type, overrides in (("gemma2", dict(head_dim=16)),
                                  ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))):
        model, _ = mlxinfer.load(hf_checkpoint(model_type, **overrides), dtype="float32")
        decode_logits(model, ids_of()[: sum(CHUNKS) + 2])
    assert calls == []


@needs_extension
def test_bad_arguments_raise_value_errors():
    x = mx.zeros((1, 1, 64))
    w = mx.zeros((3 * 64, 64))
    good = mx.zeros((128, 64))  # 4 + 2 + 2 heads of 16
    with pytest.raises(ValueError, match="qkv"):
        ext.decode_layer_in(x, mx.ones(64), [w], 0, 0, [], [], [], [0], [], 4, 2, 16, 1e-5, 1e-5, 1.0)
    with pytest.raises(ValueError, match="one position per row"):
        ext.decode_layer_in(x, mx.ones(64), [good], 0, 0, [], [], [], [], [], 4, 2, 16, 1e-5, 1e-5, 1.0)
    lora = [mx.zeros((2, 8, 64)), mx.zeros((2, 8, 128))]  # A and B transposed: the base's slot and one adapter's
    with pytest.raises(ValueError, match="slot is outside"):
        ext.decode_layer_in(x, mx.ones(64), [good], 0, 0, lora, [], [], [0], [2], 4, 2, 16, 1e-5, 1e-5, 1.0)
    with pytest.raises(ValueError, match="LoRA stacks"):
        ext.decode_layer_in(x, mx.ones(64), [good], 0, 0, lora[::-1], [], [], [0], [1], 4, 2, 16, 1e-5, 1e-5, 1.0)
    packed = [mx.zeros((128, 8), dtype=mx.uint32), mx.zeros((128, 4)), mx.zeros((128, 4))]  # 4 bits, groups of 16
    with pytest.raises(ValueError, match="no loop for 4-bit weights in groups of 16"):
        ext.decode_layer_in(x, mx.ones(64), packed, 4, 16, [], [], [], [0], [], 4, 2, 16, 1e-5, 1e-5, 1.0)


def test_an_extension_built_from_older_sources_is_not_used(monkeypatch):
    """An editable install whose compiled part predates the Python (pulled, not rebuilt) falls back
    to the per-op path, and says how to rebuild, instead of failing at the first decode step."""
    from types import SimpleNamespace

    old = SimpleNamespace(mlx_version=mx.__version__, affine_quantized_matmul=None)
    monkeypatch.setattr(qmm, "_loaded", [])
    monkeypatch.setattr(qmm, "_why_not", [])
    monkeypatch.setitem(__import__("sys").modules, "mlxinfer.kernels._cpu_qmm", old)
    monkeypatch.setattr(mlxinfer.kernels, "_cpu_qmm", old, raising=False)
    assert qmm.extension() is None
    assert "older sources" in qmm.reason() and "pip install -e ." in qmm.reason()
    assert not decode_layer.available(mx.zeros((1, 1, 8)))


@needs_primitives
def test_half_scales_are_kept_and_read_exactly(hf_checkpoint, tmp_path, monkeypatch):
    """A checkpoint whose quantization scales are float16 (as a GGUF's are) keeps them so beside
    float32 activations where the extension reads them: logits (of a 290-token prompt chunk too, the
    extension's GEMM) equal those of the same model with float32 scales, bit for bit."""
    from mlxinfer.loading import checkpoint

    src = hf_checkpoint("llama", tie_word_embeddings=True, max_position_embeddings=512)
    convert(src, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float16")
    ids = np.random.default_rng(6).integers(3, 500, size=300).tolist()

    def logits():
        model, _ = mlxinfer.load(tmp_path / "q")
        return model, decode_logits(model, ids, chunks=(290,))

    model, half = logits()
    assert model.layers[0].self_attn.qkv_proj.scales.dtype == mx.float16
    assert model.model.embed_tokens.scales.dtype == mx.float16
    monkeypatch.setattr(checkpoint, "half_scales", lambda model, weights: set())
    model, single = logits()
    assert model.layers[0].self_attn.qkv_proj.scales.dtype == mx.float32
    assert half.dtype == np.float32 and np.array_equal(half, single)


@needs_primitives
def test_new_weights_or_a_replaced_layer_are_seen_by_the_next_step(hf_checkpoint, calls):
    """A block keeps what the primitives need between steps; weights loaded into the model
    afterwards, or a projection replaced by another module, are used from the next step on."""
    from mlx.utils import tree_flatten

    from mlxinfer.models.layers import Linear

    model, _ = mlxinfer.load(hf_checkpoint("llama"), dtype="float32")
    other, _ = mlxinfer.load(hf_checkpoint("llama", seed=3), dtype="float32")
    ids = ids_of(7)
    decode_logits(model, ids)
    model.load_weights(tree_flatten(other.parameters()))
    assert np.array_equal(decode_logits(model, ids), decode_logits(other, ids))

    class Doubled(Linear):  # another kind of layer: the per-op path runs that block
        def __call__(self, x):
            return 2 * super().__call__(x)

    layer = model.layers[0].self_attn
    doubled = Doubled(*reversed(layer.o_proj.weight.shape), bias=False)
    doubled.weight = layer.o_proj.weight
    layer.o_proj = doubled
    calls.clear()
    changed = decode_logits(model, ids)
    assert len(calls) == (LENGTH - sum(CHUNKS) + len(CHUNKS)) * (len(model.layers) - 1)
    assert not np.allclose(changed, decode_logits(other, ids), atol=1e-3)


@needs_primitives
@pytest.mark.parametrize("bits", [None, 4])
def test_lora_rows_take_the_fused_step(bits, hf_checkpoint, tmp_path, monkeypatch, calls):
    """Rows running LoRA adapters (issue 28) go through the primitives, each adding its own
    adapter's update: PEFT's logits (float32 base), the per-op path's (2e-5), and rows of the base,
    A and B in one step equal to each alone, bit for bit; float32 and 4-bit bases."""
    from test_lora import ATTN_MLP, peft_adapter
    from test_parity import tokens

    from mlxinfer.models.lora import selecting

    base = hf_checkpoint("llama", head_dim=32)
    a, peft_logits = peft_adapter(base, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=ATTN_MLP)
    b, _ = peft_adapter(base, tmp_path / "b", seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    folder = base
    if bits is not None:
        convert(base, tmp_path / "q", quantize=True, bits=bits, group_size=32)
        folder = tmp_path / "q"
    model, _ = mlxinfer.load(folder, dtype=None if bits else "float32")
    mlxinfer.load_adapter(model, a, "a")
    mlxinfer.load_adapter(model, b, "b")
    ids = tokens()[0].tolist()
    with selecting(model, ["a"]):
        fused = decode_logits(model, ids)
    assert len(calls) >= (len(ids) - sum(CHUNKS)) * len(model.layers), "an adapted step was not fused"
    if bits is None:
        np.testing.assert_allclose(fused, peft_logits[0], atol=TOL, rtol=0)
    with selecting(model, ["a"]):
        slow = per_op(model, ids, monkeypatch)
    np.testing.assert_allclose(fused, slow, atol=REL * np.abs(slow).max(), rtol=0)
    calls.clear()
    assert_rows_alone_equal_together(model, [ids_of(seed)[: 6 + 5 * seed] for seed in range(3)], [None, "a", "b"])
    assert 3 in calls
