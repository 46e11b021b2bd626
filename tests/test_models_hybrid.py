"""Hybrid families (Qwen3-Next, Qwen3.5 dense and MoE, LFM2): recurrent layers (Gated DeltaNet,
short convolutions) beside attention, against transformers on random-weight checkpoints with
both layer kinds: float32 logits over a prompt longer than one chunk of the recurrence, greedy
decoding through our caches (prefilled in several chunks) equal to transformers' teacher-forced
argmax, and, for the engine around the recurrent state: batched == alone, pool reuse == fresh,
speculative == plain (the state rolled back exactly to the accepted drafts), /undo then
regenerate == never generated, a saved and loaded session == a straight one; and the checks
every family passes (family_checks: chunked prefill, speculative decoding with a Llama draft)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import BASE_CONFIG, perturb, train_tokenizer
from family_checks import (  # noqa: F401  (the test_ functions run here, on this module's `variant`)
    test_chunked_prefill_matches_transformers,
    test_speculative_equals_plain,
)
from test_batch import GREEDY, assert_batch_equals_solo, prompt
from test_parity import TOL

import mlxinfer
from mlxinfer.engine.generate import stream_generate
from mlxinfer.models.cache import StateCache, make_cache
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.engine.prompt_file import load_prompt_cache, save_prompt_cache
from mlxinfer.engine.chat import ChatSession
from mlxinfer.base.errors import ConfigError
from mlxinfer.engine.pool import PromptCachePool
from mlxinfer.models.shard import shard_config

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              head_dim=32, num_hidden_layers=4, full_attention_interval=2)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VARIANTS = {
    # layer 2 keeps a dense MLP (mlp_only_layers) beside the sparse ones
    "qwen3_next": ("qwen3_next", dict(LINEAR, **EXPERTS, mlp_only_layers=[2])),
    "qwen3_5_text": ("qwen3_5_text", LINEAR),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(LINEAR, **EXPERTS)),
    "lfm2": ("lfm2", dict(num_hidden_layers=4, full_attn_idxs=[1, 3], block_ff_dim=96, conv_bias=True,
                          tie_word_embeddings=True)),
}
PROMPT = 150  # more than two chunks of the recurrence (64 tokens), prefilled in several engine chunks
PREFILL_STEP = 48


@pytest.fixture(scope="session")
def hybrid_checkpoint(hf_checkpoint):
    """`hybrid_checkpoint(variant, seed=0)` -> a folder built by transformers."""

    def make(name: str, seed: int = 0) -> Path:
        model_type, overrides = VARIANTS[name]
        return hf_checkpoint(model_type, seed=seed, **overrides)

    return make


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, hybrid_checkpoint):
    folder = hybrid_checkpoint(request.param)
    model, tok = mlxinfer.load(folder, dtype="float32")
    return request.param, folder, model, tok


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def test_logits_match_transformers(variant):
    name, folder, model, _ = variant
    ids = np.random.default_rng(0).integers(0, 500, size=(2, PROMPT))
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor(ids)).logits.numpy()
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, atol=TOL, rtol=0)
    kinds = {type(c).__name__ for c in make_cache(model)}
    assert kinds == {"KVCache", "StateCache"}, kinds  # both kinds of layer are exercised


def test_greedy_through_the_caches_is_transformers_argmax(variant):
    """Prefilled in chunks, then decoded a token at a time through the recurrent state: each
    token is transformers' argmax over the whole sequence so far (teacher-forced)."""
    name, folder, model, tok = variant
    ids = prompt(PROMPT, seed=3)
    chunks = list(stream_generate(model, tok, ids, max_tokens=12, temperature=0.0, ignore_eos=True,
                                  prefill_step=PREFILL_STEP, logprobs=2))
    got = [c.token for c in chunks]
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1].numpy()
    want = logits.argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(got, want)):
        top = np.sort(logits[i])[-2:]
        assert a == b or top[1] - top[0] < 1e-4, f"step {i}: {got} vs {want}"


def test_batched_equals_alone(variant):
    _, _, model, tok = variant
    lengths = (3, 17, 64, PROMPT)
    widest = assert_batch_equals_solo(model, tok, [(prompt(n, seed=i), GREEDY) for i, n in enumerate(lengths)],
                                      dict(prefill_step=PREFILL_STEP))
    assert widest == len(lengths)


# The engine around the recurrent state, on Qwen3-Next (linear attention) and LFM2 (convolutions)
ENGINE = ["qwen3_next", "lfm2"]


@pytest.fixture(scope="module", params=ENGINE)
def hybrid(request, hybrid_checkpoint):
    return mlxinfer.load(hybrid_checkpoint(request.param), dtype="float32")


def run(model, tok, ids, cache=None, n=6, **opts):
    """(tokens, logprobs, prefilled tokens) of a greedy generation."""
    chunks = list(stream_generate(model, tok, ids, prompt_cache=cache, max_tokens=n, ignore_eos=True,
                                  prefill_step=PREFILL_STEP, **opts))
    return [c.token for c in chunks], np.array([c.logprob for c in chunks]), chunks[-1].stats.prefill_tokens


def test_pool_reuses_state_snapshots_and_equals_fresh(hybrid):
    """Turn 2 extends turn 1 (a client resending the conversation): only the new tokens run.
    Turn 3 shares only turn 1's prompt (a template that rewrites the last reply): the state
    checkpointed where that prompt's prefill ended is reused, not the whole history re-run."""
    model, tok = hybrid
    pool = PromptCachePool(1 << 30)
    first = prompt(100, seed=1)
    cache = pool.fetch(model, first)
    run(model, tok, first, cache)
    held = list(cache.tokens)
    pool.store(cache, model)

    turn2 = held + [9, 10, 11]
    cache = pool.fetch(model, turn2)
    assert cache.tokens == held and pool.stats.reused_tokens == len(held)
    tokens, logprobs, prefilled = run(model, tok, turn2, cache)
    pool.store(cache, model)  # it covers turn 1's entry, which goes
    fresh_tokens, fresh_logprobs, fresh_prefilled = run(model, tok, turn2)
    assert tokens == fresh_tokens and prefilled == 3 and fresh_prefilled == len(turn2)
    np.testing.assert_allclose(logprobs, fresh_logprobs, atol=1e-5)
    assert pool.stats.entries == 1

    turn3 = first + [7, 7, 7, 7]  # diverges from the pooled history right after the first prompt
    cache = pool.fetch(model, turn3)
    assert len(cache.tokens) == len(first) - 1  # the checkpoint at the end of turn 1's prefill
    tokens, logprobs, prefilled = run(model, tok, turn3, cache)
    fresh_tokens, fresh_logprobs, _ = run(model, tok, turn3)
    assert tokens == fresh_tokens and prefilled == 5
    np.testing.assert_allclose(logprobs, fresh_logprobs, atol=1e-5)


REPETITIVE = [5, 17, 99, 250, 3, 42, 7, 300, 12, 8] * 3


def assert_state_as_if_fed(model, cache: PromptCache) -> None:
    """Every layer holds what running exactly `cache.tokens` from scratch leaves there."""
    fresh = PromptCache.for_model(model)
    model(mx.array(cache.tokens)[None], cache=fresh.caches)
    for a, b in zip(cache.caches, fresh.caches):
        assert a.offset == b.offset == len(cache.tokens)
        if isinstance(a, StateCache):
            for x, y in zip(a.state, b.state):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5, rtol=0)


@pytest.mark.parametrize("drafter", ["lookup", "other-model"])
def test_speculative_equals_plain_and_rolls_the_state_back(hybrid, hybrid_checkpoint, drafter):
    model, tok = hybrid
    plain, _, _ = run(model, tok, REPETITIVE, n=30)
    if drafter == "lookup":
        spec = dict(prompt_lookup=True)
    else:  # same family, other weights: drafts get rejected, and its own state is rolled back too
        name = "lfm2" if "conv" in {layer.mixer_name for layer in model.layers} else "qwen3_next"
        spec = dict(draft_model=mlxinfer.load(hybrid_checkpoint(name, seed=7), dtype="float32")[0])
    cache = PromptCache.for_model(model)
    chunks = list(stream_generate(model, tok, REPETITIVE, prompt_cache=cache, max_tokens=30, ignore_eos=True,
                                  num_draft_tokens=4, **spec))
    assert [c.token for c in chunks] == plain
    s = chunks[-1].stats
    assert s.rounds > 0 and s.accepted < s.drafted  # some drafts were rejected: the state went back
    assert_state_as_if_fed(model, cache)


def test_undo_then_regenerate_equals_never_generated(hybrid):
    model, tok = hybrid
    opts = dict(temperature=0.0, max_tokens=10, ignore_eos=True, prefill_step=16)
    # the undone turn runs more tokens than the replay log keeps: going back takes a checkpoint
    first, second, other = "hello there, how are you today?", "tell me about the fox " * 8, "and the lazy dog?"
    session = ChatSession(model, tok, **opts)
    list(session.send(first))
    list(session.send(second))
    ran, run_tokens = [], session.cache.run
    session.cache.run = lambda model, tokens, *inputs: ran.append(len(tokens)) or run_tokens(model, tokens, *inputs)
    assert session.undo()
    del session.cache.run
    # the state was kept where the undone turn's prefill began: only the end-of-turn tokens after it ran again
    assert 0 < sum(ran) <= 4, ran
    assert session.cache.tokens and session.cache.offset == len(session.cache.tokens)
    assert_state_as_if_fed(model, session.cache)
    again = list(session.send(other))

    straight = ChatSession(model, tok, **opts)
    list(straight.send(first))
    want = list(straight.send(other))
    assert [c.token for c in again] == [c.token for c in want]
    assert session.messages == straight.messages


def test_saved_session_resumes_with_its_state(hybrid, tmp_path):
    model, tok = hybrid
    opts = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    straight = ChatSession(model, tok, **opts)
    list(straight.send("hello there"))
    want = list(straight.send("tell me more"))
    saved = ChatSession(model, tok, **opts)
    list(saved.send("hello there"))
    saved.save(tmp_path / "chat.json")
    resumed = ChatSession.load(tmp_path / "chat.json", model, tok)
    assert resumed.cache_restored and resumed.cache.tokens == saved.cache.tokens
    got = list(resumed.send("tell me more"))
    assert [c.token for c in got] == [c.token for c in want]
    assert got[-1].stats.prefill_tokens == want[-1].stats.prefill_tokens < got[-1].stats.prompt_tokens


def test_a_state_file_of_another_shape_does_not_fit(hybrid, tmp_path):
    model, tok = hybrid
    cache = PromptCache.for_model(model)
    cache.prefill(model, [1, 2, 3, 4])
    layer = next(i for i, c in enumerate(cache.caches) if isinstance(c, StateCache))
    cache.caches[layer].state = tuple(a[..., :-1] for a in cache.caches[layer].state)
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "c.safetensors")
    with pytest.raises(mlxinfer.base.errors.CorruptCheckpointError, match=f"layer {layer}'s state is"):
        loaded.check_fits(model)


def test_state_cache_goes_back_only_where_it_can(hybrid):
    """Back within the replay log or to a checkpoint, exactly; elsewhere `reachable` names the
    checkpoint below (what a prompt then prefills from); the checkpoints are thinned, never past
    their bound, the newest kept."""
    model, _ = hybrid
    ids = prompt(200, seed=5)
    cache = PromptCache.for_model(model)
    cache.prefill(model, ids[:100], step=20)  # checkpoints at 0 (none: nothing seen), 20, 40, ..., 100
    cache.run(model, ids[100:110])
    state = next(c for c in cache.caches if isinstance(c, StateCache))
    assert sorted(state.checkpoints) == [20, 40, 60, 80, 100]
    assert cache.can_trim_to(105) and cache.can_trim_to(60) and not cache.can_trim_to(70)
    assert cache.reachable(70) == 60 and cache.reachable(10) == 0
    cache.trim(5)  # into the last run: replayed
    assert_state_as_if_fed(model, cache)
    cache.trim(45)  # to a checkpoint
    assert_state_as_if_fed(model, cache)
    assert sorted(state.checkpoints) == [20, 40, 60]
    cache.prefill(model, ids[60:200], step=10)
    assert len(state.checkpoints) == StateCache.max_checkpoints and max(state.checkpoints) == 200
    assert_state_as_if_fed(model, cache)


def test_multimodal_checkpoints_load_their_text_model(tmp_path):
    """Qwen3.5 (dense and MoE) as published: a vision encoder beside the text model, the text
    config in `text_config`; our logits are transformers' for text input."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2)
    ids = np.random.default_rng(0).integers(0, 500, size=(1, 80))
    for model_type, text_type, extra in (("qwen3_5", "qwen3_5_text", {}), ("qwen3_5_moe", "qwen3_5_moe_text", EXPERTS)):
        torch.manual_seed(0)
        text = {**BASE_CONFIG, **LINEAR, **extra, "model_type": text_type, "initializer_range": 0.08}
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
        model = AutoModelForImageTextToText.from_config(config).float().eval()
        perturb(model, 0)
        folder = tmp_path / model_type
        model.save_pretrained(folder)
        train_tokenizer(folder)
        assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
        with torch.no_grad():
            ref = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()(
                input_ids=torch.tensor(ids)).logits.numpy()
        ours, _ = mlxinfer.load(folder, dtype="float32")
        np.testing.assert_allclose(np.array(ours(mx.array(ids))), ref, atol=TOL, rtol=0)


def test_mlx_lm_checkpoints_load(hybrid_checkpoint, mlx_lm_quantized, tmp_path):
    """mlx-lm's conversions store the convolutions [C, K, 1] and Qwen's norms as 1 + offset:
    ours reads them back to mlx-lm's own logits."""
    import mlx_lm

    for name in ("qwen3_next", "lfm2"):
        src = tmp_path / name
        shutil.copytree(hybrid_checkpoint(name), src)
        config = json.loads((src / "config.json").read_text())  # with the top-level RoPE keys hub configs have
        rope = config.get("rope_parameters") or {}
        config.update({k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope})
        config.update(block_dim=config["hidden_size"]) if name == "lfm2" else config.update(full_attention_interval=2)
        (src / "config.json").write_text(json.dumps(config))
        folder = mlx_lm_quantized(src, bits=8, group_size=32)
        ids = mx.array(np.random.default_rng(2).integers(0, 500, size=(1, 40)))
        ref, _ = mlx_lm.load(str(folder))
        ours, _ = mlxinfer.load(folder)
        np.testing.assert_allclose(np.array(ours(ids)), np.array(ref(ids)), atol=TOL, rtol=0)


def test_tensor_sharding_refuses_heads_that_do_not_divide():
    config = {"model_type": "qwen3_next", "num_attention_heads": 12, "num_key_value_heads": 12, "hidden_size": 2048,
              "intermediate_size": 5040, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
    assert shard_config(config, 2)["linear_num_value_heads"] == 16
    with pytest.raises(ConfigError, match="linear_num_key_heads 16 to divide among 3 ranks; use 1, 2, 4 ranks"):
        shard_config(config, 3)
    lfm2 = {"model_type": "lfm2", "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 8,
            "hidden_size": 24, "block_ff_dim": 96, "conv_L_cache": 3, "num_hidden_layers": 2, "full_attn_idxs": [1]}
    with pytest.raises(ConfigError, match="24 short-convolution channels to divide among 16 ranks; use 1, 2, 4, 8 "):
        shard_config(lfm2, 16)
    assert shard_config(lfm2, 2)["short_conv_channels"] == 12


def test_inspect_shows_the_recurrent_state(hybrid):
    """`mlxinfer inspect` counts the recurrent layers and their state: per sequence, from the config
    (a convolution keeps K-1 inputs of its channels, a Gated DeltaNet also a key x value matrix per
    value head), float32 here."""
    from mlxinfer.engine.inspection import inspect_pipeline
    from mlxinfer.cli.inspect_report import render

    model, tok = hybrid
    report = inspect_pipeline(model, tok, [1, 2, 3], steps=2)
    c = model.config.raw
    if model.config.linear:
        channels = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
            c["linear_num_value_heads"] * c["linear_value_head_dim"]
        per_layer = (c["linear_conv_kernel_dim"] - 1) * channels + \
            c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    else:
        per_layer = (c["conv_L_cache"] - 1) * c["hidden_size"]
    layers = sum(t != "full_attention" for t in c["layer_types"])
    assert report["kv_cache"]["state_layers"] == layers
    assert report["kv_cache"]["state_bytes"] == 4 * per_layer * layers
    assert "keep a recurrent state of" in render(report, "t")


def test_rotating_and_quantized_attention_beside_the_state(variant):
    """Cache options apply to the attention layers (a rotating window, 8-bit K/V where the head
    dimension allows); the recurrent layers keep their state; batched still equals alone, and a
    context past the window keeps going."""
    _, _, model, tok = variant
    options = dict(max_kv_size=40, **({"kv_bits": 8} if model.config.head_dim % 32 == 0 else {}))
    kinds = {type(c).__name__ for c in make_cache(model, **options)}
    assert kinds == {"RotatingKVCache", "StateCache"}
    items = [(prompt(n, seed=i), GREEDY) for i, n in enumerate((5, 60))]
    assert assert_batch_equals_solo(model, tok, items, dict(prefill_step=PREFILL_STEP, **options)) == 2


def test_an_interrupted_forward_pass_leaves_every_state_as_it_was(hybrid):
    """Ctrl-C inside a layer, after earlier recurrent layers took the step: those are rolled back
    (replayed to before it), so the next run equals one that was never interrupted."""
    model, tok = hybrid
    cache = PromptCache.for_model(model)
    ids = prompt(40, seed=2)
    cache.prefill(model, ids[:30])
    last = max(i for i, c in enumerate(cache.caches) if isinstance(c, StateCache))
    assert any(isinstance(c, StateCache) for c in cache.caches[:last])

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    cache.caches[last].update = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.run(model, ids[30:36])
    finally:
        del cache.caches[last].update
    assert all(c.offset == 30 for c in cache.caches) and len(cache.tokens) == 30
    assert_state_as_if_fed(model, cache)
    got = np.array(cache.run(model, ids[30:]))
    want = np.array(model(mx.array([ids]))[0, 30:])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
