"""Ollama's native API (`/api/...`) driven as its users drive it: the official `ollama` Python
client on its default settings against the real `mlxinfer serve` in a subprocess, and raw NDJSON
read with `httpx`.

Oracles: Ollama's docs/api.md and the client's own response types for what each field holds
(types, units: durations are integer nanoseconds); the same conversation through
`/v1/chat/completions` (greedy; itself proved against the engine elsewhere) for the reply, its
token counts and its thinking; transformers' rendering of the chat template, tokenized by the
`tokenizers` library, for prompt token counts; `jsonschema` for structured output. All traffic
goes to 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from serving import Server, post
from test_images_server import vlm  # noqa: F401 - a tiny vision-language model's folder
from test_reasoning import thinker  # noqa: F401 - a random Qwen3 with Qwen3's real tokenizer and template

ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

USER = [{"role": "user", "content": "why is the sky blue?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a given city",
                                           "parameters": WEATHER}}]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(["-m", str(tiny), "--dtype", "float32"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def name(server):
    return json.loads(httpx.get(f"{server.url}/api/tags").text)["models"][0]["name"]


@pytest.fixture(scope="module")
def qwen(thinker):
    s = Server(["-m", str(thinker), "--dtype", "float32"])
    yield s, ollama.Client(host=s.url), json.loads(httpx.get(f"{s.url}/api/tags").text)["models"][0]["name"]
    s.stop()


def chat_completion(url: str, messages: list[dict], **options) -> dict:
    """The oracle: the same conversation through OpenAI's chat completions, greedy."""
    status, body, _ = post(url, {"messages": messages, "temperature": 0, **options}, key=None)
    assert status == 200, body
    return body


def reference_count(folder: Path, messages: list[dict], **template) -> int:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=False, **template)
    return len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def check_final(r, prompt_tokens: int | None = None) -> None:
    """The last object as Ollama documents it: done, why, and measured integer nanoseconds, the
    parts within the whole."""
    assert r.done is True and r.done_reason in ("stop", "length")
    for key in DURATIONS:
        assert isinstance(r[key], int) and r[key] >= 0, key
    assert r.total_duration > 0 and r.prompt_eval_duration > 0
    assert r.load_duration + r.prompt_eval_duration + r.eval_duration <= r.total_duration
    assert isinstance(r.eval_count, int) and r.eval_count >= 1
    if prompt_tokens is not None:
        assert r.prompt_eval_count == prompt_tokens
    assert r.created_at.endswith("Z")


# --- chat and generate ---

def test_chat_equals_the_chat_completion_streamed_and_not(client, server, name, tiny):
    want = chat_completion(server.url, USER, max_tokens=12)
    r = client.chat(model=name, messages=USER, options={"temperature": 0, "num_predict": 12})
    assert r.message.role == "assistant" and r.message.content == want["choices"][0]["message"]["content"]
    check_final(r, reference_count(tiny, USER))
    assert r.eval_count == want["usage"]["completion_tokens"]
    assert r.done_reason == {"stop": "stop", "length": "length"}[want["choices"][0]["finish_reason"]]

    parts = list(client.chat(model=name, messages=USER, stream=True, options={"temperature": 0, "num_predict": 12}))
    assert all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    check_final(parts[-1], r.prompt_eval_count)
    assert parts[-1].eval_count == r.eval_count


def test_generate_renders_the_prompt_as_a_user_turn_and_raw_as_it_is(client, server, name, tiny):
    system = "Be brief."
    want = chat_completion(server.url, [{"role": "system", "content": system}, *USER], max_tokens=8)
    r = client.generate(model=name, prompt=USER[0]["content"], system=system,
                        options={"temperature": 0, "num_predict": 8})
    assert r.response == want["choices"][0]["message"]["content"]
    check_final(r, reference_count(tiny, [{"role": "system", "content": system}, *USER]))

    status, text, _ = post(server.url, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, key=None,
                           path="/v1/completions")
    raw = client.generate(model=name, prompt="Once upon a time", raw=True, options={"temperature": 0,
                                                                                 "num_predict": 8})
    assert raw.response == text["choices"][0]["text"] and raw.eval_count == text["usage"]["completion_tokens"]
    assert raw.prompt_eval_count == text["usage"]["prompt_tokens"]


def test_raw_ndjson_each_line_an_object_the_last_done(server, name):
    lines = []
    with httpx.stream("POST", f"{server.url}/api/generate", json={"model": name, "prompt": "hi",
                                                                  "options": {"num_predict": 5}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(isinstance(x, dict) for x in lines) and len(lines) >= 2
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert all(isinstance(x["response"], str) for x in lines)
    assert lines[-1]["eval_count"] == 5 and lines[-1]["done_reason"] == "length"


def test_options_are_honoured_and_load_time_ones_change_nothing(client, name):
    ask = dict(model=name, messages=USER)
    base = client.chat(**ask, options={"temperature": 0, "num_predict": 10})
    same = client.chat(**ask, options={"temperature": 0, "num_predict": 10, "num_gpu": 99, "num_thread": 2,
                                       "use_mmap": True, "num_batch": 8, "num_ctx": 2048, "typical_p": 1.0})
    assert same.message.content == base.message.content
    seeded = [client.chat(**ask, options={"temperature": 1.0, "seed": 7, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                          "repeat_penalty": 1.1, "repeat_last_n": 16, "presence_penalty": 0.5,
                                          "frequency_penalty": 0.5, "num_predict": 10}).message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    stop = base.message.content[3:6]
    stopped = client.chat(**ask, options={"temperature": 0, "num_predict": 10, "stop": [stop]})
    assert stop and stopped.message.content == base.message.content[:base.message.content.index(stop)]
    assert stopped.done_reason == "stop"


def test_an_empty_request_loads_the_model_keep_alive_0_unloads_it_and_ps_shows_the_expiry(client, server, name):
    import time

    r = client.chat(model=name, messages=[], keep_alive=0)
    assert r.done is True and r.done_reason == "unload" and r.message.content == ""
    assert client.ps().models == []
    r = client.generate(model=name)
    assert r.done is True and r.done_reason == "load" and r.response == ""
    assert [m.model for m in client.ps().models] == [name]
    before = time.time()
    status, body, _ = post(server.url, {"model": name, "keep_alive": "10m"}, key=None, path="/api/generate")
    assert status == 200 and body["done_reason"] == "load"
    expires = client.ps().models[0].expires_at
    assert before + 600 - 5 <= expires.timestamp() <= time.time() + 600
    client.chat(model=name, messages=USER, keep_alive=-1, options={"num_predict": 1})
    assert client.ps().models[0].expires_at.year == 9999  # negative: kept loaded
    client.generate(model=name, prompt="hi", keep_alive=0, options={"num_predict": 1})
    deadline = time.time() + 60  # unloaded once idle: the registry does it as the reply ends
    while client.ps().models and time.time() < deadline:
        time.sleep(0.05)
    assert client.ps().models == []


# --- tools, structured output, thinking (Qwen3's template) ---

def test_a_tool_result_round_trip_renders_and_answers_as_the_chat_completion(qwen, thinker):
    s, client, name = qwen
    history = [*USER, {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Toronto"}}}]},
               {"role": "tool", "content": "11 degrees celsius", "tool_name": "get_weather"}]
    r = client.chat(model=name, messages=history, tools=TOOLS, options={"temperature": 0, "num_predict": 8},
                    think=False)
    openai_history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Toronto"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "11 degrees celsius"}]
    sent = [ollama.Tool.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]  # the client reorders keys
    want = chat_completion(s.url, openai_history, max_tokens=8, tools=sent, reasoning_effort="none")
    assert r.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert r.message.content == (want["choices"][0]["message"]["content"] or "")
    rendered = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Toronto"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "11 degrees celsius"}]
    assert r.prompt_eval_count == reference_count(thinker, rendered, tools=sent, enable_thinking=False)


def test_format_holds_the_reply_to_a_pydantic_models_schema(qwen):
    jsonschema = pytest.importorskip("jsonschema")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        degrees: int

    s, client, name = qwen
    schema = Weather.model_json_schema()
    r = client.chat(model=name, messages=USER, format=schema, think=False,
                    options={"temperature": 0, "num_predict": 60})
    want = chat_completion(s.url, USER, max_tokens=60, reasoning_effort="none",
                           response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    assert r.message.content == want["choices"][0]["message"]["content"]
    if r.done_reason == "stop":
        jsonschema.validate(json.loads(r.message.content), schema)
        Weather.model_validate_json(r.message.content)
    js = client.generate(model=name, prompt="a JSON object", format="json", think=False,
                         options={"temperature": 0, "num_predict": 40})
    if js.done_reason == "stop":
        assert isinstance(json.loads(js.response), dict)


def test_think_splits_the_thinking_into_its_own_field(qwen, thinker, tmp_path_factory):
    """Under an R1-style template the reply starts inside <think>: everything the random model
    writes before </think> is thinking, which `think` returns apart as the OpenAI path does."""
    folder = tmp_path_factory.mktemp("r1") / "model"
    shutil.copytree(thinker, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("'<|im_start|>assistant\\n' }}",
                                                              "'<|im_start|>assistant\\n<think>\\n' }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    s = Server(["-m", str(folder), "--dtype", "float32"])
    try:
        client = ollama.Client(host=s.url)
        name = client.list().models[0].model
        want = chat_completion(s.url, USER, max_tokens=10, reasoning_effort="medium")["choices"][0]["message"]
        r = client.chat(model=name, messages=USER, think=True, options={"temperature": 0, "num_predict": 10})
        assert r.message.thinking == want["reasoning_content"] and r.message.thinking
        assert (r.message.content or "") == (want["content"] or "")
        parts = list(client.chat(model=name, messages=USER, think=True, stream=True,
                                 options={"temperature": 0, "num_predict": 10}))
        assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
        g = client.generate(model=name, prompt=USER[0]["content"], think=True,
                            options={"temperature": 0, "num_predict": 10})
        assert g.thinking == r.message.thinking
        assert "thinking" in client.show(name).capabilities
    finally:
        s.stop()


def test_think_on_a_model_that_cannot_think_is_400(client, name):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=USER, think=True)
    assert e.value.status_code == 400 and "thinking" in e.value.error


# --- models: list, show, ps, embed, version ---

def test_list_show_ps_and_version(client, name, tiny):
    config = json.loads((tiny / "config.json").read_text())
    listed = client.list().models
    assert [m.model for m in listed] == [name] and listed[0].size > 0 and listed[0].modified_at is not None
    details = listed[0].details
    assert details.family == config["model_type"] and details.families == [config["model_type"]]
    assert details.parameter_size and details.quantization_level == "F32"

    shown = client.show(name)
    arch = shown.modelinfo["general.architecture"]
    assert arch == config["model_type"]
    assert shown.modelinfo[f"{arch}.context_length"] == config["max_position_embeddings"]
    assert shown.modelinfo[f"{arch}.embedding_length"] == config["hidden_size"]
    assert shown.modelinfo[f"{arch}.block_count"] == config["num_hidden_layers"]
    assert shown.modelinfo[f"{arch}.attention.head_count"] == config["num_attention_heads"]
    assert "completion" in shown.capabilities and "thinking" not in shown.capabilities
    from transformers import AutoModelForCausalLM

    assert shown.modelinfo["general.parameter_count"] == AutoModelForCausalLM.from_pretrained(tiny).num_parameters()
    assert isinstance(shown.template, str)

    client.generate(model=name)  # loaded
    running = client.ps().models
    assert [m.model for m in running] == [name] and running[0].size_vram == running[0].size > 0
    assert running[0].expires_at is not None and running[0].context_length == config["max_position_embeddings"]
    version = httpx.get(f"{client._client.base_url}/api/version").json()["version"]
    assert isinstance(version, str) and version.count(".") >= 2


def test_embed_and_the_legacy_embeddings_equal_the_openai_vectors(client, server, name):
    texts = ["Why is the sky blue?", "Why is the grass green?"]
    status, want, _ = post(server.url, {"input": texts}, key=None, path="/v1/embeddings")
    assert status == 200
    r = client.embed(model=name, input=texts)
    assert len(r.embeddings) == 2
    for got, expected in zip(r.embeddings, want["data"]):
        assert got == pytest.approx(expected["embedding"], abs=1e-6)
    assert r.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert isinstance(r.total_duration, int) and 0 <= r.load_duration <= r.total_duration
    one = client.embed(model=name, input=texts[0], dimensions=8)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 8
    legacy = client.embeddings(model=name, prompt=texts[0])
    assert legacy.embedding == pytest.approx(want["data"][0]["embedding"], abs=1e-6)


# --- errors, in Ollama's shape ---

def test_unknown_model_is_404_and_bad_options_400_naming_them(client, server, name):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=USER)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404
    for options, word in (({"temperature": "hot"}, "temperature"), ({"no_such_option": 1}, "no_such_option"),
                          ({"mirostat": 2}, "mirostat"), ({"top_p": 5.0}, "top_p")):
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=name, messages=USER, options=options)
        assert e.value.status_code == 400 and word in e.value.error, e.value.error
    for extra, word in (({"suffix": "return x"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"),
                        ({"context": [1, 2]}, "context"), ({"keep_alive": "soon"}, "keep_alive")):
        status, body, _ = post(server.url, {"model": name, "prompt": "hi", **extra}, key=None, path="/api/generate")
        assert status == 400 and list(body) == ["error"] and word in body["error"], body
    r = httpx.post(f"{server.url}/api/chat", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and list(r.json()) == ["error"]
    r = httpx.get(f"{server.url}/api/nothing")
    assert r.status_code == 404 and list(r.json()) == ["error"]


def test_curl_as_ollamas_documentation_writes_it(server, name):
    """docs/api.md's `curl http://localhost:11434/api/generate -d '{...}'`: curl declares a form
    body and sends no Origin; it is answered, `stream: false` as one object. With a web page's
    Origin the same body is refused, 415 in Ollama's shape."""
    import shutil
    import subprocess

    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    body = json.dumps({"model": name, "prompt": "Why is the sky blue?", "stream": False,
                       "options": {"num_predict": 3}})
    for extra, status in (([], 200), (["-H", "Origin: http://evil.example"], 415)):
        out = subprocess.run([curl, "-sS", "-w", "\n%{http_code}", f"{server.url}/api/generate", "-d", body, *extra],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        text, _, code = out.rpartition("\n")
        assert int(code) == status, text
        reply = json.loads(text)
        if status == 200:
            assert reply["done"] is True and reply["eval_count"] == 3 and isinstance(reply["response"], str)
        else:
            assert list(reply) == ["error"] and "application/json" in reply["error"]


# --- the model store: copy and delete ---

def test_copy_and_delete_go_through_mlxinfers_cache(client, tiny):
    r = client.copy(str(tiny), "tiny-copy")
    assert r.status == "success"
    with pytest.raises(ollama.ResponseError) as e:  # the name is taken now
        client.copy(str(tiny), "tiny-copy")
    assert e.value.status_code == 400 and "tiny-copy" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.copy("no-such-model", "other")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:  # a folder of the user's is never deleted
        client.delete(str(tiny))
    assert e.value.status_code == 400 and (tiny / "config.json").exists()
    assert client.delete("tiny-copy").status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("tiny-copy")
    assert e.value.status_code == 404


# --- tool calls and thinking in chunks a tiny random model cannot be made to produce ---

def chunk(text="", finish=None, reasoning="", calls=None, content=None):
    from mlxinfer.decode.sources import Stats
    from mlxinfer.engine.text_stream import Chunk

    return Chunk(text, 1, None, finish, Stats(prompt_tokens=9, prefill_tokens=9, generated_tokens=5, ttft=0.01),
                 reasoning=reasoning, tool_calls=calls, content=content)


def call(name: str, **arguments):
    from mlxinfer.text.tools import ToolCall

    return ToolCall(name, arguments, f"call_{name}")


@pytest.mark.parametrize("chunks, content, thinking, calls", [
    ([chunk(reasoning="Let me "), chunk(reasoning="think."), chunk("The answer"), chunk(" is 4.", "stop")],
     "The answer is 4.", "Let me think.", []),
    ([chunk('{"name": "f", '), chunk('"arguments": {}}', "tool_calls", calls=[call("f")], content="")], "", "",
     [("f", {})]),
    ([chunk(reasoning="hm"), chunk("{"), chunk("}", "tool_calls", calls=[call("f", x=1), call("g")], content="x")],
     "x", "hm", [("f", {"x": 1}), ("g", {})]),
    ([chunk("{"), chunk("", "length")], "{", "", []),
])
def test_streamed_lines_add_up_to_the_whole_reply_in_the_clients_types(chunks, content, thinking, calls):
    """Each NDJSON line parses as the client's ChatResponse; the lines' content, thinking and
    calls add up to the non-streamed message, whose calls carry arguments as objects with their
    index, as Ollama's documentation shows them."""
    import asyncio

    from mlxinfer.serve.ollama import Reply

    async def rest():
        for c in chunks[1:]:
            yield c

    async def lines() -> list[dict]:
        reply = Reply(model="m", chat=True, arrived=0, loaded=0, opener="{")
        return [json.loads(line) async for line in reply.lines(chunks[0], rest())]

    whole = ollama.ChatResponse(**Reply(model="m", chat=True, arrived=0, loaded=0, opener="{").whole(chunks))
    raw = asyncio.run(lines())
    parts = [ollama.ChatResponse(**line) for line in raw]
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert whole.message.content == content and (whole.message.thinking or "") == thinking
    assert "".join(p.message.content or "" for p in parts) == content
    assert "".join(p.message.thinking or "" for p in parts) == thinking
    got = [c for p in parts for c in p.message.tool_calls or ()]
    for listed in (got, whole.message.tool_calls or []):
        assert [(c.function.name, dict(c.function.arguments)) for c in listed] == calls
    indices = [c["function"]["index"] for line in raw for c in line["message"].get("tool_calls", ())]
    assert indices == list(range(len(calls)))
    assert whole.done_reason == ("length" if chunks[-1].finish_reason == "length" else "stop")


# --- images, on a tiny vision-language model ---

def test_images_reach_a_vision_model_as_the_chat_completions_image_parts(vlm):
    """The client's base64 `images` go to the template after the message's text, as the same
    image in an image_url part there does on /v1/chat/completions."""
    import base64

    from test_images import encoded, picture

    png = encoded(picture(64, 48))
    s = Server(["-m", str(vlm), "--dtype", "float32"])
    try:
        client = ollama.Client(host=s.url)
        name = client.list().models[0].model
        assert "vision" in client.show(name).capabilities
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        want = chat_completion(s.url, [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}],
            max_tokens=6)
        r = client.chat(model=name, messages=[{"role": "user", "content": "what is this?", "images": [png]}],
                        options={"temperature": 0, "num_predict": 6})
        assert r.message.content == want["choices"][0]["message"]["content"]
        assert r.prompt_eval_count == want["usage"]["prompt_tokens"]
        g = client.generate(model=name, prompt="what is this?", images=[png], options={"temperature": 0,
                                                                                      "num_predict": 6})
        assert g.response == r.message.content
    finally:
        s.stop()


def test_logprobs_equal_the_chat_completions(client, server, name):
    want = chat_completion(server.url, USER, max_tokens=6, logprobs=True, top_logprobs=3)
    expected = [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
                for t in want["choices"][0]["logprobs"]["content"]]
    for stream in (False, True):
        r = client.chat(model=name, messages=USER, logprobs=True, top_logprobs=3, stream=stream,
                        options={"temperature": 0, "num_predict": 6})
        got = [t for part in (r if stream else [r]) for t in part.logprobs or ()]
        assert len(got) == len(expected) == 6
        for t, (token, logprob, top) in zip(got, expected):
            assert t.token == token and t.logprob == pytest.approx(logprob, abs=1e-5)
            assert [a.token for a in t.top_logprobs] == [a for a, _ in top]
            assert [a.logprob for a in t.top_logprobs] == pytest.approx([lp for _, lp in top], abs=1e-5)
    plain = client.chat(model=name, messages=USER, options={"temperature": 0, "num_predict": 6})
    assert plain.logprobs is None


def test_pull_a_local_folder_streams_progress_lines_and_lands_in_the_cache(client, server, tiny):
    from mlxinfer.loading import store

    before = {m.name for m in store.local_models() if m.where == "mlxinfer"}
    steps = list(client.pull(str(tiny), stream=True))
    assert steps and all(isinstance(s, ollama.ProgressResponse) and s.status for s in steps)
    assert steps[-1].status == "success"
    pulled = [m for m in store.local_models() if m.where == "mlxinfer" and m.name not in before]
    assert len(pulled) == 1 and pulled[0].quantization.startswith("4-bit")  # a float source is quantized, as `pull`
    again = list(client.pull(str(tiny), stream=True))  # already there: success, as Ollama's pull of a model it has
    assert again[-1].status == "success"
    assert [m.name for m in store.local_models() if m.where == "mlxinfer" and m.name not in before] == \
        [pulled[0].name]
    assert client.delete(pulled[0].name).status == "success"
    assert client.pull(str(tiny)).status == "success"  # not streamed: one object
    assert client.delete(pulled[0].name).status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull(str(tiny / "no-such-folder"))
    assert e.value.status_code == 404
    with httpx.stream("POST", f"{server.url}/api/pull", json={"model": str(tiny)}) as r:  # streamed by default
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("application/x-ndjson") and lines[-1] == {"status": "success"}
    assert all(set(line) <= {"status", "digest", "total", "completed"} for line in lines)
    client.delete(pulled[0].name)


def test_a_server_of_the_store_serves_what_is_pulled_and_forgets_what_is_deleted(tiny, tmp_path):
    """With no --model the server serves mlxinfer's cache: a model pulled through /api/pull is
    listed and answers by its name at once; deleted, it is gone from the listing."""
    from mlxinfer.loading import store

    s = Server([], env={"MLXINFER_HOME": str(tmp_path / "home")})
    try:
        client = ollama.Client(host=s.url)
        before = {m.model for m in client.list().models}
        assert client.pull(str(tiny)).status == "success"
        new = [m for m in client.list().models if m.model not in before]
        assert len(new) == 1 and new[0].details.quantization_level.startswith("4-bit")
        name = new[0].model
        r = client.chat(model=name, messages=USER, options={"num_predict": 3})
        assert r.done and r.eval_count == 3 and r.model == name
        assert name in [m.model for m in client.ps().models]
        assert client.copy(name, "copied").status == "success"
        assert "copied" in {m.model for m in client.list().models}
        for gone in (name, "copied"):
            assert client.delete(gone).status == "success"
        assert {m.model for m in client.list().models} == before
        assert name not in [m.model for m in client.ps().models]
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=name, messages=USER)
        assert e.value.status_code == 404
        assert store.find(name) is None or store.find(name).where != "mlxinfer"
    finally:
        s.stop()
