"""GGUF files are untrusted: damaged headers and wrong-typed or impossible metadata are one
`MlxinferError` naming the file, never a traceback, a hang or a huge allocation. The inputs
are a small valid GGUF with its header bytes mutated, truncated, or one metadata value
replaced (rewritten with the `gguf` package's writer)."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_convert_gguf import matrices_as, write_gguf

from mlxinfer.convert import convert
from mlxinfer.base.errors import CorruptCheckpointError, MlxinferError

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def base(hf_checkpoint, tmp_path_factory) -> bytes:
    """A small valid Q8_0 GGUF (tiny Llama, 1 layer)."""
    file = tmp_path_factory.mktemp("fuzz") / "base.gguf"
    write_gguf(file, hf_checkpoint("llama", num_hidden_layers=1), matrices_as(Q.Q8_0))
    return file.read_bytes()


def header_end(data: bytes) -> int:
    """Where tensor data starts, by the `gguf` package's reader."""
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        return gguf.GGUFReader(f.name).data_offset


def converts_or_refuses(data: bytes) -> None:
    """Convert the bytes as a GGUF file: success or an MlxinferError, nothing else."""
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "m.gguf").write_bytes(data)
        try:
            convert(folder / "m.gguf", folder / "out", dtype="float32")
        except MlxinferError as e:
            assert "\n" not in str(e)
    finally:
        shutil.rmtree(folder)


@FUZZ
@given(st.data())
def test_mutated_header_bytes(base, data):
    end = header_end(base)
    flips = data.draw(
        st.lists(st.tuples(st.integers(0, end - 1), st.integers(0, 255)), min_size=1, max_size=4), label="flips"
    )
    mutated = bytearray(base)
    for pos, value in flips:
        mutated[pos] = value
    converts_or_refuses(bytes(mutated))


@FUZZ
@given(st.data())
def test_truncated_or_extended_counts(base, data):
    """Truncation anywhere, and the counts and lengths that size everything after them."""
    cut = data.draw(st.integers(0, len(base)), label="cut")
    converts_or_refuses(base[:cut])
    field = data.draw(st.sampled_from([8, 16]), label="count at")  # tensor count, metadata count
    value = data.draw(st.sampled_from([0, 1, 2**31, 2**40, 2**63, 2**64 - 1]), label="count")
    converts_or_refuses(base[:field] + struct.pack("<Q", value) + base[field + 8 :])


ODD_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=3),
    st.lists(st.text(max_size=4), min_size=1, max_size=3),
)


def value_type(value) -> tuple[V, V | None]:
    if isinstance(value, bool):
        return V.BOOL, None
    if isinstance(value, int):
        return V.INT64, None
    if isinstance(value, float):
        return V.FLOAT64, None
    if isinstance(value, str):
        return V.STRING, None
    item = V.STRING if value and isinstance(value[0], str) else V.INT32
    return V.ARRAY, item


def rewrite(base: bytes, key: str, value) -> bytes:
    """`base` with metadata `key` set to `value`, written by the `gguf` package."""
    with tempfile.TemporaryDirectory() as folder:
        src, dst = Path(folder) / "a.gguf", Path(folder) / "b.gguf"
        src.write_bytes(base)
        reader = gguf.GGUFReader(src)
        arch = reader.fields["general.architecture"].contents()
        w = gguf.GGUFWriter(dst, arch)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            if name == key:
                continue
            item = field.types[1] if field.types[0] == V.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], item)
        w.add_key_value(key, value, *value_type(value))
        for t in reader.tensors:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return dst.read_bytes()


KEYS = [
    "llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
    "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
    "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
    "llama.vocab_size", "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.attention.sliding_window",
    "general.alignment", "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
]


@FUZZ
@given(key=st.sampled_from(KEYS), value=ODD_VALUES)
def test_wrong_typed_metadata(base, key, value):
    converts_or_refuses(rewrite(base, key, value))


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("llama.block_count", "2", r"'llama.block_count' is '2', not a positive integer"),
        ("llama.attention.head_count", 0, r"'llama.attention.head_count' is 0, not a positive integer"),
        ("general.alignment", 0, r"'general.alignment' is 0, not a power of two"),
        ("general.alignment", 48, r"'general.alignment' is 48, not a power of two"),
        ("tokenizer.ggml.merges", ["ab"], r"'tokenizer.ggml.merges' is \['ab'\], not a list of 'left right' pairs"),
        ("tokenizer.ggml.eos_token_id", "2", r"'tokenizer.ggml.eos_token_id' is '2', not a token id"),
    ],
)
def test_impossible_metadata_is_one_line_naming_file_and_field(base, tmp_path, key, value, message):
    (tmp_path / "m.gguf").write_bytes(rewrite(base, key, value))
    with pytest.raises(CorruptCheckpointError, match=rf"m\.gguf.*{message}") as e:
        convert(tmp_path / "m.gguf", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_special_ids_beyond_the_vocabulary_are_ignored_like_llama_cpp(base, tmp_path):
    """llama.cpp warns and ignores a special token id past the vocabulary (-1 often means none)."""
    (tmp_path / "m.gguf").write_bytes(rewrite(base, "tokenizer.ggml.bos_token_id", -1))
    convert(tmp_path / "m.gguf", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()).get("bos_token_id") is None


def test_impossible_header_is_one_line(base, tmp_path):
    cases = {
        "the tensor count": base[:8] + struct.pack("<Q", 2**60) + base[16:],
        "the metadata count": base[:16] + struct.pack("<Q", 2**60) + base[24:],
        "truncated": base[: header_end(base) + 10],
    }
    for expected, data in cases.items():
        (tmp_path / "m.gguf").write_bytes(data)
        with pytest.raises(CorruptCheckpointError, match=rf"m\.gguf .*{expected}"):
            convert(tmp_path / "m.gguf", tmp_path / "out")
