"""n choices of one prompt, and Predicted Outputs.

n: the batch engine runs a request's n choices as n sequences that prefill the prompt once;
choice i with seed s draws with the documented seed (s + i * 0x9E3779B97F4A7C15) mod 2^64,
so each choice equals a lone `stream_generate` run with that seed (choice 0: s itself), and
greedy choices equal transformers' greedy `generate` on the same float32 checkpoint.

Predictions: the prediction is the speculative draft, so greedy output is transformers'
greedy output with or without one, and sampled tokens follow the model's own distribution
(chi-square against numpy, as tests/test_speculative.py does for the other drafters).

The server: the official `openai` client with `n=3` (chat and text, streamed and not) and
`prediction=`, checked against in-process runs; a bad `n` is a 400 naming it.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

import mlxinfer
from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.decode.sample import SamplingConfig
from mlxinfer.decode.speculative import PredictedOutput
from serving import KEY, Server
from test_sample import np_filtered
from test_speculative import chi2_p, joint_counts

HERE = Path(__file__).parent
# The rule the README documents for choice i of a request with seed s.
STEP = 0x9E3779B97F4A7C15
SAMPLED = dict(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True)
PROMPT = "the quick brown fox jumps over the lazy dog"
# Words the tiny tokenizer holds as single tokens; biasing the model towards them makes its
# greedy text re-tokenize to the very tokens it generated (random weights otherwise emit
# byte fragments, whose text tokenizes differently), so its own output is a usable prediction.
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "capital", "of")


def seed_of(seed: int, index: int) -> int:
    return (seed + index * STEP) % 2**64


def tokens_of(chunks) -> list[int]:
    return [c.token for c in chunks if c.token is not None]


def lone(loaded, prompt, **options) -> list:
    model, tok = loaded
    return list(mlxinfer.stream_generate(model, tok, prompt, **options))


def drain(engine: BatchGenerator, limit: int = 2000) -> list:
    """Every (uid, chunk) until the engine is idle; a bounded loop, so a choice left waiting fails."""
    produced = []
    for _ in range(limit):
        if not engine.active:
            return produced
        produced += engine.step()
    pytest.fail(f"the engine still has {engine.active} sequences after {limit} steps")


def run_choices(engine: BatchGenerator, prompt, **options) -> list[list]:
    """Every chunk of one request's choices, by choice."""
    uids = engine.enqueue_choices(engine.prepare(engine.request(prompt, **options)))
    streams = defaultdict(list)
    for uid, chunk in drain(engine):
        streams[uid].append(chunk)
    return [streams[u] for u in uids]


@pytest.fixture(scope="module")
def torch_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def hf_greedy(torch_model, ids: list[int], new: int, bias: dict[int, float] | None = None) -> list[int]:
    """transformers' greedy continuation (EOS not stopping it), with additive logit biases."""
    extra = {"sequence_bias": [[[t], b] for t, b in bias.items()]} if bias else {}
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new, min_new_tokens=0,
                                   eos_token_id=None, pad_token_id=0, **extra)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def word_bias(loaded) -> dict[int, float]:
    tok = loaded[1]
    ids = {w: tok.encode(f" {w}", add_special_tokens=False) for w in WORDS}
    assert all(len(v) == 1 for v in ids.values()), ids
    return {v[0]: 100.0 for v in ids.values()}


# --- n choices in the engine ---

def test_choices_equal_lone_runs_with_their_seeds_and_prefill_once(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    choices = run_choices(engine, PROMPT, n=3, seed=5, logprobs=2, **SAMPLED)
    n_prompt = len(tok.encode(PROMPT))
    for i, got in enumerate(choices):
        want = lone(loaded, PROMPT, seed=seed_of(5, i), logprobs=2, **SAMPLED)
        assert tokens_of(got) == tokens_of(want), f"choice {i}"
        assert [c.logprob for c in got] == pytest.approx([c.logprob for c in want], abs=1e-4)
        assert "".join(c.text for c in got) == "".join(c.text for c in want)
        assert {c.index for c in got} == {i}
    assert tokens_of(choices[0]) == tokens_of(lone(loaded, PROMPT, seed=5, **SAMPLED)), "choice 0 is n=1"
    assert len({tuple(tokens_of(c)) for c in choices}) == 3, "the choices drew alike"
    assert engine.stats.prefilled_tokens == n_prompt - 1, "the prompt was prefilled more than once"
    assert [c[-1].stats.prefill_tokens for c in choices] == [n_prompt, 1, 1]
    assert engine.stats.max_batch_seen == 3


def test_greedy_choices_equal_transformers(loaded, torch_model):
    model, tok = loaded
    ids = tok.encode(PROMPT)
    engine = BatchGenerator(model, tok)
    choices = run_choices(engine, ids, n=3, max_tokens=10, ignore_eos=True)
    want = hf_greedy(torch_model, ids, 10)
    assert [tokens_of(c) for c in choices] == [want] * 3


def test_more_choices_than_slots_and_a_cancelled_runner(loaded):
    """One slot for three choices, the prompt prefilled 4 tokens a step: the first choice is
    cancelled while its prompt goes in, the next one admitted prefills it instead, and the
    third starts from its copy once that one has finished; the survivors equal their lone runs."""
    model, tok = loaded
    long_prompt = " ".join([PROMPT] * 3)
    engine = BatchGenerator(model, tok, max_batch=1, prefill_step=4)
    options = dict(n=3, seed=9, **SAMPLED)
    uids = engine.enqueue_choices(engine.prepare(engine.request(long_prompt, **options)))
    produced = engine.step()
    assert not produced and engine.stats.prefilled_tokens == 4, "the first choice did not start prefilling"
    engine.cancel(uids[0])
    streams = defaultdict(list)
    for uid, chunk in [*produced, *drain(engine)]:
        streams[uid].append(chunk)
    assert [c.finish_reason for c in streams[uids[0]]] == ["cancelled"]
    for i in (1, 2):
        want = lone(loaded, long_prompt, seed=seed_of(9, i), prefill_step=4, **SAMPLED)
        assert tokens_of(streams[uids[i]]) == tokens_of(want), f"choice {i}"
    n_prompt = len(tok.encode(long_prompt))
    assert engine.stats.prefilled_tokens == 4 + (n_prompt - 1), "choice 2 prefilled the prompt again"
    assert engine.stats.max_batch_seen == 1


def test_choices_do_not_keep_other_requests_out(loaded):
    """Fair admission: a request of 8 choices holds every slot of a 4-slot engine; a request that
    comes next gets a slot within a step or two (a choice gives its slot up, its cache kept, and
    resumes when a slot is free), well before any choice ends. Slots then even out between two
    requests of many choices, and every paused choice still equals its lone run."""
    model, tok = loaded
    engine = BatchGenerator(model, tok, max_batch=4)
    options = dict(SAMPLED, max_tokens=40)
    many = engine.enqueue_choices(engine.prepare(engine.request(PROMPT, n=8, seed=3, **options)))
    produced = []
    while sum(c.token is not None for _, c in produced[-4:]) < 4:  # every slot decoding
        produced += engine.step()
    other = engine.enqueue_choices(engine.prepare(engine.request("hello there", seed=4, **options)))[0]
    for steps in range(1, 4):
        step = engine.step()
        produced += step
        if any(uid == other and c.token is not None for uid, c in step):
            break
    else:
        pytest.fail("the request behind 8 choices got no token in 3 steps")
    assert not any(c.finish_reason for _, c in produced), "a choice ended before the other request started"
    third = engine.enqueue_choices(engine.prepare(engine.request("the lazy dog", n=4, seed=5, **options)))
    held = []
    for _ in range(12):
        produced += engine.step()
        running = {s.uid for s in (*engine._prefilling, *engine._decoding)}
        held.append((len(running & set(many)), len(running & set(third))))
    assert held[-1] == (2, 1) or held[-1] == (1, 2), f"the slots did not even out: {held}"
    produced += drain(engine)
    streams = defaultdict(list)
    for uid, chunk in produced:
        streams[uid].append(chunk)
    for i, uid in enumerate(many):
        assert tokens_of(streams[uid]) == tokens_of(lone(loaded, PROMPT, seed=seed_of(3, i), **options)), f"choice {i}"
    assert tokens_of(streams[other]) == tokens_of(lone(loaded, "hello there", seed=4, **options))
    for i, uid in enumerate(third):
        assert tokens_of(streams[uid]) == tokens_of(lone(loaded, "the lazy dog", seed=seed_of(5, i), **options))


def test_choices_of_a_scored_prompt_each_echo_its_scores(loaded):
    """Echo with prompt logprobs: the prompt is scored once, and every choice's first chunk is
    the prompt with the scores a lone run gives."""
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    choices = run_choices(engine, PROMPT, n=3, seed=2, echo=True, prompt_logprobs=2, **SAMPLED)
    want = lone(loaded, PROMPT, seed=2, echo=True, prompt_logprobs=2, **SAMPLED)[0].prompt
    for got in choices:
        prompt = got[0].prompt
        assert [t.id for t in prompt] == [t.id for t in want]
        assert [t.logprob for t in prompt[1:]] == pytest.approx([t.logprob for t in want[1:]], abs=1e-5)
        for mine, theirs in zip(prompt[1:], want[1:]):
            assert [t for t, _ in mine.top_logprobs] == [t for t, _ in theirs.top_logprobs]
            assert [lp for _, lp in mine.top_logprobs] == pytest.approx([lp for _, lp in theirs.top_logprobs], abs=1e-5)
    assert engine.stats.prefilled_tokens == len(tok.encode(PROMPT)) - 1


def test_choices_each_hold_their_own_format(loaded):
    regex = {"type": "regex", "pattern": "(yes|no), [a-z]{2,6}!"}
    engine = BatchGenerator(loaded[0], loaded[1])
    choices = run_choices(engine, PROMPT, n=2, seed=3, temperature=1.0, max_tokens=20, response_format=regex)
    for i, got in enumerate(choices):
        want = lone(loaded, PROMPT, seed=seed_of(3, i), temperature=1.0, max_tokens=20, response_format=regex)
        assert "".join(c.text for c in got) == "".join(c.text for c in want)


def test_n_is_bounded_and_one_completion_paths_refuse_it(loaded):
    model, tok = loaded
    engine = BatchGenerator(model, tok)
    for bad in (0, 17, 2.0):
        with pytest.raises(InvalidOptionError, match="n must be"):
            engine.request(PROMPT, n=bad)
    with pytest.raises(InvalidOptionError, match="enqueue_choices"):
        engine.submit(PROMPT, n=2)
    with pytest.raises(InvalidOptionError, match="enqueue_choices"):
        lone(loaded, PROMPT, n=2)
    assert not engine.active


# --- Predicted Outputs ---

def test_prediction_proposals():
    """What the drafter proposes, worked out by hand: the prediction's start, then what follows
    the reply's tail; after an edit the reply is found again just ahead, a short match far
    away is no evidence, and a full 4-token match is, wherever it is."""
    prompt = [1, 2, 3]
    predicted = [10, 11, 12, 13, 14, 15, 16, 17] + [0] * 40 + [42, 20, 21, 22, 23, 24]
    d = PredictedOutput(predicted, len(prompt))
    assert d.propose(prompt, 4)[0] == [10, 11, 12, 13]
    assert d.propose(prompt + [10, 11], 3)[0] == [12, 13, 14]
    assert d.propose(prompt + [10, 11, 99, 13], 3)[0] == [14, 15, 16]  # 12 became 99: rejoined at 13
    assert d.propose(prompt + [10, 11, 99, 13, 14, 42], 3)[0] == []  # 42 occurs only 40 tokens on
    assert d.propose(prompt + [10, 11, 99, 13, 14, 20, 21, 22, 23], 3)[0] == [24]  # a block was skipped


def test_greedy_output_is_the_same_with_any_prediction(loaded, torch_model):
    model, tok = loaded
    ids = tok.encode(PROMPT)
    want = hf_greedy(torch_model, ids, 24)
    right = tok.decode(want)
    for prediction in ("", right, right[: len(right) // 2] + " fox lazy " + right[len(right) // 2 :],
                       "def main():\n    return 0\n"):
        chunks = lone(loaded, ids, max_tokens=24, ignore_eos=True, prediction=prediction)
        assert tokens_of(chunks) == want, prediction


def test_a_right_prediction_is_mostly_accepted(loaded, torch_model, word_bias, monkeypatch):
    """The greedy output itself as the prediction (with the chooser pinned to drafting, which
    otherwise follows measured speeds): the same tokens, most of them accepted drafts; an
    edited prediction (two words changed) still gives the same tokens, with some rejected."""
    from mlxinfer.decode.speculative import ModeChooser

    monkeypatch.setattr(ModeChooser, "next_phase", lambda self: ("speculate", 16))
    model, tok = loaded
    ids = tok.encode(PROMPT)
    plain = lone(loaded, ids, max_tokens=60, ignore_eos=True, logit_bias=word_bias)
    assert tokens_of(plain) == hf_greedy(torch_model, ids, 60, word_bias)
    text = "".join(c.text for c in plain)
    assert tok.encode(text, add_special_tokens=False) == tokens_of(plain)
    right = lone(loaded, ids, max_tokens=60, ignore_eos=True, logit_bias=word_bias, prediction=text)
    assert tokens_of(right) == tokens_of(plain)
    s = right[-1].stats
    assert s.accepted >= 0.75 * 60 and sum(c.drafted for c in right) == s.accepted, s
    words = text.split(" ")
    words[5], words[20] = "capital", "of"
    edited = lone(loaded, ids, max_tokens=60, ignore_eos=True, logit_bias=word_bias, prediction=" ".join(words))
    assert tokens_of(edited) == tokens_of(plain)
    assert edited[-1].stats.accepted >= 0.5 * 60 and edited[-1].stats.drafted > edited[-1].stats.accepted


def test_a_prediction_in_the_engine_drafts_while_alone(loaded, torch_model, word_bias):
    model, tok = loaded
    ids = tok.encode(PROMPT)
    want = hf_greedy(torch_model, ids, 40, word_bias)
    engine = BatchGenerator(model, tok)
    (got,) = run_choices(engine, ids, max_tokens=40, ignore_eos=True, logit_bias=word_bias,
                         prediction=tok.decode(want))
    assert tokens_of(got) == want
    assert got[-1].stats.drafted > 0


def test_sampled_tokens_with_a_prediction_follow_the_model(hf_checkpoint):
    """On a 12-token vocabulary: the joint law of the first two tokens, drafted from a
    prediction, equals the model's filtered distribution computed in numpy from its logits."""
    V = 12
    model, tok = mlxinfer.load(hf_checkpoint("llama", vocab_size=V, head_dim=32), dtype="float32")
    predicted = [5, 7, 3, 9]
    prediction = tok.decode(predicted)
    assert tok.encode(prediction, add_special_tokens=False) == predicted
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    cfg = SamplingConfig(temperature=1.0, top_p=0.95)
    p1 = np_filtered(np.array(model(mx.array([prompt]))[0, -1:]), cfg)[0]
    nxt = np.array(model(mx.array([prompt + [t] for t in range(V)]))[:, -1])
    p2 = np.stack([np_filtered(nxt[t : t + 1], cfg)[0] for t in range(V)])
    samples, drafted = [], 0
    for seed in range(800):
        chunks = list(mlxinfer.stream_generate(model, tok, prompt, max_tokens=2, ignore_eos=True, temperature=1.0,
                                               top_p=0.95, seed=seed, num_draft_tokens=2, prediction=prediction))
        samples.append((chunks[0].token, chunks[1].token))
        drafted += chunks[-1].stats.drafted
    assert drafted > 0
    assert chi2_p(joint_counts(samples, V), (p1[:, None] * p2).ravel()) > 1e-3


# --- the server, through the official client ---

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny):
    """Four slots and two queue places (six places), 20 ms per step so a stream can be left mid-way
    (tests/fault_server.py, run with this checkout's mlxinfer first on its path)."""
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    s = Server(["-m", str(tiny), "--dtype", "float32", "--api-key", KEY, "--max-concurrency", "4",
                "--max-queue", "2"], env={"MLXINFER_TEST_STEP_DELAY": "0.02", "PYTHONPATH": path},
               script=[sys.executable, str(HERE / "fault_server.py")])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


USER = [{"role": "user", "content": "name three animals"}]
OPTIONS = dict(temperature=0.9, top_p=0.95, seed=11, max_tokens=10)


def test_chat_n_choices_equal_lone_runs(client, loaded):
    r = client.chat.completions.create(model="tiny", messages=USER, n=3, **OPTIONS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    wants = [lone(loaded, USER, **{**OPTIONS, "seed": seed_of(11, i)}) for i in range(3)]
    assert [c.message.content for c in r.choices] == ["".join(c.text for c in w) for w in wants]
    assert [c.finish_reason for c in r.choices] == [w[-1].finish_reason for w in wants]
    assert r.usage.prompt_tokens == wants[0][-1].stats.prompt_tokens
    assert r.usage.completion_tokens == sum(w[-1].stats.generated_tokens for w in wants)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    events = list(client.chat.completions.create(model="tiny", messages=USER, n=3, stream=True,
                                                 stream_options={"include_usage": True}, **OPTIONS))
    texts, roles, finishes = defaultdict(str), defaultdict(list), defaultdict(list)
    for e in events:
        for c in e.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index].append(c.delta.role)
            finishes[c.index] += [c.finish_reason] if c.finish_reason else []
    assert sorted(texts) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert all(roles[i][0] == "assistant" for i in range(3))
    assert [finishes[i] for i in range(3)] == [[c.finish_reason] for c in r.choices]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == r.usage.completion_tokens


def test_text_completion_n_choices_streamed_and_not(client, loaded):
    prompt = "once upon a time"
    r = client.completions.create(model="tiny", prompt=prompt, n=3, logprobs=2, **OPTIONS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        want = lone(loaded, prompt, logprobs=2, **{**OPTIONS, "seed": seed_of(11, i)})
        assert c.text == "".join(w.text for w in want)
        assert c.logprobs.token_logprobs == pytest.approx([w.logprob for w in want if w.token is not None], abs=1e-4)
    streamed = defaultdict(str)
    for e in client.completions.create(model="tiny", prompt=prompt, n=3, stream=True, **OPTIONS):
        for c in e.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in r.choices]
    # two prompts, two choices each: choice j of prompt i is index 2i + j, each prompt counted once
    prompts = [prompt, "red green blue"]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, **OPTIONS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    wants = [lone(loaded, p, **{**OPTIONS, "seed": seed_of(11, j)}) for p in prompts for j in range(2)]
    assert [c.text for c in r.choices] == ["".join(w.text for w in want) for want in wants]
    assert r.usage.prompt_tokens == wants[0][-1].stats.prompt_tokens + wants[2][-1].stats.prompt_tokens


def test_greedy_choices_through_the_server_are_transformers_greedy(client, loaded, torch_model):
    tok = loaded[1]
    ids = tok.encode("red green blue")
    r = client.completions.create(model="tiny", prompt=ids, n=2, temperature=0, max_tokens=8)
    want = hf_greedy(torch_model, ids, 8)
    ends = [i for i, t in enumerate(want) if t in tok.eos_token_ids]
    text = tok.decode(want[: ends[0]] if ends else want)
    assert [(c.text, c.finish_reason) for c in r.choices] == [(text, "stop" if ends else "length")] * 2


def test_a_prediction_changes_nothing_but_the_drafts(client, word_bias):
    bias = {str(t): b for t, b in word_bias.items()}
    plain = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40,
                                           logit_bias=bias)
    text = plain.choices[0].message.content
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    predicted = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40,
                                               logit_bias=bias, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]
    streamed = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40,
                                              logit_bias=bias, prediction={"type": "content", "content": parts},
                                              stream=True)
    assert "".join(e.choices[0].delta.content or "" for e in streamed if e.choices) == text
    wrong = client.completions.create(model="tiny", prompt="once upon a time", temperature=0, max_tokens=12,
                                      extra_body={"prediction": {"type": "content", "content": "zebra " * 20}})
    assert wrong.choices[0].text == client.completions.create(model="tiny", prompt="once upon a time",
                                                              temperature=0, max_tokens=12).choices[0].text


@pytest.mark.parametrize("n,fact", [(100, "at most 16"), (17, "at most 16"), (7, "at most n=6"), (0, "n")])
def test_a_bad_n_is_a_400_naming_it(client, n, fact):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, n=n, max_tokens=4)
    assert e.value.body["param"] == "n" and fact in e.value.body["message"]


def test_a_bad_prediction_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                       prediction={"type": "file", "content": "x"})
    assert e.value.body["param"].startswith("prediction")


def test_a_client_that_leaves_cancels_every_choice(server, client):
    before = server.health()["prompt_cache"]["entries"]
    stream = client.chat.completions.create(model="tiny", messages=USER, n=3, max_tokens=200, stream=True,
                                            temperature=0)
    next(iter(stream))
    assert server.wait_for(lambda h: h["active"] == 3)["active"] == 3
    stream.close()
    health = server.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0)
    assert (health["active"], health["cache_bytes"]) == (0, 0)
    assert server.health()["prompt_cache"]["entries"] == before, "a choice ran to its end instead of being cancelled"
    assert client.chat.completions.create(model="tiny", messages=USER, n=6, max_tokens=2).choices[5].index == 5


def test_many_choices_leave_room_for_another_client(server, client):
    """n=4 takes the server's four slots with long replies; another client's chat still gets its
    first token while those choices run (one gives its slot up), not when one of them ends."""
    no_end = {str(t): -100 for t in range(3)}  # the tiny tokenizer's special tokens: the replies run long
    many = client.chat.completions.create(model="tiny", messages=USER, n=4, max_tokens=150, stream=True,
                                          temperature=0, logit_bias=no_end)
    first = next(iter(many))
    assert server.wait_for(lambda h: h["active"] == 4)["active"] == 4
    other = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stream=True)
    assert [c.choices[0].finish_reason for c in other][-1] == "length"
    health = server.health()
    many.close()
    assert first.choices[0].index in range(4)
    assert health["active"] >= 4, f"the choices had ended before the other chat was served: {health}"
