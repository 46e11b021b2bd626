"""Embeddings (`mlxinfer.embed`, `mlxinfer embed`, `POST /v1/embeddings`) against
sentence-transformers and transformers on random-weight checkpoints built here: a tiny
Qwen3 saved as a sentence-transformers model (last-token pooling + Normalize, as
Qwen3-Embedding ships, in sentence-transformers 6's layout and in the older one the hub
checkpoints have), a tiny Llama with mean pooling, and a plain causal-LM checkpoint.
The server is driven by the official `openai` client on its default settings."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cli.main import main
from mlxinfer.base.errors import ConfigError, InvalidOptionError, NoLMHeadError
from serving import KEY, Server, post

TOL = 1e-4
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Paris is the capital of France. Berlin is the capital of Germany. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text — ünïcödé too.",
]


def sentence_transformer(source: Path, out: Path, modes: str | list[str], normalize: bool) -> Path:
    """`source` (a transformers checkpoint) saved by sentence-transformers as Transformer +
    Pooling(`modes`) (+ Normalize) in `out`: the bare base model's weights and its files."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(source))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=modes)
    modules = [transformer, pooling, *([Normalize()] if normalize else [])]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def as_hub_layout(folder: Path) -> None:
    """Rewrite sentence-transformers 6's files in the form the hub's embedding checkpoints
    (Qwen3-Embedding among them) were saved in: the old module names, the Pooling config's
    one flag per mode, and no modality config (so a text is tokenized as it is)."""
    modules = json.loads((folder / "modules.json").read_text())
    for m in modules:
        m["type"] = "sentence_transformers.models." + m["type"].rsplit(".", 1)[-1]
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    modes = {config["pooling_mode"]} if isinstance(config["pooling_mode"], str) else set(config["pooling_mode"])
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
             "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
             "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    legacy = {"word_embedding_dimension": config["embedding_dimension"],
              **{flag: mode in modes for mode, flag in flags.items()}, "include_prompt": True}
    pooling.write_text(json.dumps(legacy))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))


def st_encode(folder: Path, texts, **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(list(texts), batch_size=len(texts), **kwargs)


@pytest.fixture(scope="module")
def llama_st(hf_checkpoint, tmp_path_factory) -> Path:
    """The tiny Llama saved by sentence-transformers 6 with mean pooling, no Normalize (its
    tokenizer has a chat template, so it records the 'message' modality)."""
    return sentence_transformer(hf_checkpoint("llama"), tmp_path_factory.mktemp("st") / "llama", "mean", False)


@pytest.fixture(scope="module")
def qwen3_source(qwen3_tokenizer, tmp_path_factory) -> Path:
    """A tiny random Qwen3 causal LM with the real Qwen3 tokenizer, given the post-processor
    Qwen3-Embedding's tokenizer has (EOS after every text) and its left padding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("qwen3src")
    tokenizer = json.loads((qwen3_tokenizer / "tokenizer.json").read_text())
    eos = "<|endoftext|>"
    eos_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == eos)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eos, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eos, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": eos, "type_id": 1}}],
        "special_tokens": {eos: {"id": eos, "ids": [eos_id], "tokens": [eos]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((qwen3_tokenizer / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(
        "qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=max(t["id"] for t in tokenizer["added_tokens"]) + 1,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.08)
    AutoModelForCausalLM.from_config(hf_config).float().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_st(qwen3_source, tmp_path_factory) -> Path:
    """Qwen3-Embedding's shape: last-token pooling + Normalize, saved by sentence-transformers 6."""
    return sentence_transformer(qwen3_source, tmp_path_factory.mktemp("st") / "qwen3", "lasttoken", True)


@pytest.fixture(scope="module")
def qwen3_hub(qwen3_st, tmp_path_factory) -> Path:
    """The same checkpoint in the layout of the hub's Qwen3-Embedding."""
    folder = tmp_path_factory.mktemp("hub") / "qwen3-embedding"
    shutil.copytree(qwen3_st, folder)
    as_hub_layout(folder)
    return folder


# --- the Python API --------------------------------------------------------------------------------


def test_qwen3_embedding_layout_matches_sentence_transformers(qwen3_hub):
    model, tokenizer = mlxinfer.load(qwen3_hub)
    assert model.sentence_embedding.modes == ("lasttoken",) and model.sentence_embedding.normalize
    ours = mlxinfer.embed(model, tokenizer, TEXTS)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(ours, st_encode(qwen3_hub, TEXTS), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # the vector of the text's last token, EOS included: the text's own ids give the same vectors
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert all(i[-1] == tokenizer.encode("<|endoftext|>", add_special_tokens=False)[0] for i in ids)
    np.testing.assert_allclose(mlxinfer.embed(model, tokenizer, ids), ours, atol=1e-6)


def test_sentence_transformers_6_layout_renders_the_chat_template(qwen3_st):
    """sentence-transformers 6 saves a model whose tokenizer has a chat template with the
    'message' modality and then embeds every text as a user message: so do we."""
    model, tokenizer = mlxinfer.load(qwen3_st)
    assert model.sentence_embedding.as_message
    np.testing.assert_allclose(mlxinfer.embed(model, tokenizer, TEXTS), st_encode(qwen3_st, TEXTS), atol=TOL)


def test_alone_equals_batched(qwen3_hub):
    model, tokenizer = mlxinfer.load(qwen3_hub)
    texts = [t[: 3 + 7 * i] for i, t in enumerate(TEXTS * 3)]  # many lengths, so batches are padded
    together = mlxinfer.embed(model, tokenizer, texts, batch_size=4)
    alone = np.concatenate([mlxinfer.embed(model, tokenizer, [t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=TOL)
    np.testing.assert_allclose(mlxinfer.embed(model, tokenizer, texts), together, atol=TOL)


def test_mean_pooling_without_normalize(llama_st):
    model, tokenizer = mlxinfer.load(llama_st)
    assert model.sentence_embedding.modes == ("mean",) and not model.sentence_embedding.normalize
    raw = mlxinfer.embed(model, tokenizer, TEXTS, normalize=False)
    np.testing.assert_allclose(raw, st_encode(llama_st, TEXTS), atol=TOL)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)  # the checkpoint's own vectors are not unit length
    unit = mlxinfer.embed(model, tokenizer, TEXTS)
    np.testing.assert_allclose(unit, st_encode(llama_st, TEXTS, normalize_embeddings=True), atol=TOL)


@pytest.mark.parametrize("modes", ["cls", "max", "mean_sqrt_len_tokens", "weightedmean", ["lasttoken", "cls"]])
@pytest.mark.parametrize("layout", ["v6", "hub"])
def test_pooling_modes(hf_checkpoint, tmp_path, modes, layout):
    """Each mode, and several concatenated: in the order given (v6), or in the fixed order of
    the old layout's flags (hub), whichever sentence-transformers applies."""
    folder = sentence_transformer(hf_checkpoint("llama"), tmp_path / "st", modes, False)
    if layout == "hub":
        as_hub_layout(folder)
    model, tokenizer = mlxinfer.load(folder)
    ours = mlxinfer.embed(model, tokenizer, TEXTS, normalize=False)
    np.testing.assert_allclose(ours, st_encode(folder, TEXTS), atol=TOL, rtol=1e-5)


@pytest.mark.parametrize("modes", ["mean", "max", "weightedmean", ["lasttoken", "cls", "mean_sqrt_len_tokens"]])
def test_texts_run_in_pieces_equal_sentence_transformers(hf_checkpoint, tmp_path, modes):
    """Forward passes of at most 12 tokens (a server's prefill chunk, small): texts longer than that
    run alone in pieces through a KV cache, the short ones batched; every mode's vectors are
    sentence-transformers' of the whole texts."""
    from mlxinfer.engine.embed import embed_slices, encode_texts

    folder = sentence_transformer(hf_checkpoint("llama"), tmp_path / "st", modes, False)
    model, tokenizer = mlxinfer.load(folder)
    ids = encode_texts(model, tokenizer, TEXTS)
    assert max(map(len, ids)) > 3 * 12 and min(map(len, ids)) <= 12
    slices = embed_slices(model, ids, normalize=False, chunk=12)
    passes = 0
    while True:
        try:
            next(slices)
            passes += 1
        except StopIteration as end:
            ours = end.value
            break
    assert passes >= sum(-(-len(i) // 12) for i in ids if len(i) > 12)
    np.testing.assert_allclose(ours, st_encode(folder, TEXTS), atol=TOL, rtol=1e-5)


def test_plain_checkpoint_is_mean_pooled(hf_checkpoint):
    """No sentence-transformers files: the mean of the final hidden states (transformers'
    `last_hidden_state`, after the final norm) over the text's tokens, normalised."""
    import torch
    from transformers import AutoModel

    folder = hf_checkpoint("llama")
    model, tokenizer = mlxinfer.load(folder)
    hf = AutoModel.from_pretrained(folder).float().eval()
    expected = []
    for text in TEXTS:
        with torch.no_grad():
            hidden = hf(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0].mean(0).numpy()
        expected.append(hidden / np.linalg.norm(hidden))
    np.testing.assert_allclose(mlxinfer.embed(model, tokenizer, TEXTS), np.stack(expected), atol=TOL)
    assert "lm_head" in model  # a causal LM keeps its head: it still generates
    assert mlxinfer.generate(model, tokenizer, "hello", max_tokens=2, temperature=0.0)


@pytest.mark.parametrize("dimensions", [8, 17])
def test_dimensions_truncate_then_renormalise(qwen3_hub, llama_st, dimensions):
    for folder in (qwen3_hub, llama_st):
        model, tokenizer = mlxinfer.load(folder)
        ours = mlxinfer.embed(model, tokenizer, TEXTS, dimensions=dimensions)
        assert ours.shape == (len(TEXTS), dimensions)
        expected = st_encode(folder, TEXTS, truncate_dim=dimensions, normalize_embeddings=True)
        np.testing.assert_allclose(ours, expected, atol=TOL)
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_bad_inputs(qwen3_hub):
    model, tokenizer = mlxinfer.load(qwen3_hub)
    cases = [([], "no text"), ([""], "is empty"), (["ok", [5, -1]], "text[1] holds -1"),
             (["word " * 300], "model's context is 256"), ([[1] * 257], "257 tokens")]
    for texts, fact in cases:
        with pytest.raises(InvalidOptionError, match=fact.replace("[", r"\[").replace("]", r"\]")):
            mlxinfer.embed(model, tokenizer, texts)
    for dimensions in (0, 33, True):
        with pytest.raises(InvalidOptionError, match="dimensions"):
            mlxinfer.embed(model, tokenizer, ["hi"], dimensions=dimensions)


def test_headless_checkpoint_refuses_to_generate(qwen3_hub):
    """A bare base model (what sentence-transformers and Qwen3-Embedding save) loads without an
    LM head; asked to generate it says so in one line."""
    from safetensors import safe_open

    with safe_open(str(qwen3_hub / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head.")) for n in names)
    model, tokenizer = mlxinfer.load(qwen3_hub)
    assert "lm_head" not in model
    with pytest.raises(NoLMHeadError, match="no LM head"):
        mlxinfer.generate(model, tokenizer, "hello", max_tokens=2)
    result = CliRunner().invoke(main, ["generate", "--model", str(qwen3_hub), "-p", "hello"])
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith("error: this model has no LM")


def test_module_we_do_not_run_is_refused_on_embedding_only(llama_st, tmp_path):
    folder = tmp_path / "dense"
    shutil.copytree(llama_st, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    model, tokenizer = mlxinfer.load(folder)
    with pytest.raises(ConfigError, match="'Dense' module"):
        mlxinfer.embed(model, tokenizer, ["hi"])


def test_pooling_config_outside_the_folder_is_refused(llama_st, tmp_path):
    """The sentence-transformers files are checkpoint files: read through `files.checkpoint_file`."""
    from mlxinfer.base.errors import CorruptCheckpointError

    folder = tmp_path / "linked"
    shutil.copytree(llama_st, folder)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"pooling_mode": "cls"}))
    (folder / "1_Pooling" / "config.json").unlink()
    (folder / "1_Pooling" / "config.json").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="links outside"):
        mlxinfer.load(folder)


# --- the CLI ---------------------------------------------------------------------------------------


def test_cli_embed(qwen3_hub):
    expected = st_encode(qwen3_hub, TEXTS[:2], normalize_embeddings=True)
    result = CliRunner().invoke(main, ["embed", "--model", str(qwen3_hub), "--json", TEXTS[0], "-"],
                                input=TEXTS[1] + "\n")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["dimensions"] == 32 and len(out["tokens"]) == 2
    np.testing.assert_allclose(np.array(out["embeddings"]), expected, atol=TOL)

    result = CliRunner().invoke(main, ["embed", "--model", str(qwen3_hub), "--dimensions", "8", *TEXTS[:2]])
    assert result.exit_code == 0, result.output
    lines = np.array([[float(x) for x in line.split()] for line in result.stdout.strip().splitlines()])
    np.testing.assert_allclose(lines, st_encode(qwen3_hub, TEXTS[:2], truncate_dim=8, normalize_embeddings=True),
                               atol=TOL)

    for args, fact in ((["--dimensions", "64", "hi"], "dimensions must be <= 32"), ([""], "text is empty")):
        result = CliRunner().invoke(main, ["embed", "--model", str(qwen3_hub), *args])
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fact in lines[0], result.stderr


# --- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen3_hub):
    s = Server(["--model", str(qwen3_hub), "--api-key", KEY])
    yield s
    s.stop()


def test_server_openai_client_default_settings(server, qwen3_hub):
    """The client asks for base64 unless told otherwise and decodes it; float gives the same numbers."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    default = client.embeddings.create(model="qwen3-embedding", input=TEXTS)
    as_float = client.embeddings.create(model="qwen3-embedding", input=TEXTS, encoding_format="float")
    expected = st_encode(qwen3_hub, TEXTS)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))
    np.testing.assert_array_equal(np.array([d.embedding for d in default.data], dtype=np.float32),
                                  np.array([d.embedding for d in as_float.data], dtype=np.float32))
    np.testing.assert_allclose(np.array([d.embedding for d in default.data]), expected, atol=TOL)
    model, tokenizer = mlxinfer.load(qwen3_hub)
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens

    one = client.embeddings.create(model="m", input=TEXTS[2], dimensions=8, user="someone")
    np.testing.assert_allclose(one.data[0].embedding, st_encode(qwen3_hub, TEXTS[2:3], truncate_dim=8,
                                                                normalize_embeddings=True)[0], atol=TOL)
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model="m", input=ids)
    np.testing.assert_allclose(np.array([d.embedding for d in by_ids.data]), expected[:2], atol=TOL)
    single = client.embeddings.create(model="m", input=ids[0])
    np.testing.assert_allclose(single.data[0].embedding, expected[0], atol=TOL)


def test_server_raw_base64_is_little_endian_float32(server, qwen3_hub):
    status, body, _ = post(server.url, {"model": "m", "input": ["hello"], "encoding_format": "base64"},
                           path="/v1/embeddings")
    assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, st_encode(qwen3_hub, ["hello"])[0], atol=TOL)


@pytest.mark.parametrize("body, param, fact", [
    ({"model": "m", "input": ""}, "input", "input is empty"),
    ({"model": "m", "input": []}, "input", "no input"),
    ({"model": "m", "input": [[]]}, "input", "input is empty"),
    ({"model": "m", "input": ["a", ""]}, "input", "input[1] is empty"),
    ({"model": "m", "input": ["a"] * 2049}, "input", "at most 2048"),
    ({"model": "m", "input": "word " * 300}, "input", "context is 256"),
    ({"model": "m", "input": [[1, 2], [10**9]]}, "input", "input[1] holds 1000000000"),
    ({"model": "m", "input": ["a", 1]}, "input", "input must be a string, a list of strings"),
    ({"model": "m", "input": {"text": "a"}}, "input", "input must be"),
    ({"model": "m", "input": "a", "dimensions": 0}, "dimensions", "dimensions"),
    ({"model": "m", "input": "a", "dimensions": 33}, "dimensions", "dimensions must be <= 32"),
    ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"model": "m", "input": "a", "temperature": 1}, "temperature", "unknown parameter 'temperature'"),
    ({"model": "m"}, "input", "input"),
])
def test_server_bad_inputs_are_400_in_openai_shape(server, body, param, fact):
    import openai

    status, answer, _ = post(server.url, body, path="/v1/embeddings")
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and fact in error["message"], error
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    if "input" in body and param != "encoding_format" and "temperature" not in body:
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(**body)


def test_server_refuses_chat_on_a_headless_model(server):
    status, answer, _ = post(server.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 400 and "no LM head" in answer["error"]["message"], answer
