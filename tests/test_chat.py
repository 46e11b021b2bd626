"""ChatSession against independent oracles: the prefill of each turn is the number of
template tokens we render ourselves, and every reply equals a fresh (uncached)
greedy generation on the prompt the conversation stands for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlxinfer
from mlxinfer import ChatSession
from mlxinfer.base.errors import InvalidOptionError, SessionFileError, TokenizerError
from mlxinfer.engine.generate import stream_generate
from mlxinfer.engine.request import Request

GREEDY = {"temperature": 0.0, "max_tokens": 6}


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def render(tok, messages, generation_prompt: bool = True) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)


def ids_of(chunks) -> list[int]:
    return [c.token for c in chunks if c.token is not None]


def fresh(model, tok, prompt: list[int], **options) -> list[int]:
    """Greedy tokens with no cache reuse at all."""
    return ids_of(stream_generate(model, tok, prompt, **{**GREEDY, **options}))


def test_exports():
    assert mlxinfer.ChatSession is ChatSession and "ChatSession" in mlxinfer.__all__


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_second_turn_prefills_only_the_new_turn(loaded, finish):
    model, tok = loaded
    first = fresh(model, tok, encode(tok, render(tok, [{"role": "user", "content": "hello there"}])))
    if finish == "stop":  # the model's 3rd greedy token becomes an end-of-turn token
        tok.eos_token_ids.insert(0, first[2])
    try:
        session = ChatSession(model, tok, **GREEDY)
        one = list(session.send("hello there"))
        two = list(session.send("What is the capital of France?"))
    finally:
        if finish == "stop":
            tok.eos_token_ids.remove(first[2])
    assert one[-1].finish_reason == finish
    reply = "".join(c.text for c in one)
    p1 = render(tok, [{"role": "user", "content": "hello there"}])
    conversation = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "What is the capital of France?"}]
    p2 = render(tok, conversation)
    new = p2[len(p1 + reply):]
    assert p2.startswith(p1 + reply) and new.startswith("<|im_end|>") and "France" in new
    assert one[-1].stats.prefill_tokens == len(encode(tok, p1))
    unfed = 1 if finish == "length" else 0  # the last generated token is never fed back
    assert two[-1].stats.prefill_tokens == len(encode(tok, new)) + unfed
    # the cached turn equals a fresh generation on the prompt the conversation stands for; a final
    # end-of-turn token is not part of the reply (the template writes its own)
    reply_ids = ids_of(one)[:-1] if finish == "stop" else ids_of(one)
    prompt2 = encode(tok, p1) + reply_ids + encode(tok, new)
    assert ids_of(two) == fresh(model, tok, prompt2)
    assert session.reply == "".join(c.text for c in two) and session.stats is two[-1].stats
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_replies_keep_their_own_token_ids(loaded):
    """A reply whose text encodes to other ids is not prefilled again on the next turn."""
    model, tok = loaded
    session = ChatSession(model, tok, temperature=0.0, max_tokens=12)
    one = list(session.send("hello there"))
    reply = "".join(c.text for c in one)
    assert encode(tok, reply) != ids_of(one)  # this random model spells its reply unlike the tokenizer
    two = list(session.send("and then?"))
    p1 = render(tok, [{"role": "user", "content": "hello there"}])
    p2 = render(tok, session.messages[:3])
    assert two[-1].stats.prefill_tokens == len(encode(tok, p2[len(p1 + reply):])) + 1


def test_system_prompt_change_rereads_the_conversation(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, system="You are terse.", **GREEDY)
    list(session.send("hello there"))
    assert session.messages[0] == {"role": "system", "content": "You are terse."}
    session.system = "You are verbose."
    two = list(session.send("again"))
    whole = encode(tok, render(tok, session.messages[:-1]))
    before = encode(tok, render(tok, [{"role": "system", "content": "You are terse."}, session.messages[1]]))
    common = next(i for i, (a, b) in enumerate(zip(before, whole)) if a != b)
    assert two[-1].stats.prompt_tokens == len(whole) and two[-1].stats.prefill_tokens == len(whole) - common
    assert ids_of(two) == fresh(model, tok, whole)


def test_reply_cut_by_stop_string_then_next_turn(loaded):
    model, tok = loaded
    free = tok.decode(fresh(model, tok, encode(tok, render(tok, [{"role": "user", "content": "hi"}])), max_tokens=10))
    session = ChatSession(model, tok, temperature=0.0, max_tokens=10, stop=[free[3:6]])
    one = list(session.send("hi"))
    assert session.reply == free[: free.index(free[3:6])] and one[-1].finish_reason == "stop"
    two = list(session.send("more"))
    assert ids_of(two) == fresh(model, tok, encode(tok, render(tok, session.messages[:-1])), max_tokens=10,
                                stop=[free[3:6]])


def test_undo_rolls_the_cache_back_to_the_rest_of_the_conversation(loaded):
    model, tok = loaded
    the = encode(tok, " the")
    assert len(the) == 1
    # replies forced to " the the ...", whose text encodes back to the same ids
    session = ChatSession(model, tok, temperature=0.0, max_tokens=4, logit_bias={the[0]: 100.0})
    for text in ("first question", "second question", "third question"):
        list(session.send(text))
    assert session.reply == " the" * 4
    assert session.undo()
    rest = session.messages
    assert [m["content"] for m in rest] == ["first question", " the" * 4, "second question", " the" * 4]
    assert session.cache.tokens == encode(tok, render(tok, rest, generation_prompt=False))
    assert all(c.offset == len(session.cache.tokens) for c in session.cache.caches)
    nxt = list(session.send("another one"))
    prompt = encode(tok, render(tok, session.messages[:-1]))
    assert nxt[-1].stats.prefill_tokens == len(prompt) - len(encode(tok, render(tok, rest, False)))
    assert ids_of(nxt) == fresh(model, tok, prompt, max_tokens=4, logit_bias={the[0]: 100.0})
    while session.undo():
        pass
    assert session.messages == [] and session.cache.tokens == [] and session.cache.offset == 0


def test_undo_past_a_reply_cut_by_a_stop_string(loaded):
    """The cut reply's ids are unknown: undoing back past it re-encodes the conversation."""
    model, tok = loaded
    probe = ChatSession(model, tok, temperature=0.0, max_tokens=10)
    list(probe.send("hello there"))
    free = "".join(c.text for c in probe.send("the quick brown fox"))
    assert len(free) > 6
    session = ChatSession(model, tok, temperature=0.0, max_tokens=10)
    list(session.send("hello there"))
    session.set_option("stop", [free[3:6]])
    list(session.send("the quick brown fox"))
    assert session.reply == free[: free.index(free[3:6])]
    session.set_option("stop", [])
    for text in ("three", "four"):
        list(session.send(text))
    session.undo()
    session.undo()
    assert [m["content"] for m in session.messages[::2]] == ["hello there", "the quick brown fox"]
    assert tok.decode(session.cache.tokens) == render(tok, session.messages, generation_prompt=False)
    nxt = list(session.send("five"))
    assert ids_of(nxt) == fresh(model, tok, encode(tok, render(tok, session.messages[:-1])), max_tokens=10)


def test_undo_with_replies_that_do_not_round_trip(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, temperature=0.0, max_tokens=10)
    for text in ("first question", "second question"):
        list(session.send(text))
    session.undo()
    assert tok.decode(session.cache.tokens) == render(tok, session.messages, generation_prompt=False)
    assert not session.undo() or session.messages == []


def test_reset(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, system="Be brief.", **GREEDY)
    list(session.send("hello there"))
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}] and session.cache.tokens == []
    again = list(session.send("hello there"))
    prompt = encode(tok, render(tok, session.messages[:-1]))
    assert again[-1].stats.prefill_tokens == len(prompt) and ids_of(again) == fresh(model, tok, prompt)


def test_save_and_load_resume_without_prefill(loaded, hf_checkpoint, tmp_path):
    model, tok = loaded
    straight = ChatSession(model, tok, system="Be kind.", temperature=0.0, max_tokens=8, top_k=5)
    list(straight.send("hello there"))
    expected = list(straight.send("tell me more"))

    saved = ChatSession(model, tok, system="Be kind.", temperature=0.0, max_tokens=8, top_k=5)
    list(saved.send("hello there"))
    saved.save(tmp_path / "chat.json")
    assert (tmp_path / "chat.kv.safetensors").is_file()
    data = json.loads((tmp_path / "chat.json").read_text())
    assert data["messages"] == saved.messages[1:] and data["version"] == 2
    assert Request.from_json(data["request"]).sampling.top_k == 5  # the settings, typed

    resumed = ChatSession.load(tmp_path / "chat.json", model, tok)
    assert resumed.cache_restored and resumed.messages == saved.messages and resumed.options == saved.options
    assert resumed.cache.tokens == saved.cache.tokens
    got = list(resumed.send("tell me more"))
    assert ids_of(got) == ids_of(expected)
    assert got[-1].stats.prefill_tokens == expected[-1].stats.prefill_tokens < got[-1].stats.prompt_tokens

    # another model: the conversation resumes, its cache is not used
    other, _ = mlxinfer.load(hf_checkpoint("llama", seed=1, head_dim=32), dtype="float32")
    elsewhere = ChatSession.load(tmp_path / "chat.json", other, tok)
    assert not elsewhere.cache_restored and elsewhere.cache.tokens == []
    out = list(elsewhere.send("tell me more"))
    assert out[-1].stats.prefill_tokens == out[-1].stats.prompt_tokens


def test_a_session_saved_by_version_1_still_loads(loaded, tmp_path):
    """Files written before the settings were a typed request: keyword options, logit_bias keyed
    by strings (JSON object keys), stop as a list."""
    model, tok = loaded
    options = {"temperature": 0.0, "max_tokens": 6, "logit_bias": {7: 3.0}, "stop": ["zzz"]}
    fresh = ChatSession(model, tok, system="Be kind.", **options)
    expected = list(fresh.send("hello there"))
    old = {"format": "mlxinfer-chat", "version": 1, "system": "Be kind.", "messages": [],
           "options": {**options, "logit_bias": {"7": 3.0}}, "kv_cache": "old.kv.safetensors"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    resumed = ChatSession.load(tmp_path / "old.json", model, tok)
    assert resumed.settings.sampling.logit_bias == {7: 3.0} and resumed.settings.options.stop == ("zzz",)
    assert ids_of(list(resumed.send("hello there"))) == ids_of(expected)


def test_a_failed_save_leaves_no_stray_files(loaded, tmp_path, monkeypatch):
    import errno

    model, tok = loaded
    session = ChatSession(model, tok, **GREEDY)
    list(session.send("hello there"))
    session.save(tmp_path / "chat.json")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    list(session.send("tell me more"))
    write_text = Path.write_text

    def full(self, *args, **kwargs):  # the second file written, the conversation, meets a full disk
        write_text(self, "{", encoding="utf-8")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    errors = []
    for name in ("chat.json", "new.json"):  # over an earlier save, and a new one
        with pytest.raises(SessionFileError) as e:
            session.save(tmp_path / name)
        errors.append(str(e.value))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert all("(the disk is full)" in e and "\n" not in e for e in errors), errors


def test_a_failed_prompt_cache_save_leaves_the_old_file(loaded, tmp_path, monkeypatch):
    import errno

    import mlxinfer.engine.prompt_file as cache_module

    model, tok = loaded
    session = ChatSession(model, tok, **GREEDY)
    list(session.send("hello there"))
    path = tmp_path / "c.safetensors"
    cache_module.save_prompt_cache(path, session.cache)
    before = path.read_bytes()

    def full(file, arrays, metadata=None):
        Path(file).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module.mx, "save_safetensors", full)
    with pytest.raises(OSError):
        cache_module.save_prompt_cache(path, session.cache)
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"] and path.read_bytes() == before


def test_load_errors_are_one_line(loaded, tmp_path):
    model, tok = loaded
    for content, fact in [(None, "no saved chat"), ("{not json", "cannot read"), ('{"format": "x"}', "not a chat"),
                          ('{"format": "mlxinfer-chat", "version": 1, "messages": 3}', "damaged"),
                          ('{"format": "mlxinfer-chat", "version": 2, "messages": [], "kv_cache": "k.safetensors", '
                           '"request": {"prompt": "", "sampling": {"temperature": -3}, "options": {}}}', "damaged"),
                          ('{"format": "mlxinfer-chat", "version": 9}', "version 9")]:
        path = tmp_path / "bad.json"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(content)
        with pytest.raises(SessionFileError) as e:
            ChatSession.load(path, model, tok)
        assert fact in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SessionFileError, match="cannot write"):
        ChatSession(model, tok).save(tmp_path / "missing" / "dir" / "chat.json")


def test_closing_the_stream_keeps_the_partial_reply(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, temperature=0.0, max_tokens=50)
    chunks = session.send("hello there")
    taken = [next(chunks) for _ in range(3)]
    chunks.close()
    partial = "".join(c.text for c in taken)
    assert session.reply == partial and len(session.messages) == 2
    assert all(c.offset == len(session.cache.tokens) for c in session.cache.caches)
    nxt = list(session.send("go on"))
    p1 = render(tok, [{"role": "user", "content": "hello there"}])
    rest = render(tok, session.messages[:-1])[len(p1 + partial):]
    prompt = encode(tok, p1) + ids_of(taken) + encode(tok, rest)
    assert nxt[-1].stats.prefill_tokens == len(encode(tok, rest))  # every streamed token was fed
    assert ids_of(nxt) == fresh(model, tok, prompt, max_tokens=50)


def test_interrupt_in_the_middle_of_a_forward_pass(loaded):
    """Ctrl-C between two layers leaves layer caches ahead of their token list: settled."""
    model, tok = loaded
    session = ChatSession(model, tok, **GREEDY)
    one = list(session.send("hello there"))
    layer = session.cache.caches[1]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    layer.update_and_fetch = layer.store = interrupt  # whichever way the layer stores its keys
    try:
        with pytest.raises(KeyboardInterrupt):
            list(session.send("second question"))
    finally:
        del layer.update_and_fetch, layer.store
    assert len(session.messages) == 2  # nothing was said: the message is dropped
    assert all(c.offset == len(session.cache.tokens) for c in session.cache.caches)
    nxt = list(session.send("second question"))
    p1, reply = render(tok, session.messages[:1]), session.messages[1]["content"]
    rest = render(tok, session.messages[:-1])[len(p1 + reply):]
    assert one[-1].finish_reason == "length"
    assert ids_of(nxt) == fresh(model, tok, encode(tok, p1) + ids_of(one) + encode(tok, rest))


def test_rotating_cache_keeps_long_chats_going(loaded):
    model, tok = loaded
    limit = model.config.max_position_embeddings
    plain = ChatSession(model, tok, temperature=0.0, max_tokens=16)
    rotating = ChatSession(model, tok, temperature=0.0, max_tokens=16, max_kv_size=48)
    failed_at = None
    for i in range(14):
        text = f"question number {i}: the quick brown fox"
        try:
            list(plain.send(text))
        except InvalidOptionError as e:
            failed_at = failed_at or i
            assert "--max-kv-size" in str(e) and len(plain.messages) == 2 * failed_at
        before = rotating.messages
        chunks = list(rotating.send(text))
        assert chunks[-1].finish_reason == "length"  # so the reply's last token is the one never fed
        if before:
            new = render(tok, rotating.messages[:-1])[len(render(tok, before[:-1]) + before[-1]["content"]):]
            assert new.startswith("<|im_end|>") and chunks[-1].stats.prefill_tokens == len(encode(tok, new)) + 1
        assert rotating.cache.nbytes <= 48 * sum(c.bytes_per_token for c in rotating.cache.caches)
    assert failed_at is not None and chunks[-1].stats.prompt_tokens > limit
    # undo far back in a rotating cache: the needed tokens are gone, so it is rebuilt
    rotating.undo()
    assert tok.decode(rotating.cache.tokens) == render(tok, rotating.messages, generation_prompt=False)
    assert list(rotating.send("still there?"))[-1].stats.generated_tokens > 0


def test_context_overflow_leaves_no_trace(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, **GREEDY)
    list(session.send("hello there"))
    with pytest.raises(InvalidOptionError):
        list(session.send("the quick brown fox " * 80))
    assert len(session.messages) == 2
    assert list(session.send("short"))[-1].stats.generated_tokens > 0


def test_bad_options(loaded, copy_checkpoint, tiny):
    model, tok = loaded
    with pytest.raises(InvalidOptionError, match="bogus"):
        ChatSession(model, tok, bogus=1)
    session = ChatSession(model, tok, max_kv_size=64)
    with pytest.raises(InvalidOptionError, match="temperature"):
        session.set_option("temperature", -1.0)
    with pytest.raises(InvalidOptionError, match="fixed"):
        session.set_option("max_kv_size", 32)
    session.set_option("top_p", 0.5)
    assert session.options["top_p"] == 0.5 and session.cache_options == {"max_kv_size": 64}
    folder = copy_checkpoint(tiny)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        ChatSession(model, mlxinfer.load_tokenizer(folder))


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_speculative_chat_equals_plain_greedy(loaded, drafter):
    model, tok = loaded
    extra = {"draft_model": model} if drafter == "model" else {"prompt_lookup": True}
    plain = ChatSession(model, tok, temperature=0.0, max_tokens=24)
    fast = ChatSession(model, tok, temperature=0.0, max_tokens=24, **extra)
    for text in ("hello there", "the quick brown fox", "hello there"):
        a, b = list(plain.send(text)), list(fast.send(text))
        assert ids_of(a) == ids_of(b)
    assert fast.stats.drafted > 0 and any(c.drafted for c in b)


class CountingModel:
    """Wraps a model and counts the tokens it is fed through a cache: the draft's
    prefill work (cache-less calls are the speed check's timing steps)."""

    def __init__(self, model):
        self.model, self.config, self.layers, self.fed = model, model.config, model.layers, 0

    def __call__(self, tokens, cache=None):
        if cache is not None:
            self.fed += tokens.shape[1]
        return self.model(tokens, cache=cache)


def test_draft_model_cache_is_reused_across_turns(loaded):
    model, tok = loaded
    draft = CountingModel(model)
    session = ChatSession(model, tok, draft_model=draft, temperature=0.0, max_tokens=6, num_draft_tokens=2)
    list(session.send("hello there"))
    draft.fed = 0
    second = list(session.send("and again"))
    prompt = tok.apply_chat_template(session.messages[:-1], add_generation_prompt=True, tokenize=True)
    assert second[-1].stats.drafted > 0
    # the draft reads the new turn and its own proposals, not the whole conversation again
    assert draft.fed < len(prompt), (draft.fed, len(prompt))
