"""A vision-language model's server under hostile image requests: image URLs fetched only from
public addresses (unless the host is allowed by name) and refused in the same words whatever
went wrong, a dripping sender cut at --image-url-timeout, downloads on threads of their own that
never hold the workers other requests need, a request's images bounded in count and pixels and
decoded one at a time.

The model is a random-weight Qwen2.5-VL built here (test_models_qwen_vl's sizes) with a trained
tokenizer given Qwen's vision tokens: it needs nothing from outside the repository. Image URLs
point at HTTP servers on 127.0.0.1 run by the tests; every wait is on an event, bounded only as a
hang guard."""

from __future__ import annotations

import base64
import gc
import json
import os
import socket
import threading
import weakref
from pathlib import Path

import pytest
from conftest import train_tokenizer
from serving import KEY, Server, post
from test_images import Pictures, dripping, encoded, picture

HANG_GUARD = 120  # seconds: a bound no healthy run comes near, even on a busy machine
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# Qwen-VL's chat template for text and image parts: each image is <|vision_start|><|image_pad|><|vision_end|>
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] in ('image', 'image_url') %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    """A random-weight Qwen2.5-VL checkpoint with its image processor config and a tokenizer that
    holds the vision tokens."""
    import torch
    from test_models_qwen_vl import TEXT, VISION
    from tokenizers import Tokenizer
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    folder = tmp_path_factory.mktemp("qwen2_5_vl_server")
    train_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TEMPLATE}))
    image, video, start, end = (tokenizer.token_to_id(t) for t in VISION_TOKENS)
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=image, video_token_id=video,
                              vision_start_token_id=start, vision_end_token_id=end)
    Qwen2_5_VLForConditionalGeneration(config).float().eval().save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(vlm):
    """Image URLs fetched, 127.0.0.1 allowed by name, within 3 s; 3 images and 20,000 pixels a request."""
    s = Server(["-m", str(vlm), "--dtype", "float32", "--api-key", KEY, "--allow-image-urls",
                "--allow-image-hosts", "127.0.0.1", "--image-url-timeout", "3", "--images-per-request", "3",
                "--pixels-per-request", "20000"])
    yield s
    s.stop()


@pytest.fixture
def pictures():
    server = Pictures()
    yield server
    server.close()


def messages(*urls: str) -> dict:
    """A body of one user message showing images at `urls` (what /tokenize takes)."""
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": "What?"}]
    return {"messages": [{"role": "user", "content": content}]}


def chat(*urls: str) -> dict:
    return {**messages(*urls), "max_tokens": 1}


def anthropic(*urls: str) -> dict:
    content = [*({"type": "image", "source": {"type": "url", "url": u}} for u in urls), {"type": "text", "text": "?"}]
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def inline(width: int = 40, height: int = 30) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(picture(width, height))).decode()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_image_urls_to_this_machine_are_not_fetched(server, pictures):
    """Loopback by name and by IPv6, a private and the metadata address, a closed port, and a
    redirect from the allowed host to `localhost`: each a 400 in the API's own shape (OpenAI's,
    Anthropic's) with the same words, so a client cannot scan the server's ports or network. The
    host allowed by name is fetched; the picture server is asked for the redirect alone."""
    p = pictures.port
    status, body, _ = post(server.url, messages(f"http://127.0.0.1:{p}/a.png"), path="/tokenize")
    assert status == 200 and body["count"] > 16, body  # its tokens counted: the image was fetched
    pictures.asked.clear()
    urls = [f"http://localhost:{p}/a.png", f"http://[::1]:{p}/a.png", "http://10.0.0.1/a.png",
            "http://169.254.169.254/latest/meta-data/", f"http://localhost:{closed_port()}/a.png",
            f"http://127.0.0.1:{p}/to?url=http://localhost:{p}/a.png"]
    said = set()
    for url in urls:
        status, body, _ = post(server.url, chat(url))
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        said.add(body["error"]["message"])
        status, body, _ = post(server.url, anthropic(url), path="/v1/messages")
        assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        said.add(body["error"]["message"])
    assert len(said) == 1 and "not fetched" in said.pop()
    assert pictures.asked == [f"/to?url=http://localhost:{p}/a.png"] * 2


def test_a_dripping_sender_is_a_400_at_the_bound(server):
    """A sender that drips its body a byte at a time (never quiet long enough for a read to time
    out) is cut off at --image-url-timeout: a 400 naming the bound, not a request held for as long
    as the sender likes (here: until the test ends)."""
    with dripping("body") as port:
        status, body, _ = post(server.url, chat(f"http://127.0.0.1:{port}/slow.png"))
    assert status == 400 and "not fetched" in body["error"]["message"] and "3 s" in body["error"]["message"]


def test_a_requests_images_are_bounded_in_count_and_pixels(server):
    """--images-per-request and --pixels-per-request: 400s naming the limit, in each API's shape."""
    status, body, _ = post(server.url, chat(*[inline(8, 8)] * 4))
    assert status == 400 and "4 images; at most 3" in body["error"]["message"], body
    big = inline(120, 100)  # 12,000 pixels: one is within the request's 20,000, two are not
    status, body, _ = post(server.url, chat(big, big))
    assert status == 400 and "over 20,000 pixels together" in body["error"]["message"], body
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": big.partition(",")[2]}}] * 2
    status, body, _ = post(server.url, {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [*blocks, {"type": "text", "text": "?"}]}]}, path="/v1/messages")
    assert status == 400 and "over 20,000 pixels together" in body["error"]["message"], body
    assert post(server.url, messages(big), path="/tokenize")[0] == 200


def test_image_downloads_never_hold_the_workers_others_need(vlm, pictures):
    """As many downloads as asyncio's shared worker pool has threads (what /tokenize, token counts
    and inline images run on), each held by its sender until the test lets go: the server takes
    a few on its own download threads and answers the rest 503 with Retry-After, and meanwhile
    /tokenize, Anthropic's count_tokens and a chat with an inline image are answered. Then the
    held downloads finish."""
    workers = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default, asyncio's shared pool
    server = Server(["-m", str(vlm), "--dtype", "float32", "--api-key", KEY, "--allow-image-urls",
                     "--allow-image-hosts", "127.0.0.1", "--image-url-timeout", "600"])
    results: list = []

    def download() -> None:
        result = post(server.url, chat(f"http://127.0.0.1:{pictures.port}/held.png"))
        with pictures.arrived:
            results.append(result)
            pictures.arrived.notify_all()

    def busy() -> list:
        return [r for r in results if r[0] == 503]

    senders = [threading.Thread(target=download, daemon=True) for _ in range(workers)]
    try:
        for t in senders:
            t.start()
        with pictures.arrived:  # each download is either held by its sender or refused
            assert pictures.arrived.wait_for(lambda: len(pictures.asked) + len(busy()) == workers, HANG_GUARD)
        status, body, _ = post(server.url, {"content": "Hello there"}, path="/tokenize")
        assert status == 200 and body["count"] > 0, body
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": inline().partition(",")[2]}}
        status, body, _ = post(server.url, {"model": "m", "messages": [{"role": "user", "content": [
            block, {"type": "text", "text": "What?"}]}]}, path="/v1/messages/count_tokens")
        assert status == 200 and body["input_tokens"] > 16, body
        assert post(server.url, chat(inline()))[0] == 200
        assert busy() and all(r[1]["error"]["type"] == "server_busy" and "retry-after" in map(str.lower, r[2])
                              for r in busy())
        pictures.release.set()
        for t in senders:
            t.join(HANG_GUARD)
        assert sorted(r[0] for r in results) == [200] * len(pictures.asked) + [503] * len(busy())
    finally:
        pictures.release.set()
        server.stop()


def test_a_requests_images_are_decoded_one_at_a_time(vlm, monkeypatch):
    """A request of three images holds them encoded: each is decoded when the model's image
    processor needs its pixels, and let go before the next is decoded, so a request's peak memory
    is one image's decode. Checked on the decoded images the processor is handed: when it is
    handed one, none handed before is still alive."""
    import mlxinfer
    from mlxinfer.engine.batch import BatchGenerator

    model, tokenizer = mlxinfer.load(vlm, dtype="float32")
    processor, alive, handed = model.image_processor, [], []

    class Watched:
        """The model's image processor, noting which images it was handed are still alive."""

        def __getattr__(self, name):
            return getattr(processor, name)

        def __call__(self, image):
            gc.collect()
            alive.append(sum(r() is not None for r in handed))
            handed.append(weakref.ref(image))
            return processor(image)

    monkeypatch.setattr(model, "image_processor", Watched())
    engine = BatchGenerator(model, tokenizer)
    request = engine.request(messages(*[inline(300 + i, 200) for i in range(3)])["messages"])
    engine.prepare(request)
    assert alive == [0, 0, 0]


def test_allowed_image_hosts_need_image_urls(tmp_path):
    """--allow-image-hosts widens where image URLs may be fetched from: alone it would fetch
    nothing, so it is a usage error naming the flag it needs, before any model is loaded."""
    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    result = CliRunner().invoke(main, ["serve", "--allow-image-hosts", "localhost", "-m", str(tmp_path / "none")])
    assert result.exit_code == 2 and "pass --allow-image-urls too" in result.output and "Traceback" not in result.output
