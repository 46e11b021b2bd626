"""The image stage against transformers' own image processors (their PIL backends), on
processor configs those classes save: the same pixel tensors within 1e-6, the same grids and
token counts; and bad images refused in one line."""

from __future__ import annotations

import base64
import io
import json
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from mlxinfer.errors import ConfigError, ImageError
from mlxinfer.images import ImageLimits, decode_image, load_image, read_image_processor

transformers = pytest.importorskip("transformers")
from transformers import Gemma3ImageProcessorPil, Qwen2VLImageProcessorPil  # noqa: E402


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A noisy picture with smooth parts too, so every resampling filter has work to do."""
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    y, x = np.mgrid[0:height, 0:width]
    smooth = ((x * 255 // max(width - 1, 1) + y * 127 // max(height - 1, 1)) % 256).astype(np.uint8)
    noise = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    data = np.where(rng.random((height, width, 1)) < 0.5, smooth[..., None], noise).astype(np.uint8)
    if channels == 1:
        return Image.fromarray(data[..., 0], mode="L") if mode == "L" else Image.fromarray(data[..., 0]).convert(mode)
    return Image.fromarray(data, mode=mode)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


SIZES = [(224, 224), (640, 480), (37, 501), (1000, 90), (31, 29), (300, 2000)]

QWEN_CONFIGS = [
    {},  # the class defaults (56*56 .. 28*28*1280 pixels)
    {"min_pixels": 64 * 28 * 28, "max_pixels": 256 * 28 * 28},
    {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28, "resample": 2},
    # Qwen3-VL's: 16-pixel patches, its own mean and std, sizes under `size`
    {"patch_size": 16, "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 96},
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
]


@pytest.mark.parametrize("settings", QWEN_CONFIGS, ids=["defaults", "bounded", "bilinear", "qwen3-vl"])
def test_qwen_vl_pixels_equal_transformers(tmp_path, settings):
    hf = Qwen2VLImageProcessorPil(**settings)
    hf.save_pretrained(tmp_path)
    ours = read_image_processor(tmp_path)
    assert ours is not None and ours.kind == "qwen2_vl"
    for i, (w, h) in enumerate(SIZES):
        image = picture(w, h, seed=i)
        want = hf(images=[image], return_tensors="np")
        got = ours(load_image(image))
        assert got.values.dtype == np.float32
        assert got.values.shape == want["pixel_values"].shape
        np.testing.assert_allclose(got.values, want["pixel_values"], atol=1e-6, rtol=0)
        assert list(got.grid) == want["image_grid_thw"][0].tolist()
        assert got.tokens == int(np.prod(want["image_grid_thw"][0])) // hf.merge_size**2


@pytest.mark.parametrize("size,resample", [((64, 64), 2), ((56, 80), 3), ((896, 896), 2)])
def test_gemma3_pixels_equal_transformers(tmp_path, size, resample):
    hf = Gemma3ImageProcessorPil(size={"height": size[0], "width": size[1]}, resample=resample)
    hf.save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 64}))
    ours = read_image_processor(tmp_path)
    assert ours is not None and ours.kind == "gemma3" and ours.tokens == 64
    for i, (w, h) in enumerate(SIZES[:4]):
        image = picture(w, h, seed=10 + i)
        want = hf(images=[image], return_tensors="np")["pixel_values"]
        got = ours(load_image(image))
        assert got.grid is None and got.values.shape == want.shape[1:]
        np.testing.assert_allclose(got.values, want[0], atol=1e-6, rtol=0)


def test_modes_convert_as_transformers_does(tmp_path):
    """Transparency goes onto white for a PIL image handed over (the processors' conversion);
    encoded images go through transformers' `load_image` (upright by EXIF, then RGB)."""
    from transformers.image_utils import load_image as hf_load

    hf = Qwen2VLImageProcessorPil(min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28)
    hf.save_pretrained(tmp_path)
    ours = read_image_processor(tmp_path)
    for mode in ("RGBA", "L", "LA", "P", "CMYK", "I;16"):
        image = picture(90, 70, mode="RGB", seed=3).convert(mode)
        want = hf(images=[image], return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(ours(load_image(image)).values, want, atol=1e-6, rtol=0, err_msg=mode)
    rotated = picture(80, 50, seed=4)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to view
    buf = io.BytesIO()
    rotated.save(buf, format="JPEG", exif=exif)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    want = hf(images=[hf_load(url)], return_tensors="np")["pixel_values"]
    got = ours(load_image(url))
    assert load_image(url).size == (50, 80)
    np.testing.assert_allclose(got.values, want, atol=1e-6, rtol=0)


def test_sources_load_the_same_image(tmp_path):
    image = picture(40, 30, seed=5)
    raw = encoded(image)
    path = tmp_path / "a picture.png"
    path.write_bytes(raw)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    want = np.asarray(image)
    for source in (image, raw, path, str(path), path.as_uri(), url):
        assert np.array_equal(np.asarray(load_image(source)), want), source if isinstance(source, str) else type(source)


def test_a_path_with_a_colon_is_a_file_not_a_url(tmp_path, monkeypatch):
    """Only letters, digits, '+', '-' and '.' after a first letter make a URL scheme (RFC 3986), and
    one letter is a Windows drive: ./a:b.png and a:b.png name files."""
    image = picture(20, 10, seed=3)
    (tmp_path / "a:b.png").write_bytes(encoded(image))
    monkeypatch.chdir(tmp_path)
    for source in ("./a:b.png", "a:b.png", str(tmp_path / "a:b.png")):
        assert np.array_equal(np.asarray(load_image(source)), np.asarray(image)), source
    one_line_error("ab:c.png", "scheme 'ab'")


def test_digest_tells_images_apart(tmp_path):
    Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28).save_pretrained(tmp_path)
    ours = read_image_processor(tmp_path)
    a, b = picture(64, 64, seed=1), picture(64, 64, seed=2)
    assert ours(a).digest == ours(a.copy()).digest
    assert ours(a).digest != ours(b).digest


def one_line_error(source, match: str, **kw) -> None:
    with pytest.raises(ImageError, match=match) as e:
        load_image(source, **kw)
    assert "\n" not in str(e.value)


def test_bad_images_are_refused_in_one_line(tmp_path):
    one_line_error(b"this is plain text, not a picture", "not an image")
    one_line_error(encoded(picture(64, 64))[:200], "damaged or truncated")
    one_line_error("data:image/png;base64,@@@notbase64", "not valid base64")
    one_line_error("data:image/png,rawbytes", "must be base64")
    one_line_error(tmp_path / "missing.png", "cannot read the image")
    one_line_error(encoded(picture(100, 100)), "at most 1,000 are accepted", limits=ImageLimits(max_bytes=1000))
    one_line_error(picture(100, 100), "10,000 pixels", limits=ImageLimits(max_pixels=9_999))
    one_line_error(12, "must be a PIL image")
    one_line_error("https://example.com/cat.png", "not fetched here")
    one_line_error("ftp://example.com/cat.png", "scheme 'ftp'")
    one_line_error(tmp_path / "x.png", "local image files are not accepted", sources=frozenset({"data"}))


def png_header(width: int, height: int) -> bytes:
    """A PNG that is only its header: the signature, an IHDR declaring a 1-bit grey `width` x `height`
    image, IEND (the PNG spec's chunk layout: length, type, data, CRC-32 of type and data)."""
    def chunk(kind: bytes, data: bytes = b"") -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)) + chunk(b"IEND")


def test_decompression_bomb_refused_before_decoding():
    """PNGs declaring 81 and 900 megapixels in 45 bytes: refused from their headers, by our bound
    (64 megapixels) or by Pillow's own, before anything is decoded."""
    for side, match in ((9000, "81,000,000 pixels"), (30000, "decompression bomb")):
        raw = png_header(side, side)
        assert len(raw) < 200_000
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ImageError, match=match) as e:
                decode_image(raw)
        assert "\n" not in str(e.value)


def test_processor_configs_refused_or_absent(tmp_path):
    assert read_image_processor(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(ConfigError, match="CLIPImageProcessor"):
        read_image_processor(tmp_path)
    Gemma3ImageProcessorPil(do_pan_and_scan=True).save_pretrained(tmp_path)
    gemma = read_image_processor(tmp_path)
    with pytest.raises(ImageError, match="do_pan_and_scan"):
        gemma(picture(32, 32))


def test_http_urls_only_where_allowed_and_bounded(tmp_path):
    """An http URL (a server on 127.0.0.1) is fetched only when HTTP is among the sources, and a body
    over the byte bound is cut off."""
    import functools
    import http.server
    import threading

    from mlxinfer.images import DATA, HTTP

    raw = encoded(picture(33, 22, seed=9))
    (tmp_path / "a.png").write_bytes(raw)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
        one_line_error(url, "not fetched here", sources=frozenset({DATA}))
        got = load_image(url, sources=frozenset({DATA, HTTP}))
        assert np.array_equal(np.asarray(got), np.asarray(picture(33, 22, seed=9)))
        one_line_error(url, "over 100 bytes", sources=frozenset({HTTP}), limits=ImageLimits(max_bytes=100))
        with pytest.raises(ImageError) as e:
            load_image(url, sources=frozenset({HTTP}), limits=ImageLimits(max_bytes=100))
        assert str(e.value) == "the image at the URL is over 100 bytes"  # said once, not wrapped in "cannot download"
        one_line_error(url + ".missing", "cannot download", sources=frozenset({HTTP}))
    finally:
        server.shutdown()
