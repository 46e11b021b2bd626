"""Images through the whole request path on a random-weight Qwen2.5-VL built by transformers, with
the real Qwen3 tokenizer from npm (it has the Qwen vision tokens) and an image processor config
saved by transformers' Qwen2-VL image processor with non-default min/max pixels.

transformers' Qwen2.5-VL processor cannot be built here (its video half needs torchvision), so the
oracle's inputs are made as that processor makes them: its image processor's pixels and grids, the
chat template rendered by transformers' tokenizer, each `<|image_pad|>` repeated grid.prod() /
merge² times, then encoded. Our greedy tokens must equal transformers' `generate` from those."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_speculation_equals, encoded_images, perturb
from test_images_engine import data_url, our_greedy
from test_models_gemma_vision import picture
from test_models_qwen_vl import TEXT, VISION

from mlxinfer.engine.batch import BatchGenerator
from mlxinfer.engine.generate import stream_generate
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.engine.prompt_file import save_prompt_cache
from mlxinfer.engine.chat import ChatSession
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.loading.model import load
from mlxinfer.engine.pool import PromptCachePool

from PIL import Image  # noqa: E402

STEPS = 6
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 20 * 28 * 28
# Qwen2-VL's chat template (Qwen2.5-VL ships the same), without its video branch.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or "
    "'image_url' in content %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(qwen3_tokenizer, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, \
        Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
           for name in ("image_pad", "video_pad", "vision_start", "vision_end")}
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config={**TEXT, "vocab_size": 151_936}, vision_config=VISION,
                              image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                              vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                              initializer_range=0.08)
    config.text_config.initializer_range = config.vision_config.initializer_range = 0.08
    model = Qwen2_5_VLForConditionalGeneration(config).float().eval()
    perturb(model, 0)
    folder = tmp_path_factory.mktemp("qwen2_5_vl_engine")
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(checkpoint), Qwen2VLImageProcessorPil.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load(checkpoint, dtype="float32")


def hf_greedy(hf, messages: list[dict], steps: int = STEPS) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) as Qwen2.5-VL's processor and transformers' generate make them."""
    model, tokenizer, processor = hf
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    out = processor(images=images, return_tensors="pt") if images else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split("<|image_pad|>")
    counts = [int(g.prod()) // processor.merge_size**2 for g in out.get("image_grid_thw", [])]
    text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    pixels = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
    with torch.no_grad():
        gen = model.generate(input_ids=ids, **pixels, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return ids[0].tolist(), gen[0, ids.shape[1]:].tolist()


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": p} if isinstance(p, Image.Image) else
                                        {"type": "text", "text": p} for p in parts]}


def test_conversation_with_two_images_equals_transformers(ours, hf):
    """Two images of other sizes (resized within the config's min/max pixels), chunks of 16 tokens
    cutting through them: the ids are the processor's and the greedy tokens transformers'."""
    model, tokenizer = ours
    messages = [user(picture(0, (60, 90)), "What is this?"), {"role": "assistant", "content": "A picture."},
                user("And this one?", picture(1, (200, 40)))]
    ids, want = hf_greedy(hf, messages)
    engine = BatchGenerator(model, tokenizer, max_batch=1)
    assert engine.prepare(engine.request(messages)).ids == ids
    assert our_greedy(model, tokenizer, messages, STEPS, prefill_step=16) == want


def test_server_answers_images_and_text_as_transformers(checkpoint, hf):
    """`mlxinfer serve` on a Qwen2.5-VL folder, through the official openai client: a chat with an
    image (a data: URL) and one of text alone each get transformers' greedy reply. The model is
    loaded on the server's main thread and run on its engine thread: an array it held unevaluated
    belonged to the loading thread's stream, and every request was a 500."""
    import openai
    from serving import KEY, Server

    server = Server(["-m", str(checkpoint), "--dtype", "float32", "--api-key", KEY])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        image = picture(12, (56, 84))
        for asked, sent in (
            (user(image, "What is in this picture?"),
             [{"type": "image_url", "image_url": {"url": data_url(image)}},
              {"type": "text", "text": "What is in this picture?"}]),
            (user("Hello there."), "Hello there."),
        ):
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": sent}],
                                                   max_tokens=STEPS, temperature=0, logprobs=True,
                                                   extra_body={"return_tokens_as_token_ids": True})
            want = hf_greedy(hf, [asked])[1]
            ids = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
            assert ids and ids == want[:len(ids)]  # transformers' reply goes on past an EOS, where ours may stop
            assert ids == want or reply.choices[0].finish_reason == "stop"
    finally:
        server.stop()


def test_pool_reuses_only_the_same_pixels(ours, hf, monkeypatch):
    """Same text, another picture: only the text before it is reused. The same picture again reuses
    the whole prompt and is not encoded again; a conversation going on after it encodes only its
    new picture. Every answer is transformers' (and the reused one's log-probabilities the first's)."""
    model, tokenizer = ours
    pool = PromptCachePool(1 << 30)
    engine = BatchGenerator(model, tokenizer, max_batch=1, pool=pool)
    encoded = encoded_images(monkeypatch, model, "image_features")

    def run(messages) -> list[tuple[int, float]]:
        engine.submit(messages, max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        return [(c.token, c.logprob) for _, c in engine.stream() if c.token is not None]

    a, b = picture(2, (56, 84)), picture(3, (56, 84))
    ids, want_a = hf_greedy(hf, [user(a, "Describe it.")])
    first = run([user(a, "Describe it.")])
    assert [t for t, _ in first] == want_a
    second = run([user(b, "Describe it.")])
    assert [t for t, _ in second] == hf_greedy(hf, [user(b, "Describe it.")])[1] and second != first
    assert pool.stats.hits == 1 and 0 < pool.stats.reused_tokens <= ids.index(model.image_token_id)
    assert len(encoded) == 2 and encoded[0] != encoded[1]
    reused = pool.stats.reused_tokens
    third = run([user(a, "Describe it.")])
    assert [t for t, _ in third] == want_a
    np.testing.assert_allclose([lp for _, lp in third], [lp for _, lp in first], atol=1e-4)
    assert pool.stats.reused_tokens - reused == len(ids) - 1
    assert len(encoded) == 2  # the whole prompt was reused: its image was not encoded again
    conversation = [user(a, "Describe it."), {"role": "assistant", "content": "A picture."},
                    user("And this one?", picture(8, (84, 56)))]
    assert [t for t, _ in run(conversation)] == hf_greedy(hf, conversation)[1]
    assert len(encoded) == 3 and encoded[2] not in encoded[:2]  # only the new picture


def test_inspect_shows_the_image_stage(checkpoint, hf, tmp_path):
    """Patches, tokens and M-RoPE positions of the image, as transformers' processor and get_rope_index
    give them; the first step's choice is transformers' greedy token."""
    import json

    from click.testing import CliRunner

    from mlxinfer.cli.main import main

    image = picture(4, (60, 150))
    path = tmp_path / "wide.png"
    image.save(path)
    result = CliRunner().invoke(main, ["inspect", "What is this?", "-m", str(checkpoint), "--dtype", "float32",
                                       "--image", str(path), "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    model, tokenizer, processor = hf
    grid = processor(images=[image], return_tensors="np")["image_grid_thw"][0].tolist()
    ids, want = hf_greedy(hf, [user(image, "What is this?")])
    seen = report["images"]["images"][0]
    assert seen["grid_thw"] == grid and seen["tokens"] == grid[1] * grid[2] // 4
    start = ids.index(model.config.image_token_id)
    assert seen["span"] == [start, start + seen["tokens"]]
    mask = torch.tensor([[int(t == model.config.image_token_id) for t in ids]])
    positions, delta = model.model.get_rope_index(torch.tensor([ids]), mm_token_type_ids=mask,
                                                  image_grid_thw=torch.tensor([grid]))
    span = positions[:, 0, start:start + seen["tokens"]]
    assert seen["positions"] == {axis: [int(span[i].min()), int(span[i].max())] for i, axis in enumerate("thw")}
    assert report["images"]["position_delta"] == int(delta[0, 0])
    assert report["steps"][0]["chosen"]["id"] == want[0]
    text = CliRunner().invoke(main, ["inspect", "What is this?", "-m", str(checkpoint), "--image", str(path),
                                     "--steps", "1"])
    assert "0. images" in text.stdout and f"{seen['tokens']} tokens at" in text.stdout


def test_batched_image_requests_equal_alone(ours, hf):
    """Two requests with other pictures (other position deltas) decoded in one batch, beside a text one."""
    model, tokenizer = ours
    engine = BatchGenerator(model, tokenizer, max_batch=3)
    asks = [[user(picture(5, (56, 56)), "Describe it.")], [user("Hello there.")],
            [user(picture(6, (120, 40)), "Describe it.")]]
    uids = [engine.submit(m, max_tokens=STEPS, temperature=0.0, ignore_eos=True) for m in asks]
    got: dict[int, list[int]] = {uid: [] for uid in uids}
    for uid, chunk in engine.stream():
        if chunk.token is not None:
            got[uid].append(chunk.token)
    assert engine.stats.max_batch_seen == 3
    for i in (0, 2):
        assert got[uids[i]] == hf_greedy(hf, asks[i])[1]
    assert got[uids[1]] == our_greedy(model, tokenizer, asks[1], STEPS)


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_speculation_after_images_equals_plain_and_transformers(ours, hf, drafter, tmp_path):
    """Greedy speculative decoding after a prompt with an image: drafts are verified, accepted and
    rolled back through caches whose positions run on at the image's M-RoPE delta. The draft model
    proposes transformers' own continuation but one token, so it is both accepted and rejected."""
    model, tokenizer = ours
    messages = [user(picture(7, (84, 140)), "Describe it, then say it again.")]
    steps = 16  # past the chooser's first speculative probe and its plain one
    ids, want = hf_greedy(hf, messages, steps)
    assert_speculation_equals(want, drafter, model, tokenizer, messages, ids[-1], tmp_path, 151_936, hf[1])


def test_undo_of_image_turns_equals_a_fresh_session(ours, hf):
    """A chat undone back to text alone prefills again what it must with no M-RoPE delta left by
    the image; one undone while an image stays reuses its cache up to where the two conversations
    part. Each reply is transformers' and, log-probabilities too, a fresh session's."""
    model, tokenizer = ours
    system = "Be brief."
    options = {"max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}

    def send(session, text, images=()):
        chunks = [c for c in session.send(text, images) if c.token is not None]
        return [c.token for c in chunks], [c.logprob for c in chunks], chunks[-1].stats

    def same(got, want):
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], atol=1e-4)

    def fresh(*turns):
        session = ChatSession(model, tokenizer, system, **options)
        return [send(session, *turn) for turn in turns]

    pic = picture(9, (56, 84))
    [hello] = fresh(("Hello there.",))
    for undone in ([("Describe it.", [pic])], [("Describe it.", [pic]), ("And then?",)]):
        session = ChatSession(model, tokenizer, system, **options)
        for turn in undone:
            send(session, *turn)
        for _ in undone:
            session.undo()
        same(send(session, "Hello there."), hello)

    straight = fresh(("Describe it.", [pic]), ("Say more.",))
    conversation = [{"role": "system", "content": system}, user(pic, "Describe it."),
                    {"role": "assistant", "content": tokenizer.decode(straight[0][0])}, user("Say more.")]
    assert straight[1][0] == hf_greedy(hf, conversation)[1]
    session = ChatSession(model, tokenizer, system, **options)
    send(session, "Describe it.", [pic])
    send(session, "And then?")
    session.undo()
    again = send(session, "Say more.")
    same(again, straight[1])
    assert again[2].prefill_tokens <= straight[1][2].prefill_tokens  # the image turn was not run again


def test_a_cache_holding_an_image_is_refused_by_save_prompt_cache(ours, tmp_path):
    """Its image tokens are keys of the pixels, not token ids: one line saying so, no file."""
    model, tokenizer = ours
    cache = PromptCache.for_model(model)
    list(stream_generate(model, tokenizer, [user(picture(10, (56, 56)), "Describe it.")], cache, max_tokens=2))
    assert min(cache.tokens) < 0
    with pytest.raises(InvalidOptionError, match="^a prompt cache that holds an image cannot be saved"):
        save_prompt_cache(tmp_path / "c.safetensors", cache)
    assert not list(tmp_path.iterdir())


def test_a_prompts_inputs_are_let_go_once_it_is_prefilled(ours, monkeypatch):
    """The whole prompt's embeddings (images in) serve its prefill only, not each decode step."""
    model, tokenizer = ours
    made = []
    embedded = model.embedded

    def keeping(*args):
        made.append(weakref.ref(out := embedded(*args)))
        return out

    monkeypatch.setattr(model, "embedded", keeping)
    engine = BatchGenerator(model, tokenizer, max_batch=1)
    engine.submit([user(picture(11, (56, 56)), "Describe it.")], max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    stream = engine.stream()
    next(c for _, c in stream if c.token is not None)
    gc.collect()
    assert len(made) == 1 and made[0]() is None  # decoding on without them
    assert sum(1 for _, c in stream if c.token is not None) == STEPS - 1
