"""Scoring for evaluators: `/v1/completions` with several prompts, `echo` and `logprobs`, as
lm-evaluation-harness's `local-completions` sends them. The oracles: transformers' float32
log-softmax of its own logits for the same token ids on the same random-weight checkpoint, and
lm-evaluation-harness's `hf` backend running a multiple-choice task on the same weights.
All traffic goes to 127.0.0.1."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlxinfer
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.engine.pool import PromptCachePool
from serving import Server, post

pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "def add(a, b):\n    return a + b\n", "User: hello there!"]


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' model on the same checkpoint, in float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    return model


def log_softmax(reference, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: transformers' float32 log-softmax over the whole vocabulary at each position."""
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def prompt_scores(reference, ids: list[int]) -> np.ndarray:
    """The log-probability of each prompt token after the first, given the tokens before it."""
    rows = log_softmax(reference, ids)
    return np.array([rows[i - 1, ids[i]] for i in range(1, len(ids))])


def greedy_reply(reference, ids: list[int], count: int, eos: set[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (up to and with an end-of-sequence token) and each
    chosen token's log-probability."""
    ids, out, scores = list(ids), [], []
    for _ in range(count):
        row = log_softmax(reference, ids)[-1]
        token = int(row.argmax())
        out.append(token)
        scores.append(float(row[token]))
        ids.append(token)
        if token in eos:
            break
    return out, scores


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(["-m", str(tiny), "--dtype", "float32", "--max-concurrency", "4", "--max-queue", "4"])
    yield s
    s.stop()


def complete(server, **body) -> dict:
    status, answer, _ = post(server.url, {"model": "tiny", "temperature": 0, **body}, key=None, path="/v1/completions")
    assert status == 200, answer
    return answer


def check_prompt_part(choice: dict, tokenizer, reference, ids: list[int], top: int) -> None:
    """The prompt's part of an echoed choice: its text, tokens, offsets and logprobs (against transformers)."""
    lp = choice["logprobs"]
    n = len(ids)
    assert choice["text"].startswith(tokenizer.decode(ids))
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token follows nothing
    np.testing.assert_allclose(lp["token_logprobs"][1:n], prompt_scores(reference, ids), atol=TOLERANCE, rtol=0)
    rows = log_softmax(reference, ids)
    for i in range(1, n):
        best = np.argsort(-rows[i - 1])[:top]
        want: dict[str, list[float]] = {}  # keyed by text, as the legacy format is: tokens may share one
        for t in best:
            want.setdefault(tokenizer.decode([int(t)]), []).append(float(rows[i - 1, t]))
        assert lp["top_logprobs"][i].keys() == want.keys()
        for text, value in lp["top_logprobs"][i].items():
            assert min(abs(value - w) for w in want[text]) <= TOLERANCE
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))
    for i, token in enumerate(lp["tokens"][:n]):  # each token's text stands at its offset in the choice's text
        assert choice["text"][offsets[i] : offsets[i] + len(token)] == token
    assert len(offsets) == n or offsets[n] == len(tokenizer.decode(ids))  # the reply's first token follows the prompt


# --- the server against transformers ---

def test_several_token_prompts_scored_without_generating(server, tokenizer, reference):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    r = complete(server, prompt=prompts, echo=True, logprobs=3, max_tokens=0)
    assert [c["index"] for c in r["choices"]] == list(range(len(prompts)))
    for choice, ids in zip(r["choices"], prompts):
        assert choice["finish_reason"] == "length"
        assert choice["text"] == tokenizer.decode(ids)
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        check_prompt_part(choice, tokenizer, reference, ids, 3)
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts)) and r["usage"]["completion_tokens"] == 0
    # batch invariance: a prompt scored alone gets the very numbers it got beside the others
    alone = complete(server, prompt=prompts[1], echo=True, logprobs=3, max_tokens=0)
    assert alone["choices"][0]["logprobs"] == r["choices"][1]["logprobs"]


def test_echo_with_generation_scores_prompt_and_reply(server, tokenizer, reference):
    texts = TEXTS[:3]
    r = complete(server, prompt=texts, echo=True, logprobs=2, max_tokens=3)
    for choice, text in zip(r["choices"], texts):
        ids = tokenizer.encode(text)
        check_prompt_part(choice, tokenizer, reference, ids, 2)
        eos = set(tokenizer.eos_token_ids)
        reply, scores = greedy_reply(reference, ids, 3, eos)
        lp = choice["logprobs"]
        assert choice["text"] == text + tokenizer.decode([t for t in reply if t not in eos])  # EOS adds no text
        assert lp["tokens"][len(ids):] == [tokenizer.decode([t]) for t in reply]
        np.testing.assert_allclose(lp["token_logprobs"][len(ids):], scores, atol=TOLERANCE, rtol=0)


def test_echo_without_logprobs_and_plain_lists(server, tokenizer):
    r = complete(server, prompt=TEXTS[:2], echo=True, max_tokens=2)
    plain = complete(server, prompt=TEXTS[:2], max_tokens=2)
    for i, text in enumerate(TEXTS[:2]):
        assert r["choices"][i]["logprobs"] is None
        assert r["choices"][i]["text"] == text + plain["choices"][i]["text"]
        alone = complete(server, prompt=text, max_tokens=2)
        assert plain["choices"][i]["text"] == alone["choices"][0]["text"]
    one = complete(server, prompt=tokenizer.encode(TEXTS[0]), echo=True, max_tokens=0)  # a single list of ids
    assert [c["text"] for c in one["choices"]] == [TEXTS[0]]


def test_streamed_prompts_carry_their_index(server, tokenizer, reference):
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    status, whole, _ = post(server.url, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 4,
                                         "temperature": 0}, key=None, path="/v1/completions")
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    events = list(client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=1, max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    for e in events:
        for c in e.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert status == 200 and sorted(texts) == [0, 1, 2]
    for i, ids in enumerate(prompts):
        assert texts[i] == whole["choices"][i]["text"]
        assert logprobs[i] == whole["choices"][i]["logprobs"]["token_logprobs"]
        np.testing.assert_allclose(logprobs[i][1 : len(ids)], prompt_scores(reference, ids), atol=TOLERANCE, rtol=0)
    assert events[-1].usage.prompt_tokens == sum(map(len, prompts))


def test_scoring_never_takes_positions_from_the_prompt_cache(server, tokenizer, reference):
    ids = tokenizer.encode(TEXTS[3] + " Assistant: hi")
    complete(server, prompt=ids, max_tokens=4)  # leaves its K/V in the prompt-cache pool
    again = complete(server, prompt=ids, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the pool is in use
    r = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    np.testing.assert_allclose(r["choices"][0]["logprobs"]["token_logprobs"][1:], prompt_scores(reference, ids),
                               atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"best_of": 2}, "best_of", "best_of must equal n"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"prompt": [[1, 2]] * 9}, "prompt", "at most 8"),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt 1 is empty"),
    ({"prompt": []}, "prompt", "the prompt is empty"),
    ({"prompt": [[1, 2], [10**6]]}, None, "not a token id"),
])
def test_refusals_name_the_field(server, body, param, words):
    status, answer, _ = post(server.url, {"prompt": "hi", "max_tokens": 1, **body}, key=None, path="/v1/completions")
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"]
    health = server.wait_for(lambda h: h["active"] == h["queued"] == h["preparing"] == 0)
    assert health["active"] == health["queued"] == 0  # nothing was left running


def test_best_of_equal_to_n_is_accepted(server):
    assert complete(server, prompt="hi", max_tokens=1, best_of=1)["choices"][0]["finish_reason"]


# --- the engine (the Python API and the batch) against transformers ---

def test_stream_generate_scores_across_prefill_chunks(loaded, reference):
    model, tokenizer = loaded
    ids = tokenizer.encode(TEXTS[0] + " " + TEXTS[1])
    cache = PromptCache.for_model(model)
    list(mlxinfer.stream_generate(model, tokenizer, ids, prompt_cache=cache, max_tokens=2))  # the cache holds ids
    chunks = list(mlxinfer.stream_generate(model, tokenizer, ids, prompt_cache=cache, max_tokens=0, echo=True,
                                           prompt_logprobs=2, prefill_step=3))
    assert [c.finish_reason for c in chunks] == [None, "length"]
    assert chunks[0].stats.prefill_tokens == len(ids)  # scored whole, not from what the cache held
    prompt = chunks[0].prompt
    assert [p.id for p in prompt] == ids and "".join(p.text for p in prompt) == chunks[0].text == tokenizer.decode(ids)
    np.testing.assert_allclose([p.logprob for p in prompt[1:]], prompt_scores(reference, ids), atol=TOLERANCE, rtol=0)


def test_batch_scores_each_row_as_alone(loaded, reference):
    model, tokenizer = loaded
    prompts = [tokenizer.encode(t) for t in TEXTS]
    engine = BatchGenerator(model, tokenizer, max_batch=3, prefill_step=4, pool=PromptCachePool(1 << 26))
    engine.submit(prompts[0], max_tokens=3)  # a cached prefix of the same prompt must not be used for scoring
    list(engine.stream())
    uids = [engine.submit(p, max_tokens=2, echo=True, prompt_logprobs=1) if i % 2 == 0 else
            engine.submit(p, max_tokens=3) for i, p in enumerate(prompts)]
    chunks: dict[int, list] = {}
    for uid, chunk in engine.stream():
        chunks.setdefault(uid, []).append(chunk)
    for i in (0, 2):
        first = chunks[uids[i]][0]
        assert first.stats.prefill_tokens == len(prompts[i])
        np.testing.assert_allclose([p.logprob for p in first.prompt[1:]], prompt_scores(reference, prompts[i]),
                                   atol=TOLERANCE, rtol=0)
    assert all(c.prompt is None for i in (1, 3) for c in chunks[uids[i]])


def test_prompt_logprobs_need_echo(loaded):
    model, tokenizer = loaded
    with pytest.raises(InvalidOptionError, match="prompt_logprobs needs echo"):
        mlxinfer.generate(model, tokenizer, "hi", prompt_logprobs=1)


# --- lm-evaluation-harness: local-completions against us, hf on the same weights ---

DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog.", "capital of France.", "b"], "answer": 0},
    {"question": "Paris is the capital of", "choices": ["France.", "Germany.", "numbers"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "12345", "hello"], "answer": 0},
    {"question": "User: hello there! Assistant:", "choices": ["hi, how can I help you today?", "dog"], "answer": 0},
    {"question": "Numbers like", "choices": ["12345 and 3.14159", "the lazy dog"], "answer": 1},
]
TASK = """task: mlxinfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_equals_hf(tiny, server, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "mlxinfer_mc.yaml").write_text(TASK.format(data=data))
    manager = TaskManager(include_path=str(tmp_path))

    def run(backend: str, **model_args) -> list:
        out = lm_eval.simple_evaluate(model=backend, model_args=model_args, tasks=["mlxinfer_mc"], task_manager=manager,
                                      log_samples=True, device="cpu", bootstrap_iters=0)
        samples = sorted(out["samples"]["mlxinfer_mc"], key=lambda s: s["doc_id"])
        return [[resp[0] for resp in s["resps"]] for s in samples]

    ours = run("local-completions", base_url=f"{server.url}/v1/completions", model="tiny",
               tokenizer_backend="huggingface", tokenizer=str(tiny), max_retries=1, num_concurrent=1, batch_size=4)
    theirs = run("hf", pretrained=str(tiny), dtype="float32", batch_size=1)
    assert len(ours) == len(DOCS) and [len(r) for r in ours] == [len(d["choices"]) for d in DOCS]
    for mine, want in zip(ours, theirs):
        np.testing.assert_allclose([float(m[0]) for m in mine], [float(w[0]) for w in want], atol=1e-3, rtol=0)
        assert [bool(m[1]) for m in mine] == [bool(w[1]) for w in want]  # is_greedy, read from our top_logprobs
