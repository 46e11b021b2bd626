"""The image stage against transformers' own image processors (their PIL backends), on
processor configs those classes save: the same pixel tensors within 1e-6, the same grids and
token counts; and bad images refused in one line."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import struct
import warnings
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from mlxinfer.base.errors import ConfigError, ImageError
from mlxinfer.text.images import ImageLimits, decode_image, load_image, read_image_processor

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
    """An http URL (a server on 127.0.0.1, allowed by name) is fetched only when HTTP is among the
    sources, and a body over the byte bound is not fetched, in the same words as a missing one."""
    import functools
    import http.server
    import threading

    from mlxinfer.text.images import DATA, HTTP

    raw = encoded(picture(33, 22, seed=9))
    (tmp_path / "a.png").write_bytes(raw)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = ImageLimits(allowed_hosts=frozenset({"127.0.0.1"}))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
        one_line_error(url, "not fetched here", sources=frozenset({DATA}), limits=local)
        got = load_image(url, sources=frozenset({DATA, HTTP}), limits=local)
        assert np.array_equal(np.asarray(got), np.asarray(picture(33, 22, seed=9)))
        small = ImageLimits(max_bytes=100, allowed_hosts=frozenset({"127.0.0.1"}))
        with pytest.raises(ImageError) as too_big:
            load_image(url, sources=frozenset({HTTP}), limits=small)
        with pytest.raises(ImageError) as missing:
            load_image(url + ".missing", sources=frozenset({HTTP}), limits=small)
        assert "not fetched" in str(too_big.value) and "100 bytes" in str(too_big.value)
        assert str(too_big.value) == str(missing.value)  # said once, the same whatever went wrong
    finally:
        server.shutdown()


# ---- image URLs: the address rule, one deadline, the same words for every failure ----

HANG_GUARD = 60  # seconds: only a bound on a test that would otherwise hang (no healthy run comes near it)
LOCAL = frozenset({"127.0.0.1"})


class Pictures:
    """A loopback HTTP server: /a.png is a picture, /held.png the same once `release` is set,
    /to?url=U redirects to U, anything else a 404. `asked` lists the paths it was asked for, in
    order; `arrived` is notified as each is."""

    def __init__(self):
        import http.server
        import threading
        import urllib.parse

        self.raw, self.asked = encoded(picture(20, 10, seed=3)), []
        self.arrived, self.release = threading.Condition(), threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                with outer.arrived:
                    outer.asked.append(self.path)
                    outer.arrived.notify_all()
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                if self.path in ("/a.png", "/held.png"):
                    if self.path == "/held.png":
                        outer.release.wait(HANG_GUARD)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(outer.raw)))
                    self.end_headers()
                    self.wfile.write(outer.raw)
                elif "url" in query:
                    self.send_response(302)
                    self.send_header("Location", query["url"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_error(404)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def dripping(where: str) -> Iterator[int]:
    """A loopback port whose one connection answers a byte every 20 ms, never quiet long enough
    for a read to time out: its status line on (`where` "headers"), or after its headers a body
    of a megabyte ("body"), until the block ends."""
    import socket
    import threading

    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            if where == "body":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000000\r\n\r\n")
            while not stop.wait(0.02):
                conn.sendall(b"H" if where == "headers" else b"\x00")

    threading.Thread(target=drip, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


@pytest.fixture
def pictures():
    server = Pictures()
    yield server
    server.close()


def fetched(url: str, limits: ImageLimits):
    """`load_image(url)` with http allowed: the image, or the ImageError it raised."""
    from mlxinfer.text.images import HTTP

    try:
        return load_image(url, limits, frozenset({HTTP}))
    except ImageError as e:
        assert "\n" not in str(e)
        return e


def resolving(monkeypatch, names: dict[str, list[str]]) -> list[str]:
    """DNS in this process with `names` resolving to their addresses (one list per lookup, the
    last repeated), others as before; returns the names looked up, in order."""
    import socket

    real, asked = socket.getaddrinfo, []

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            return real(host, port, *args, **kwargs)
        asked.append(host)
        address = names[host][min(asked.count(host), len(names[host])) - 1]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port) if family == socket.AF_INET
                 else (address, port, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.10", "10.1.2.3", "172.16.0.1", "192.168.1.1",
                                     "169.254.169.254", "169.254.170.2", "100.100.100.200", "192.0.0.192", "0.0.0.0",
                                     "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fd00:ec2::254",
                                     "::ffff:127.0.0.1", "::ffff:169.254.169.254", "2002:7f00:1::", "64:ff9b::a00:1",
                                     "ff02::1"])
def test_addresses_that_are_not_public(address):
    """Loopback, private, link-local (the cloud metadata services: AWS, ECS, Oracle, Alibaba,
    AWS over IPv6), shared, unspecified, broadcast, multicast, and IPv6 forms carrying such an
    IPv4 address (mapped, 6to4, NAT64) are not public (RFC 6890's special-purpose registries)."""
    import ipaddress

    from mlxinfer.text.fetch import public_address

    assert not public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "93.184.215.14", "2606:4700:4700::1111",
                                     "2a00:1450:4001:80b::200e"])
def test_public_addresses(address):
    import ipaddress

    from mlxinfer.text.fetch import public_address

    assert public_address(ipaddress.ip_address(address))


def test_image_urls_to_local_addresses_are_not_fetched(pictures, monkeypatch, caplog):
    """Without the user's allowance no URL reaches this machine's own servers or its network's:
    by address (IPv4, IPv6, decimal), by `localhost`, by a name that resolves to loopback, or by a
    redirect from an allowed host to loopback; a closed port and an open one read the same. Every
    refusal is the same words; the log says why. The picture server is asked for nothing but the
    redirects, and only the name allowed is fetched."""
    p = pictures.port
    resolving(monkeypatch, {"images.example": ["127.0.0.1"], "public.example": ["127.0.0.1"]})
    limits = ImageLimits(url_seconds=HANG_GUARD, allowed_hosts=frozenset({"public.example"}))
    assert np.array_equal(np.asarray(fetched(f"http://public.example:{p}/a.png", limits)),
                          np.asarray(picture(20, 10, seed=3)))
    pictures.asked.clear()
    urls = [f"http://127.0.0.1:{p}/a.png", f"http://localhost:{p}/a.png", f"http://[::1]:{p}/a.png",
            f"http://2130706433:{p}/a.png", f"http://0.0.0.0:{p}/a.png", "http://10.0.0.1/a.png",
            "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/latest/meta-data/",
            f"http://images.example:{p}/a.png", f"http://localhost:{free_port()}/a.png",
            f"http://public.example:{p}/to?url=http://127.0.0.1:{p}/a.png",
            f"http://public.example:{p}/to?url=http://localhost:{p}/a.png"]
    with caplog.at_level("WARNING", logger="mlxinfer.text.images"):
        errors = [fetched(url, limits) for url in urls]
    assert all(isinstance(e, ImageError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "not fetched" in str(errors[0])
    assert pictures.asked == [f"/to?url=http://127.0.0.1:{p}/a.png", f"/to?url=http://localhost:{p}/a.png"]
    # refused for their addresses, before any connection: a closed port is never tried either
    assert sum("not a public address" in r.getMessage() for r in caplog.records) == len(urls)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fetch_that_fails_says_only_that_it_was_not_fetched(pictures):
    """From an allowed host too, a missing file, a closed port, a redirect loop and a body over
    the byte bound read the same to the client: nothing tells one network state from another."""
    p = pictures.port
    limits = ImageLimits(max_bytes=100_000, url_seconds=HANG_GUARD, allowed_hosts=LOCAL)
    loop = f"http://127.0.0.1:{p}/to?url=/to?url=/to?url=/to?url=/to?url=/to?url=/to?url=/a.png"
    errors = [fetched(url, limits) for url in (f"http://127.0.0.1:{p}/missing.png", f"http://127.0.0.1:{free_port()}/",
                                               loop, "ftp://127.0.0.1/a.png")]
    errors.append(fetched(f"http://127.0.0.1:{p}/a.png", ImageLimits(max_bytes=50, allowed_hosts=LOCAL,
                                                                    url_seconds=HANG_GUARD)))
    assert all(isinstance(e, ImageError) for e in errors[:3] + errors[4:]), errors
    assert len({str(e) for e in errors[:3]}) == 1 and "not fetched" in str(errors[0])
    assert "not fetched" in str(errors[4]) and "50 bytes" in str(errors[4])
    assert not isinstance(fetched(f"http://127.0.0.1:{p}/to?url=/a.png", limits), ImageError)  # one redirect is fine


def test_the_checked_address_is_the_one_connected_to(pictures, monkeypatch):
    """DNS rebinding: a name that resolves to a public address when checked and to loopback
    after is looked up once, and the connection goes to the public address it was checked at
    (here refused: this test has no network), never to the loopback server."""
    import socket

    asked = resolving(monkeypatch, {"rebind.example": ["93.184.215.14", "127.0.0.1"]})
    tried = []
    connect = socket.socket.connect

    def recorded(self, address):
        tried.append(address[0])
        if address[0] != "127.0.0.1":
            raise ConnectionRefusedError("no network in this test")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", recorded)
    error = fetched(f"http://rebind.example:{pictures.port}/a.png", ImageLimits(url_seconds=HANG_GUARD))
    assert isinstance(error, ImageError) and "not fetched" in str(error)
    assert asked == ["rebind.example"] and tried == ["93.184.215.14"] and pictures.asked == []


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_dripping_sender_is_cut_at_the_deadline(where):
    """A sender that drips a byte at a time, in its headers or its body, never letting a read
    time out, is cut off at the request's deadline (0.5 s), not after some large read fills;
    the refusal names the bound. Bounded here only by the hang guard."""
    import threading

    got: list = []
    with dripping(where) as port:
        worker = threading.Thread(target=lambda: got.append(fetched(
            f"http://127.0.0.1:{port}/slow.png", ImageLimits(url_seconds=0.5, allowed_hosts=LOCAL))))
        worker.start()
        worker.join(HANG_GUARD)
        assert not worker.is_alive(), "the download was not cut off"
    assert isinstance(got[0], ImageError) and "not fetched" in str(got[0]) and "0.5 s" in str(got[0])


# ---- a request's images: how many, their pixels together, read before anything is decoded ----

def chat_with(images: list) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                          {"type": "text", "text": "What are these?"}]}]


def test_a_requests_images_are_bounded_before_any_is_decoded():
    """Eight PNGs of 64 megapixels each (headers only: 45 bytes apiece, as small PNGs of a flat
    colour nearly are) are refused from their headers by the request's pixel bound, not decoded
    (they hold no pixels: decoding one fails otherwise); 17 images, by the count. A request within
    both bounds reads its images without decoding them."""
    from mlxinfer.engine.request import Request

    with pytest.raises(ImageError, match="over 128,000,000 pixels together") as e:
        Request.of(chat_with([png_header(8000, 8000)] * 8))
    assert "\n" not in str(e.value)
    with pytest.raises(ImageError, match="17 images; at most 16"):
        Request.of(chat_with([encoded(picture(8, 8))] * 17))
    small = ImageLimits(max_images=2, max_request_pixels=100)
    with pytest.raises(ImageError, match="3 images; at most 2"):
        Request.of(chat_with([encoded(picture(4, 4))] * 3), image_limits=small)
    with pytest.raises(ImageError, match="over 100 pixels together"):
        Request.of(chat_with([encoded(picture(8, 8)), encoded(picture(7, 7))]), image_limits=small)
    assert len(Request.of(chat_with([png_header(8000, 8000)] * 2)).images) == 2
