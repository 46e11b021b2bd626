"""LoRA adapters against their makers: PEFT adapters (random, non-zero: init_lora_weights=False)
give PEFT's float32 logits on random-weight Llama, Qwen3 and Qwen3-MoE checkpoints and on an
mlx-lm-quantized Llama (PEFT running on its dequantized weights); adapters written by mlx-lm's
own LoRA/DoRA layers give mlx-lm's logits; bad adapters are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_parity import TOL, tokens
from test_shard import can_launch  # noqa: F401  (the fixture: two ranks can start here)

import mlxinfer
from mlxinfer.base.errors import AdapterError, CorruptCheckpointError, ModelNotFoundError

MOE = dict(num_experts=4, moe_intermediate_size=48, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_VARIANTS = {
    "llama": ("llama", {}, dict(r=4, lora_alpha=8, target_modules=ATTN_MLP)),
    "llama-dora": ("llama", {}, dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                     use_dora=True)),
    "qwen3-rslora-patterns": ("qwen3", dict(head_dim=32), dict(
        r=8, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"],
        rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 32})),
    "qwen3_moe": ("qwen3_moe", MOE, dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


def peft_adapter(base: Path, out: Path, seed: int = 1, **lora) -> tuple[Path, np.ndarray]:
    """A random PEFT adapter on the transformers model in `base` (or a dequantized copy),
    saved to `out`, and PEFT's logits on `tokens()` with it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora)).eval()
    with torch.no_grad():  # DoRA starts each magnitude at its row's norm (a gain of 1): move them
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.5 * torch.rand_like(p))
    model.save_pretrained(out)
    with torch.no_grad():
        return out, model(torch.tensor(tokens())).logits.numpy()


def ours(model) -> np.ndarray:
    return np.array(model(mx.array(tokens())))


@pytest.mark.parametrize("name", sorted(PEFT_VARIANTS))
def test_peft_adapter_matches_peft(name, hf_checkpoint, tmp_path):
    model_type, overrides, lora = PEFT_VARIANTS[name]
    folder = hf_checkpoint(model_type, **overrides)
    adapter, ref = peft_adapter(folder, tmp_path / "adapter", **lora)
    model, _ = mlxinfer.load(folder, dtype="float32", adapter_path=adapter)
    got = ours(model)
    base = np.array(mlxinfer.load(folder, dtype="float32")[0](mx.array(tokens())))
    assert np.abs(ref - base).max() > 0.05, "the adapter barely changes the logits: the test would prove nothing"
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    model.adapters.default = None  # the base weights stay intact under the adapter
    np.testing.assert_array_equal(ours(model), base)


def test_quantized_base_matches_peft_on_its_dequantized_weights(hf_checkpoint, mlx_lm_quantized, tmp_path):
    """A 4-bit base stays 4-bit (the adapter float beside it); PEFT runs on the same weights dequantized."""
    from mlx_lm import convert

    quantized = mlx_lm_quantized(hf_checkpoint("llama"), bits=4)
    dense = tmp_path / "dequantized"
    convert(str(quantized), str(dense), dequantize=True)
    adapter, ref = peft_adapter(dense, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ATTN_MLP)
    model, _ = mlxinfer.load(quantized, adapter_path=adapter)
    layer = model.layers[0].mlp.down_proj
    assert type(layer.base).__name__ == "QuantizedLinear" and layer.table.updates[1].a.dtype == mx.float32
    np.testing.assert_allclose(ours(model), ref, atol=TOL, rtol=0)


MLX_VARIANTS = {
    "llama-lora": ("llama", {}, "lora", 1),
    "llama-dora": ("llama", {}, "dora", 2),
    "qwen3_moe-lora": ("qwen3_moe", MOE, "lora", 2),
}


def mlx_lm_adapter(folder: Path, out: Path, kind: str, num_layers: int) -> Path:
    """An adapter folder as mlx-lm's trainer writes it: its own LoRA/DoRA layers on the last
    `num_layers` layers, their (random, non-zero) parameters saved as adapters.safetensors."""
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(folder))
    model.freeze()
    params = {"rank": 4, "scale": 3.0, "dropout": 0.0}
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    mx.random.seed(3)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    trainable = {k: v + 0.1 * mx.random.normal(v.shape) if k.endswith(("lora_b", "m")) else v
                 for k, v in trainable.items()}
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), trainable)
    config = {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("name", sorted(MLX_VARIANTS))
def test_mlx_lm_adapter_matches_mlx_lm(name, hf_checkpoint, tmp_path):
    import mlx_lm

    model_type, overrides, kind, num_layers = MLX_VARIANTS[name]
    folder = hf_checkpoint(model_type, **overrides)
    adapter = mlx_lm_adapter(folder, tmp_path / "adapter", kind, num_layers)
    ref_model, _ = mlx_lm.load(str(folder), adapter_path=str(adapter))
    ref = np.array(ref_model(mx.array(tokens())))
    base = np.array(mlx_lm.load(str(folder))[0](mx.array(tokens())))
    assert np.abs(ref - base).max() > 0.05
    model, _ = mlxinfer.load(folder, adapter_path=adapter)
    np.testing.assert_allclose(ours(model), ref, atol=TOL, rtol=0)


# --- refusals ---


def write_peft(folder: Path, config: dict, tensors: dict[str, np.ndarray], file: str = "adapter_model.safetensors"):
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    if file.endswith(".safetensors"):
        save_file(tensors, str(folder / file))
    else:
        (folder / file).write_bytes(b"\x80\x04not really a pickle")
    return folder


def lora_pair(module: str, rank: int = 4, in_dims: int = 64, out_dims: int = 64, a: float = 1.0,
              b: float = 1.0) -> dict[str, np.ndarray]:
    prefix = f"base_model.model.{module}"
    return {f"{prefix}.lora_A.weight": np.full((rank, in_dims), a, np.float32),
            f"{prefix}.lora_B.weight": np.full((out_dims, rank), b, np.float32)}


Q = "model.layers.0.self_attn.q_proj"
# (adapter_config.json fields over r=4, lora_alpha=8; tensors) -> the error and words naming the problem
REFUSED = {
    "unknown-module": ({}, lora_pair("model.layers.7.self_attn.q_proj"), AdapterError,
                       "model.layers.7.self_attn.q_proj"),
    "rank-mismatch": ({"r": 8}, lora_pair(Q), AdapterError, "rank 4 but adapter_config.json says r=8"),
    "wrong-shape": ({}, lora_pair(Q, in_dims=48), AdapterError, "do not fit"),
    "modules-to-save": ({"modules_to_save": ["lm_head"]}, lora_pair(Q), AdapterError, "modules_to_save"),
    # the fields' types and ranges, as PEFT's LoraConfig takes them (r and ranks: positive whole numbers)
    "nan-tensor": ({}, lora_pair(Q, a=np.nan), AdapterError, f"'base_model.model.{Q}.lora_A.weight' holds NaN"),
    "inf-tensor": ({}, lora_pair(Q, b=np.inf), AdapterError, f"'base_model.model.{Q}.lora_B.weight' holds NaN"),
    "r-float": ({"r": 4.0}, lora_pair(Q), AdapterError, "r 4.0; expected a positive whole number"),
    "r-nan": ({"r": float("nan")}, lora_pair(Q), AdapterError, "r nan; expected a positive whole number"),
    "alpha-string": ({"lora_alpha": "8"}, lora_pair(Q), AdapterError, "lora_alpha '8'; expected a positive number"),
    "rslora-string": ({"use_rslora": "false"}, lora_pair(Q), AdapterError, "use_rslora 'false'; expected true or false"),
    "rank-pattern-zero": ({"rank_pattern": {"q_proj": 0}}, lora_pair(Q), AdapterError,
                          "rank_pattern['q_proj'] 0; expected a positive whole number"),
    "rank-pattern-string": ({"rank_pattern": {"q_proj": "4"}}, lora_pair(Q), AdapterError, "rank_pattern['q_proj'] '4'"),
    "rank-pattern-list": ({"rank_pattern": ["q_proj"]}, lora_pair(Q), AdapterError, "rank_pattern ['q_proj']"),
    "alpha-pattern-string": ({"alpha_pattern": {"q_proj": "x"}}, lora_pair(Q), AdapterError,
                             "alpha_pattern['q_proj'] 'x'; expected a positive number"),
    "bad-regex": ({"rank_pattern": {"q_proj(": 4}}, lora_pair(Q), AdapterError,
                  "rank_pattern key 'q_proj(' is not a valid regular expression"),
    "long-regex": ({"alpha_pattern": {"q" * 5000: 4}}, lora_pair(Q), AdapterError, "longer than a pattern may be"),
    # what Python's re backtracks on for ever, or `regex` compiles into gigabytes: RE2 refuses both
    "backreference": ({"rank_pattern": {r"(q)\1_proj": 4}}, lora_pair(Q), AdapterError, "refused by RE2"),
    "repeat-bomb": ({"target_modules": r"(?:.{1000}){1000}"}, lora_pair(Q), AdapterError,
                    "target_modules '(?:.{1000}){1000}' is refused by RE2"),
    "target-modules-number": ({"target_modules": 7}, lora_pair(Q), AdapterError, "target_modules 7; expected a list"),
    # a layer the config's target_modules does not select (PEFT would leave it out): the files disagree
    "target-modules-list": ({"target_modules": ["k_proj", "v_proj"]}, lora_pair(Q), AdapterError,
                            f"'{Q}' is not among the layers adapter_config.json's target_modules selects"),
    "target-modules-regex": ({"target_modules": r".*\.(k|v)_proj"}, lora_pair(Q), AdapterError,
                             "target_modules selects"),
    "long-path": (None, None, ModelNotFoundError, "at most 4,096 characters"),
    "long-folder-name": (None, None, ModelNotFoundError, "cannot read the adapter folder"),
    "pickle": ({}, {}, CorruptCheckpointError, "adapter_model.bin"),
    "no-weights": ({}, {}, ModelNotFoundError, "adapter_model.safetensors"),
    "no-config": (None, None, ModelNotFoundError, "adapter_config.json"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_adapters_are_refused_in_one_line(case, tiny, tmp_path):
    model, _ = mlxinfer.load(tiny, dtype="float32")
    config, tensors, error, words = REFUSED[case]
    folder = tmp_path / case
    if case == "long-path":
        folder = tmp_path / ("x/" * 50_000)
    elif case == "long-folder-name":
        folder = tmp_path / ("x" * 300)  # over a file system's 255 bytes per name
    elif config is None:
        folder.mkdir()
    else:
        write_peft(folder, config, tensors, file={"pickle": "adapter_model.bin", "no-weights": "README.md"}.get(
            case, "adapter_model.safetensors"))
    with pytest.raises(error) as e:
        mlxinfer.load_adapter(model, folder, name="x")
    assert words in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 500
    assert model.adapters.slots == {} if "adapters" in model.__dict__ else True  # nothing half-registered


def test_an_update_that_overflows_the_models_dtype_is_refused(tiny, tmp_path):
    """Finite in the file, infinite once scaled and cast to a float16 model's weights (65,504 at most)."""
    model, _ = mlxinfer.load(tiny, dtype="float16")
    folder = write_peft(tmp_path / "big", {"lora_alpha": 4e5}, lora_pair(Q, b=1.0))
    with pytest.raises(AdapterError, match=r"update of layer 'model\.layers\.0\.self_attn\.qkv_proj' is not finite "
                       r"in the model's mlx\.core\.float16") as e:
        mlxinfer.load_adapter(model, folder)
    assert "\n" not in str(e.value) and model.adapters.slots == {}


@pytest.mark.parametrize("name", ["a\nb", "nul\0", "\x1b[31mred", "tab\t", "x" * 129, "", "a:b", "a/b"])
def test_adapter_names_follow_one_rule(name, tiny, tmp_path):
    model, _ = mlxinfer.load(tiny, dtype="float32")
    folder = write_peft(tmp_path / "a", {}, lora_pair(Q))
    with pytest.raises(mlxinfer.MlxinferError, match="1 to 128 printable characters") as e:
        mlxinfer.load_adapter(model, folder, name=name)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    assert mlxinfer.load_adapter(model, folder, name="with spaces, dots. and 128 chars" + "x" * 96) is not None


def test_names_are_unique_and_unload_frees_them(tiny, tmp_path):
    model, _ = mlxinfer.load(tiny, dtype="float32")
    folder = write_peft(tmp_path / "a", {}, lora_pair("model.layers.0.self_attn.q_proj"))
    assert mlxinfer.load_adapter(model, folder) == "a"
    with pytest.raises(mlxinfer.MlxinferError, match="already loaded"):
        mlxinfer.load_adapter(model, folder)
    mlxinfer.unload_adapter(model, "a")
    assert mlxinfer.load_adapter(model, folder, name="b") == "b"


SHARDED = {
    "llama-tensor": ("llama-dora", "tensor"),
    "llama-pipeline": ("llama-dora", "pipeline"),
    "qwen3_moe-tensor": ("qwen3_moe", "tensor"),
}


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_model_with_an_adapter_equals_one_process(name, can_launch, hf_checkpoint, tmp_path):
    """2 ranks under mlx.launch (split by heads: B's rows or A's columns follow their weight's
    split, DoRA's row norms summed over the ranks; or by layers) with a PEFT adapter give the
    logits (within 1e-4) and greedy tokens of one process with it."""
    from test_shard import PROMPT, sharded

    variant, split = SHARDED[name]
    model_type, overrides, lora = PEFT_VARIANTS[variant]
    folder = hf_checkpoint(model_type, **overrides)
    adapter, _ = peft_adapter(folder, tmp_path / "adapter", **lora)
    model, tok = mlxinfer.load(folder, dtype="float32", adapter_path=adapter)
    logits = np.array(model(mx.array([PROMPT]))[0])
    tokens = [c.token for c in mlxinfer.stream_generate(model, tok, PROMPT, max_tokens=12, temperature=0.0,
                                                        ignore_eos=True)]
    root = str(Path(__file__).resolve().parent.parent)
    ranks = sharded(folder, tmp_path / "out", 2, "float32", split, adapter, env={"PYTHONPATH": root})
    for rank in ranks:
        np.testing.assert_allclose(np.array(rank["logits"]), logits, atol=TOL, rtol=0)
        assert rank["tokens"] == tokens


# --- several adapters on one model, chosen per request ---


@pytest.fixture(scope="module")
def two_adapters(hf_checkpoint, tmp_path_factory):
    """{family: (folder, adapter A, adapter B)}: A on attention and MLP, B DoRA on other layers
    (Llama); for Qwen3-MoE, A and B on the experts, of different ranks."""
    out = {}
    root = tmp_path_factory.mktemp("adapters")
    llama = hf_checkpoint("llama", head_dim=32)
    out["llama"] = (llama,
                    peft_adapter(llama, root / "llama-a", seed=1, r=4, lora_alpha=8, target_modules=ATTN_MLP)[0],
                    peft_adapter(llama, root / "llama-b", seed=2, r=2, lora_alpha=8, use_dora=True,
                                 target_modules=["v_proj", "o_proj", "up_proj"])[0])
    moe = hf_checkpoint("qwen3_moe", **MOE)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    out["qwen3_moe"] = (moe,
                        peft_adapter(moe, root / "moe-a", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"],
                                     target_parameters=experts)[0],
                        peft_adapter(moe, root / "moe-b", seed=2, r=2, lora_alpha=4,
                                     target_parameters=experts[1:])[0])
    return out


def with_adapters(folder: Path, a: Path, b: Path):
    model, tok = mlxinfer.load(folder, dtype="float32")
    assert mlxinfer.load_adapter(model, a, "a") == "a" and mlxinfer.load_adapter(model, b, "b") == "b"
    return model, tok


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_rows_of_different_adapters_in_one_pass_equal_each_alone(family, two_adapters):
    """Three rows (base, A, B) of 32 tokens in one forward pass (experts see 192 routed rows: the
    count from which they sort rows by expert) give each row's logits alone."""
    from mlxinfer.models.lora import selecting

    model, _ = with_adapters(*two_adapters[family])
    ids = mx.array(np.random.default_rng(0).integers(0, 500, size=(3, 32)))
    with selecting(model, [None, "a", "b"]):
        together = np.array(model(ids))
    alone = []
    for i, name in enumerate([None, "a", "b"]):
        with selecting(model, [name]):
            alone.append(np.array(model(ids[i : i + 1]))[0])
    np.testing.assert_allclose(together, np.stack(alone), atol=TOL, rtol=0)
    assert np.abs(alone[1] - alone[0]).max() > 0.05 and np.abs(alone[2] - alone[1]).max() > 0.05


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_batch_of_base_a_and_b_equals_each_alone(family, two_adapters):
    """batch_generate with adapters=[None, 'a', 'b'] on one prompt: each stream equals its own
    stream_generate, token for token; the base's equals a model that never had an adapter."""
    from test_batch import assert_batch_equals_solo

    folder, a, b = two_adapters[family]
    model, tok = with_adapters(folder, a, b)
    ids = np.random.default_rng(1).integers(3, 500, size=20).tolist()
    opts = dict(max_tokens=10, ignore_eos=True, temperature=0.0)
    items = [(ids, dict(opts, adapter=name)) for name in (None, "a", "b")]
    assert assert_batch_equals_solo(model, tok, items) == 3
    texts = mlxinfer.batch_generate(model, tok, [ids] * 3, adapters=[None, "a", "b"], **opts)
    assert len(set(texts)) == 3, "the adapters should change the greedy continuation"
    plain, _ = mlxinfer.load(folder, dtype="float32")
    assert texts[0] == mlxinfer.generate(plain, tok, ids, **opts)
    assert texts[1] == mlxinfer.generate(model, tok, ids, adapter="a", **opts)


def test_the_pool_keeps_kv_apart_by_adapter(two_adapters):
    """A prompt served with adapter A leaves K/V that a request with B (or the base) must not
    reuse; a request with A again reuses them, and each equals its fresh run."""
    from mlxinfer.engine.batch import BatchGenerator
    from mlxinfer.engine.pool import PromptCachePool
    from test_pool import BIG

    model, tok = with_adapters(*two_adapters["llama"])
    pool = PromptCachePool(BIG)
    ids = np.random.default_rng(2).integers(3, 500, size=24).tolist()
    opts = dict(max_tokens=6, ignore_eos=True, temperature=0.0)

    def served(name):
        engine = BatchGenerator(model, tok, pool=pool)
        uid = engine.submit(ids, adapter=name, **opts)
        chunks = [c for u, c in engine.stream() if u == uid]
        return [c.token for c in chunks if c.token is not None], chunks[-1].stats.prefill_tokens

    first = served("a")
    assert first[1] == len(ids)
    for name in ("b", None):
        tokens, prefilled = served(name)
        assert prefilled == len(ids), f"adapter {name}'s request reused adapter a's K/V"
        assert tokens == [c.token for c in mlxinfer.stream_generate(model, tok, ids, adapter=name, **opts)
                          if c.token is not None]
    again = served("a")
    assert again[1] < len(ids) and again[0] == first[0]
    assert pool.fetch(model, ids + [5], adapter="b").tokens != []  # b's own entry is there now
    mlxinfer.unload_adapter(model, "b")
    mlxinfer.load_adapter(model, two_adapters["llama"][1], "b")  # a new b (A's weights) under the old name
    assert pool.fetch(model, ids + [5], adapter="b").tokens == []


def test_unknown_adapter_in_a_request_is_refused(two_adapters):
    model, tok = with_adapters(*two_adapters["llama"])
    with pytest.raises(mlxinfer.MlxinferError, match="no adapter named 'c'"):
        mlxinfer.generate(model, tok, "hi", adapter="c", max_tokens=2)
    with pytest.raises(mlxinfer.MlxinferError, match="one per prompt"):
        mlxinfer.batch_generate(model, tok, ["a", "b"], adapters=["a"])


def test_chat_session_runs_its_adapter(two_adapters):
    """A ChatSession with adapter='a' replies as stream_generate with A does on the same messages."""
    model, tok = with_adapters(*two_adapters["llama"])
    opts = dict(max_tokens=8, ignore_eos=True, temperature=0.0)
    messages = [{"role": "user", "content": "hello there"}]
    for name in ("a", "b"):
        chat = mlxinfer.ChatSession(model, tok, adapter=name, **opts)
        got = [c.token for c in chat.send("hello there") if c.token is not None]
        assert got == [c.token for c in mlxinfer.stream_generate(model, tok, messages, adapter=name, **opts)
                       if c.token is not None]


# --- fused into the weights by the converter ---


@pytest.mark.parametrize("name", ["llama", "llama-dora", "qwen3_moe"])
def test_convert_fuses_like_peft_merge_and_unload(name, hf_checkpoint, tmp_path):
    """`convert --adapter` writes weights with the adapter merged (DoRA included): the output,
    loaded without it, gives the logits of PEFT's merge_and_unload within 1e-4."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlxinfer.convert import convert

    model_type, overrides, lora = PEFT_VARIANTS[name]
    folder = hf_checkpoint(model_type, **overrides)
    adapter, unmerged = peft_adapter(folder, tmp_path / "adapter", **lora)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    with torch.no_grad():
        ref = merged(torch.tensor(tokens())).logits.numpy()
    np.testing.assert_allclose(ref, unmerged, atol=TOL, rtol=0)  # PEFT's own merge is the adapter's logits
    convert(folder, tmp_path / "fused", adapter=adapter, dtype="float32")
    model, _ = mlxinfer.load(tmp_path / "fused", dtype="float32")
    np.testing.assert_allclose(ours(model), ref, atol=TOL, rtol=0)


def test_convert_fuses_before_quantizing(hf_checkpoint, tmp_path):
    """With --bits the merged weights are what gets quantized: the output equals quantizing
    PEFT's merged checkpoint (up to a rounding step flipping a weight's bin)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlxinfer.convert import convert

    model_type, overrides, lora = PEFT_VARIANTS["llama-dora"]
    folder = hf_checkpoint(model_type, **overrides)
    adapter, _ = peft_adapter(folder, tmp_path / "adapter", **lora)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(tmp_path / "merged")
    for f in folder.glob("tokenizer*"):
        (tmp_path / "merged" / f.name).write_bytes(f.read_bytes())
    convert(folder, tmp_path / "fused4", adapter=adapter, bits=4, group_size=32, quantize=True, dtype="float32")
    convert(tmp_path / "merged", tmp_path / "merged4", bits=4, group_size=32, quantize=True, dtype="float32")
    fused = mlxinfer.load(tmp_path / "fused4")[0]
    assert type(fused.layers[0].self_attn.qkv_proj).__name__ == "QuantizedLinear"
    np.testing.assert_allclose(ours(fused), ours(mlxinfer.load(tmp_path / "merged4")[0]), atol=2e-2, rtol=0)


def test_base_rows_of_an_adapted_model_are_the_plain_models(two_adapters):
    """Loading adapters leaves the base's results bit for bit: a base request decodes as on a
    model that never had one (the same fused decode step where it applies), logprobs included."""
    folder, a, b = two_adapters["llama"]
    model, tok = with_adapters(folder, a, b)
    plain, _ = mlxinfer.load(folder, dtype="float32")
    ids = np.random.default_rng(3).integers(3, 500, size=20).tolist()
    opts = dict(max_tokens=8, ignore_eos=True, temperature=0.0)

    def run(m, **extra):
        return [(c.token, c.logprob) for c in mlxinfer.stream_generate(m, tok, ids, **opts, **extra)
                if c.token is not None]

    assert run(model) == run(plain)
    assert run(model, adapter="a") != run(plain)


def test_a_batch_after_an_unload_skips_the_layers_left_without_updates(two_adapters):
    """A covers every projection, B a few: once A is unloaded, a batch of base and B rows runs,
    each row as alone (the layers only A had add nothing)."""
    from mlxinfer.models.lora import selecting

    model, _ = with_adapters(*two_adapters["llama"])
    mlxinfer.unload_adapter(model, "a")
    ids = mx.array(np.random.default_rng(4).integers(0, 500, size=(2, 16)))
    with selecting(model, [None, "b"]):
        together = np.array(model(ids))
    for i, name in enumerate([None, "b"]):
        with selecting(model, [name]):
            np.testing.assert_allclose(together[i], np.array(model(ids[i : i + 1]))[0], atol=TOL, rtol=0)
