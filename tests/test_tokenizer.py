"""Tokenizer parity with transformers' AutoTokenizer (the oracle) on real tokenizer folders.

The tokenizers come from package registries (`conftest.real_tokenizer`); each is loaded once per
module by both mlxinfer and transformers, because the large vocabularies take a second or two to parse.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from conftest import REAL_TOKENIZERS, real_tokenizer
from mlxinfer.base.errors import ConfigError, ModelNotFoundError, TokenizerError
from mlxinfer.text.tokenizer import Tokenizer, load_tokenizer_from_dir

NAMES = REAL_TOKENIZERS
TEMPLATED = [name for name in NAMES if name != "llama2"]  # Llama 2's base tokenizer has no chat template

CORPUS = [
    "",
    " ",
    "Hello world",
    "Hello, world! How's it going? IT'S fine, they'll see.",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple    inner     spaces",
    "line one\nline two\n\n\nthree\r\nwindows\ttab\t\tend\n",
    "\n\nleading newlines",
    "Numbers: 0 7 42 123 1234 12345678901234567890 3.14159 -2.5e-10 1,000,000 2024-01-31",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # recursion\n",
    "for (int i = 0; i < n; ++i) { x[i] = (y[i] >> 2) & 0xFF; }",
    '{"key": [1, 2, {"nested": null}], "url": "https://example.com/a?b=c&d=e"}',
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "combining: e\u0301 a\u0300 n\u0303 vs é à ñ; Zalgo: Z\u0351\u0300a\u0352l\u0353g\u0354o",
    "Arabic: مرحبا بالعالم; Hebrew: שלום; Hindi: नमस्ते; Thai: สวัสดี",
    "odd chars: \u200b zero width, \u00a0 nbsp, \u2581 lower-one-eighth block, ǅ titlecase, \x7f del",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] question [/INST] answer</s>",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<eos>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|endoftext|> <unk> <pad> <mask> text after specials",
    "(parenthesised) [bracketed] 'quoted' \"double\" --dashes-- ...ellipsis... ~tilde~",
    "Ünïcödé Çàsès ÅÆØ ß ﬁ ligature ＦＵＬＬＷＩＤＴＨ",
]

SINGLE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
MULTI = [
    {"role": "user", "content": "Hi! 日本語 is fine too."},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Count to three."},
]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}, *MULTI]
CONVERSATIONS = {"single": SINGLE, "multi": MULTI, "multi_with_system": WITH_SYSTEM}

Pair = tuple[Tokenizer, Any]


def one_line(exc: pytest.ExceptionInfo) -> str:
    """The error's message, asserting it is the single line users are promised."""
    message = str(exc.value)
    assert message and "\n" not in message
    return message


def hf_load(folder: Path) -> Any:
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # the oracle itself failing is a reason to skip, not a failure of ours
        pytest.skip(f"transformers cannot load {folder.name}: {exc}")


@pytest.fixture(scope="module")
def pair() -> Callable[[str], Pair]:
    """`pair(name)` -> (ours, transformers') for a fixture, loaded once per module."""
    cache: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in cache:
            folder = real_tokenizer(name)
            cache[name] = (load_tokenizer_from_dir(folder), hf_load(folder))
        return cache[name]

    return get


def variant(tmp_path: Path, name: str, config_changes: dict[str, Any] | None = None, **files: Any) -> Path:
    """A copy of fixture `name` with its config edited and extra files (a copy: a link out of
    the folder is refused).

    `files` maps file names (dots as `__`) to JSON-able content or text.
    """
    folder = tmp_path / f"{name}-variant"
    folder.mkdir()
    for src in real_tokenizer(name).iterdir():
        shutil.copy(src, folder / src.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(config_changes or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for key, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / key.replace("__", ".")).write_text(text)
    return folder


def encode_mismatches(ours: Tokenizer, hf: Any, texts: list[str]) -> list[str]:
    return [
        text
        for text in texts
        for special in (True, False)
        if ours.encode(text, add_special_tokens=special) != hf(text, add_special_tokens=special)["input_ids"]
    ]


def render(tok: Any, messages: list[dict], **kwargs: Any) -> tuple[str, str]:
    """("ok", text) or ("error", message) so ours and the oracle's outcomes compare directly."""
    try:
        if isinstance(tok, Tokenizer):
            return "ok", tok.apply_chat_template(messages, **kwargs)
        return "ok", tok.apply_chat_template(messages, tokenize=False, **kwargs)
    except (TokenizerError, jinja2.TemplateError) as exc:
        return "error", str(exc)


def assert_same_rendering(
    ours: Tokenizer, hf: Any, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
) -> None:
    """Same text, or both fail with the template's message (the defaults differ, so always pass the flag)."""
    kwargs["add_generation_prompt"] = add_generation_prompt
    mine, theirs = render(ours, messages, **kwargs), render(hf, messages, **kwargs)
    if theirs[0] == "error":
        assert mine[0] == "error" and theirs[1] in mine[1] and "\n" not in mine[1]
    else:
        assert mine == theirs


# --- parity on every fixture --------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_transformers(pair, name):
    ours, hf = pair(name)
    assert encode_mismatches(ours, hf, CORPUS) == []


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_transformers_on_random_text(pair, name, text):
    ours, hf = pair(name)
    assert encode_mismatches(ours, hf, [text]) == []


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers(pair, name):
    ours, hf = pair(name)
    sweep = list(range(0, len(hf), max(1, len(hf) // 500))) + sorted(ours.special_ids)
    sequences = [hf(text)["input_ids"] for text in CORPUS] + [sweep]
    for ids in sequences:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_match_transformers(pair, name):
    ours, hf = pair(name)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token, ours.bos_token_id) == (hf.bos_token, hf.bos_token_id)
    assert ours.eos_token == hf.eos_token
    assert ours.eos_token_ids == [hf.eos_token_id]  # no generation_config.json in the fixtures
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert set(hf.all_special_ids) <= ours.special_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATED)
def test_chat_template_matches_transformers(pair, name, conversation, add_generation_prompt):
    ours, hf = pair(name)
    assert ours.chat_template == hf.chat_template
    assert_same_rendering(ours, hf, CONVERSATIONS[conversation], add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_extra_template_kwargs(pair, add_generation_prompt):
    ours, hf = pair("qwen3")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Météo d'une ville",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, {"tools": tools}):
        assert_same_rendering(ours, hf, WITH_SYSTEM, add_generation_prompt=add_generation_prompt, **kwargs)


def test_reasoning_field_aliases_match_transformers(pair):
    ours, hf = pair("qwen3")
    for key in ("reasoning", "thinking", "reasoning_content"):
        messages = [*MULTI, {"role": "assistant", "content": "1, 2, 3.", key: "Easy: count up."}]
        assert_same_rendering(ours, hf, messages, add_generation_prompt=False)
        assert "Easy: count up." in ours.apply_chat_template(messages, add_generation_prompt=False)


@pytest.mark.parametrize("name", ["qwen3", "llama3.1", "smollm2"])
def test_tokenized_chat_matches_transformers(pair, name):
    ours, hf = pair(name)
    expected = hf.apply_chat_template(WITH_SYSTEM, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if "input_ids" in expected else expected
    assert ours.apply_chat_template(WITH_SYSTEM, tokenize=True) == expected


# --- which pipeline transformers builds ---------------------------------------------------------

# Each case makes AutoTokenizer pick a different pipeline than the fixture alone would.
PIPELINE_CASES = {
    # model_type registered to the plain backend: the legacy tokenizer.json runs verbatim
    "mistral-model-type": ("mistral-v0.1", {}, {"model_type": "mistral"}),
    "phi3-model-type": ("llama2", {}, {"model_type": "phi3"}),
    # Llama class over a byte-level file (Llama 3 style): file used as-is
    "llama-class-byte-level": ("smollm2", {"tokenizer_class": "LlamaTokenizerFast"}, None),
    # qwen2's registered class beats the hub's; a GPT-2 vocabulary gets the Qwen2 pipeline
    "qwen2-beats-hub-class": ("smollm2", {"tokenizer_class": "PreTrainedTokenizerFast"}, {"model_type": "qwen2"}),
    # Llama pipeline, with and without `legacy` / prefix space
    "llama-not-legacy": ("llama2", {"legacy": False}, None),
    "llama-no-prefix-space": ("mistral-v0.1", {"add_prefix_space": False}, None),
    # no tokenizer_class: config.json's model_type decides, and without one the file runs as-is
    "qwen2-from-model-type": ("smollm2", {"tokenizer_class": None}, {"model_type": "qwen3"}),
    "no-class-no-model-type": ("llama2", {"tokenizer_class": None}, None),
    # special-token text encoded as plain text
    "split-special-tokens": ("smollm2", {"split_special_tokens": True}, None),
}


@pytest.mark.parametrize("case", sorted(PIPELINE_CASES))
def test_pipeline_choice_matches_transformers(tmp_path, case):
    name, config_changes, model_config = PIPELINE_CASES[case]
    files = {} if model_config is None else {"config__json": model_config}
    folder = variant(tmp_path, name, config_changes, **files)
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    assert encode_mismatches(ours, hf, CORPUS) == []
    ids = [i for text in CORPUS for i in hf(text)["input_ids"]]
    assert ours.decode(ids) == hf.decode(ids)


def test_model_type_table_matches_transformers():
    from transformers.models.auto import tokenization_auto as auto

    from mlxinfer.text import tokenizer as module

    backend = {"TokenizersBackend", "MistralCommonBackend"}  # the latter only with mistral-common installed
    for model_type, class_name in module._CLASS_BY_MODEL_TYPE.items():
        expected = backend if class_name == "TokenizersBackend" else {class_name}
        assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) in expected, model_type
    assert module._MODEL_TYPE_BEATS_HUB_CLASS <= auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_add_bos_token_in_config_is_ignored_like_transformers(tmp_path, add_bos_token):
    # transformers 5 lets tokenizer.json's post-processor alone decide BOS/EOS
    folder = variant(tmp_path, "llama2", {"add_bos_token": add_bos_token, "add_eos_token": True})
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    assert ours.encode("hello") == hf("hello")["input_ids"] == [1, *ours.encode("hello", add_special_tokens=False)]


def test_clean_up_tokenization_spaces_for_word_level_models(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    words = ["[UNK]", "hello", ",", "world", ".", "isn", "'", "t", "it", "?"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True, "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = load_tokenizer_from_dir(tmp_path), hf_load(tmp_path)
    ids = ours.encode("hello, world. isn't it?")
    assert ids == hf("hello, world. isn't it?")["input_ids"]
    assert ours.decode(ids) == hf.decode(ids) == "hello, world. isn't it?"


# --- config files around tokenizer.json ---------------------------------------------------------


def test_eos_token_ids_include_generation_config_list(tmp_path):
    folder = variant(tmp_path, "smollm2", generation_config__json={"eos_token_id": [2, 0, 2]})
    tok = load_tokenizer_from_dir(folder)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == [2, 0]


def test_eos_token_ids_accept_a_single_generation_config_id(tmp_path):
    folder = variant(tmp_path, "smollm2", generation_config__json={"eos_token_id": 0})
    assert load_tokenizer_from_dir(folder).eos_token_ids == [2, 0]


def test_eos_token_id_of_wrong_type_is_a_config_error(tmp_path):
    folder = variant(tmp_path, "smollm2", generation_config__json={"eos_token_id": "2"})
    with pytest.raises(ConfigError) as exc:
        load_tokenizer_from_dir(folder)
    assert "eos_token_id" in one_line(exc)


def test_special_tokens_map_and_dict_tokens(tmp_path):
    # configs saved without added_tokens_decoder take named tokens from special_tokens_map.json
    folder = variant(
        tmp_path,
        "llama2",
        {"eos_token": {"content": "</s>", "lstrip": False, "__type": "AddedToken"}},
        special_tokens_map__json={"pad_token": {"content": "<unk>", "special": True}},
    )
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    assert (ours.eos_token, ours.eos_token_ids) == ("</s>", [2])
    assert ours.pad_token_id == hf.pad_token_id == 0


def test_chat_template_jinja_file_takes_precedence(tmp_path, pair):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ '>' if add_generation_prompt }}"
    folder = variant(tmp_path, "smollm2", chat_template__jinja=template)
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    assert ours.chat_template == template
    assert_same_rendering(ours, hf, MULTI, add_generation_prompt=True)


def test_chat_template_jinja_file_with_windows_line_ends_reads_as_transformers_does(tmp_path):
    folder = variant(tmp_path, "smollm2")
    (folder / "chat_template.jinja").write_bytes(b"{% for m in messages %}{{ m.content }}\r\n{% endfor %}\r>")
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    assert ours.chat_template == hf.chat_template
    assert_same_rendering(ours, hf, MULTI, add_generation_prompt=True)


def test_chat_template_json_file_is_read(tmp_path):
    folder = variant(tmp_path, "smollm2", chat_template__json={"chat_template": "{{ messages[0].content }}!"})
    assert load_tokenizer_from_dir(folder).apply_chat_template(SINGLE) == SINGLE[0]["content"] + "!"


def test_named_chat_templates_pick_default(tmp_path):
    templates = [
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
        {"name": "default", "template": "default: {{ messages | length }}"},
    ]
    folder = variant(tmp_path, "smollm2", {"chat_template": templates})
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    assert ours.chat_template == "default: {{ messages | length }}"
    assert_same_rendering(ours, hf, MULTI)


HELPER_TEMPLATE = """\
{% for m in messages %}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% continue %}{% endif %}
{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}|{{ m | tojson(separators=(',', ':')) }}
{% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{{ bos_token }}{{ eos_token }}{{ unk_token }}{{ pad_token }}{{ tools }}{{ documents }}{{ custom | default('') }}"""


def test_template_helpers_match_transformers(tmp_path):
    folder = variant(tmp_path, "smollm2", chat_template__jinja=HELPER_TEMPLATE)
    ours, hf = load_tokenizer_from_dir(folder), hf_load(folder)
    messages = [*MULTI, {"role": "user", "content": "<tag> & \"quotes\" é"}]
    assert_same_rendering(ours, hf, messages)
    assert_same_rendering(ours, hf, messages, custom="extra", eos_token="<override>")


def test_strftime_now(tmp_path):
    folder = variant(tmp_path, "smollm2", chat_template__jinja="{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = load_tokenizer_from_dir(folder).apply_chat_template(SINGLE)
    assert rendered in {before, datetime.now().strftime("%Y-%m-%d")}


# --- errors -------------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError) as exc:
        load_tokenizer_from_dir(tmp_path / "nope")
    message = one_line(exc)
    assert str(tmp_path / "nope") in message and "does not exist" in message


def test_file_instead_of_folder(tmp_path):
    (tmp_path / "model.bin").write_text("x")
    with pytest.raises(ModelNotFoundError) as exc:
        load_tokenizer_from_dir(tmp_path / "model.bin")
    assert "not a folder" in one_line(exc)


def test_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError) as exc:
        load_tokenizer_from_dir(tmp_path)
    message = one_line(exc)
    assert str(tmp_path / "tokenizer.json") in message and "not found" in message


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": ', '{"model": {"type": "Nope"}}', "\x00\xff"])
def test_corrupt_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError) as exc:
        load_tokenizer_from_dir(tmp_path)
    message = one_line(exc)
    assert "tokenizer.json" in message and "not a valid tokenizer file" in message


def test_corrupt_tokenizer_config(tmp_path):
    folder = variant(tmp_path, "smollm2")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError) as exc:
        load_tokenizer_from_dir(folder)
    assert "tokenizer_config.json" in one_line(exc)


def test_template_raise_exception(pair):
    ours, hf = pair("mistral-v0.1")
    with pytest.raises(TokenizerError) as exc:
        ours.apply_chat_template(WITH_SYSTEM)
    message = one_line(exc)
    assert "chat template rejected" in message and "Conversation roles must alternate" in message


def test_model_without_chat_template(pair):
    ours, _ = pair("llama2")
    assert ours.chat_template is None
    with pytest.raises(TokenizerError) as exc:
        ours.apply_chat_template(SINGLE)
    message = one_line(exc)
    assert "no chat template" in message and "raw prompt" in message


@pytest.mark.parametrize(
    ("template", "fact"),
    [
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("{{ messages[0].content.nope.deeper }}", "failed to render"),
    ],
)
def test_broken_template(tmp_path, template, fact):
    folder = variant(tmp_path, "smollm2", chat_template__jinja=template)
    with pytest.raises(TokenizerError) as exc:
        load_tokenizer_from_dir(folder).apply_chat_template(SINGLE)
    assert fact in one_line(exc)


def test_sandbox_blocks_unsafe_attributes(tmp_path):
    folder = variant(tmp_path, "smollm2", chat_template__jinja="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError) as exc:
        load_tokenizer_from_dir(folder).apply_chat_template(SINGLE)
    assert "failed to render" in one_line(exc)
