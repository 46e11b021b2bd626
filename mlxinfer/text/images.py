"""The image stage: an image from wherever a user has it → checked, decoded RGB → the pixels
a vision-language checkpoint's own image processor would give (`Pixels`).

Loading is bounded before any decoding work: encoded bytes (`ImageLimits.max_bytes`) and the
pixel count the header declares (`max_pixels`, so a decompression bomb is refused before it
expands), and for a request its number of images and their pixels together; anything Pillow
cannot read as an image is refused in one line. A request holds its images encoded
(`LazyImage`) and each is decoded when the model needs its pixels, then let go, so peak memory
is one image's decode, not all of them. An http(s) URL is fetched only where a server allows
it, under `fetch`'s address rule and one deadline for the request. Encoded images are
turned upright by their EXIF orientation and converted to RGB, as transformers' `load_image`
does; a PIL image handed over as it is gets the processors' own RGB conversion (transparency
composited onto white).

Preprocessing follows the checkpoint's `preprocessor_config.json` (`read_image_processor`):
Qwen2-VL's processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `smart_resize` to a multiple of
patch × merge within [min, max] pixels, rescale, normalise, the frame repeated over the
temporal patch, patches flattened merge-window by merge-window) and Gemma 3's (SigLIP: resize
to a fixed size, rescale, normalise). The arithmetic is transformers' PIL backend's, step by
step (resize on uint8 with Pillow, rescale in float64 then float32, normalise in float32), so
the tensors are the same to the last bit; tests/test_images.py holds them to transformers'.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import logging
import math
import os
import re
import time
import urllib.parse
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from ..base.checks import integer
from ..base.errors import ConfigError, ImageError
from .fetch import NotFetched, fetch, host_keys
from ..models.vision import Pixels

log = logging.getLogger(__name__)

PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"
# Formats a picture from a user arrives in (JPEG covers MPO, what phones write); Pillow's rarer decoders (and their attack surface) stay shut.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
# Where an image may come from: inline data, a local file, the network (only where a server allows it).
DATA, FILE, HTTP = "data", "file", "http"
LOCAL = frozenset({DATA, FILE})
# RFC 3986's scheme: a letter, then letters, digits, '+', '-', '.'; a path such as ./a:b.png has none
SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on a request's images, and where an image URL may be fetched from.

    Each image: encoded bytes and decoded pixels (width x height). Each request: how many
    images, their pixels together (both read from the images' headers, before any is decoded:
    a request's images are decoded one at a time, as the model needs each, `LazyImage`), and
    the seconds its http(s) URLs may take to download, all of them together. `allowed_hosts`
    (`fetch.host_keys`) are fetched from whatever address they resolve to; any other URL only
    from a public one (`fetch.public_address`). A phone photo is 2-8 MB and 12-48 megapixels."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 64_000_000
    url_seconds: float = 10.0
    max_images: int = 16
    max_request_pixels: int = 128_000_000
    allowed_hosts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        integer("max_bytes", self.max_bytes, 1)
        integer("max_pixels", self.max_pixels, 1)
        integer("max_images", self.max_images, 1)
        integer("max_request_pixels", self.max_request_pixels, 1)
        if not (isinstance(self.url_seconds, (int, float)) and self.url_seconds > 0):
            raise ImageError(f"url_seconds must be a positive number, got {self.url_seconds!r}")
        if isinstance(self.allowed_hosts, str) or not all(isinstance(h, str) for h in self.allowed_hosts):
            raise ImageError(f"allowed_hosts must be a set of host names, got {self.allowed_hosts!r}")
        object.__setattr__(self, "allowed_hosts", host_keys(self.allowed_hosts))


LIMITS = ImageLimits()


@dataclass(frozen=True)
class LazyImage:
    """An image checked against its limits (its format and the size its header declares) and not
    yet decoded: a request holds its images so, and `rgb` decodes one when the model needs its
    pixels, so a request's images are never all decoded at once."""

    data: bytes | Image.Image  # the encoded image, or a PIL image a caller handed over as it is
    size: tuple[int, int]  # (width, height)

    def rgb(self) -> Image.Image:
        """The upright RGB pixels, as `load_image` gives them."""
        if isinstance(self.data, Image.Image):
            return _to_rgb(self.data)
        with _read_as_image():
            image = Image.open(io.BytesIO(self.data), formats=FORMATS)
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # no copy: one full-size image at a time
            return image if image.mode == "RGB" else image.convert("RGB")

    def encoded(self) -> str:
        """A data: URL `open_image` reads back to the same pixels (the bytes as they came, or a
        PIL image as lossless PNG)."""
        if isinstance(self.data, Image.Image):
            return data_url(self.rgb())
        return "data:application/octet-stream;base64," + base64.b64encode(self.data).decode()


def load_image(source: Any, limits: ImageLimits = LIMITS, sources: frozenset[str] = LOCAL) -> Image.Image:
    """An RGB image from a PIL image, encoded bytes, a path, a `data:` URL, a `file://` URL or
    (only when `sources` holds HTTP) an http(s) URL; refused in one line when it is none of them,
    is not an image, or breaks `limits`."""
    return open_image(source, limits, sources).rgb()


def open_image(source: Any, limits: ImageLimits = LIMITS, sources: frozenset[str] = LOCAL,
               deadline: float | None = None) -> LazyImage:
    """`load_image` up to the decoding: the image read (an http(s) URL's download ending by
    `deadline`, a `time.monotonic()`; by default `limits.url_seconds` from now) and its header
    checked against `limits`."""
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits)
        return LazyImage(source, source.size)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _checked(bytes(source), limits)
    if isinstance(source, os.PathLike):
        return _checked(_read_file(Path(source), limits, sources), limits)
    if not isinstance(source, str):
        raise ImageError(f"an image must be a PIL image, bytes, a path or a URL, got {type(source).__name__}")
    return _checked(image_bytes(source, limits, sources, deadline), limits)


def image_bytes(url: str, limits: ImageLimits = LIMITS, sources: frozenset[str] = LOCAL,
                deadline: float | None = None) -> bytes:
    """The encoded image a URL or path names, within `limits.max_bytes` (an http(s) URL's by `deadline`)."""
    scheme = _scheme(url)
    if scheme == "data":
        if DATA not in sources:
            raise ImageError("data: URLs are not accepted here")
        return _data_url(url, limits)
    if scheme in ("http", "https"):
        if HTTP not in sources:
            raise ImageError(f"{scheme} image URLs are not fetched here; send the image inline as a data: URL"
                             + (" (or start the server with --allow-image-urls)" if DATA in sources else ""))
        return _download(url, limits, time.monotonic() + limits.url_seconds if deadline is None else deadline)
    if scheme == "file":
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    elif scheme and len(scheme) > 1:  # "c:" is a drive, not a scheme
        raise ImageError(f"image URLs with scheme '{scheme}' are not supported; use a data: URL or a local file")
    else:
        path = Path(url).expanduser()
    return _read_file(path, limits, sources)


def decode_image(raw: bytes, limits: ImageLimits = LIMITS) -> Image.Image:
    """Decode encoded bytes to an upright RGB image, checking the declared size before decoding."""
    return _checked(raw, limits).rgb()


def _checked(raw: bytes, limits: ImageLimits) -> LazyImage:
    """Encoded bytes within the byte bound whose header names a supported format and a size
    within the pixel bound (read, not decoded: a decompression bomb is refused before it expands)."""
    if len(raw) > limits.max_bytes:
        raise ImageError(f"the image is {len(raw):,} bytes; at most {limits.max_bytes:,} are accepted")
    with _read_as_image():
        size = Image.open(io.BytesIO(raw), formats=FORMATS).size
    _check_pixels(size, limits)
    return LazyImage(raw, size)


@contextlib.contextmanager
def _read_as_image() -> Iterator[None]:
    """Pillow's ways of failing on bytes that are not a sound image, as one-line ImageErrors."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError("the image declares more pixels than it could hold (a decompression bomb); "
                         "send a smaller image") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"the data is not an image in a supported format ({', '.join(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as e:
        raise ImageError(f"the image is damaged or truncated ({_one_line(e)}); send it again") from None


def _check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width}x{height} pixels: it is empty")
    if width * height > limits.max_pixels:
        raise ImageError(f"the image is {width}x{height} = {width * height:,} pixels; at most "
                         f"{limits.max_pixels:,} are accepted; send a smaller image")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' processors make it: transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _data_url(url: str, limits: ImageLimits) -> bytes:
    """The bytes of `data:[<type>][;base64],<data>`; only base64 data carries an image."""
    head, sep, data = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise ImageError("an image data: URL must be base64, like data:image/png;base64,...")
    if len(data) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"the image is over {limits.max_bytes:,} bytes; send a smaller image")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data: URL is not valid base64") from None


def _read_file(path: Path, limits: ImageLimits, sources: frozenset[str]) -> bytes:
    if FILE not in sources:
        raise ImageError("local image files are not accepted here; send the image inline as a data: URL")
    try:
        with open(path, "rb") as f:
            raw = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise ImageError(f"cannot read the image '{path}' ({e.strerror or _one_line(e)}); check the path") from None
    if len(raw) > limits.max_bytes:
        raise ImageError(f"the image '{path}' is over {limits.max_bytes:,} bytes; use a smaller image")
    return raw


def _download(url: str, limits: ImageLimits, deadline: float) -> bytes:
    """An http(s) URL's body under `fetch`'s rules. Why it failed goes to the log; the client
    hears only that it was not fetched (the same words whatever happened), so a request cannot
    tell an open port from a closed one, or a host that answers from one that does not."""
    try:
        return fetch(url, limits.max_bytes, deadline, limits.allowed_hosts)
    except NotFetched as e:
        log.warning("image URL %s not fetched: %s", _one_line(url), _one_line(e))
        raise ImageError(f"the image URL was not fetched (only public http(s) addresses are fetched, each image "
                         f"within {limits.max_bytes:,} bytes and a request's within {limits.url_seconds:g} s); "
                         "send the image inline as a data: URL") from None


def _one_line(value: object) -> str:
    return " ".join(str(value).split())[:200]


# ---- preprocessing, as the checkpoint's image processor does it ----

QWEN_VL, GEMMA3 = "qwen2_vl", "gemma3"
KINDS = {"Qwen2VLImageProcessor": QWEN_VL, "Qwen2VLImageProcessorFast": QWEN_VL, "Qwen2VLImageProcessorPil": QWEN_VL,
         "Gemma3ImageProcessor": GEMMA3, "Gemma3ImageProcessorFast": GEMMA3, "Gemma3ImageProcessorPil": GEMMA3}


@dataclass(frozen=True)
class ImageProcessor:
    """A checkpoint's image processor settings (`read_image_processor`), and the pixels it makes.

    `kind` is QWEN_VL (dynamic resolution: `size` is (min, max) pixels) or GEMMA3 (fixed
    `size` (height, width), `tokens` soft tokens per image)."""

    kind: str
    size: tuple[int, int]
    resample: int
    do_resize: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    tokens: int = 0  # GEMMA3: soft tokens each image becomes
    pan_and_scan: bool = False

    def __call__(self, image: Image.Image) -> Pixels:
        """`image` (RGB, as `load_image` gives it) preprocessed for the model."""
        if self.pan_and_scan:
            raise ImageError("this checkpoint's preprocessor_config.json turns on do_pan_and_scan, which mlxinfer "
                             "does not run; set it to false in the file")
        if self.kind == QWEN_VL:
            return self._qwen(image)
        return self._gemma(image)

    def _qwen(self, image: Image.Image) -> Pixels:
        factor = self.patch_size * self.merge_size
        if self.do_resize:
            height, width = smart_resize(image.height, image.width, factor, *self.size)
            image = image.resize((width, height), resample=self.resample)
        if image.height % factor or image.width % factor:
            raise ImageError(f"the image is {image.width}x{image.height}; without resizing both sides must be "
                             f"multiples of {factor}")
        values = self._scaled(image)
        c, p, m, t = 3, self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = image.height // p, image.width // p
        patches = values.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        # one frame repeated over the temporal patch, as the processor pads a still image
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = np.ascontiguousarray(patches.reshape(gh * gw, c * t * p * p))
        return pixels(flat, (1, gh, gw), gh * gw // (m * m))

    def _gemma(self, image: Image.Image) -> Pixels:
        if self.do_resize:
            height, width = self.size
            image = image.resize((width, height), resample=self.resample)
        return pixels(np.ascontiguousarray(self._scaled(image)), None, self.tokens)

    def _scaled(self, image: Image.Image) -> np.ndarray:
        """[3, H, W] float32: rescaled (in float64, then float32) and normalised (in float32)."""
        values = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        if self.do_rescale:
            values = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            values = values.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            values = (values - mean) / std
        return values


def pixels(values: np.ndarray, grid: tuple[int, int, int] | None, tokens: int) -> Pixels:
    """A `Pixels` with its digest: sha256 over dtype, shape and bytes (the prompt cache's key)."""
    h = hashlib.sha256(f"{values.dtype.str}{values.shape}".encode())
    h.update(values.tobytes())
    return Pixels(values, grid, tokens, h.hexdigest())


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image is {width}x{height}; Qwen-VL models take aspect ratios up to 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def read_image_processor(folder: Path, config: Mapping[str, Any] | None = None) -> ImageProcessor | None:
    """The image processor a checkpoint folder describes (`preprocessor_config.json`, or the
    `image_processor` inside `processor_config.json`), None when it has neither. `config` (its
    config.json) gives Gemma 3's tokens per image when the processor files do not."""
    d = _processor_settings(folder)
    if d is None:
        return None
    name = d.get("image_processor_type")
    kind = KINDS.get(name)
    if kind is None:
        raise ConfigError(f"{folder / PREPROCESSOR_FILE} names image processor {name!r}; mlxinfer preprocesses "
                          f"{', '.join(sorted({k.removesuffix('Fast').removesuffix('Pil') for k in KINDS}))}")
    try:
        return _qwen_processor(d) if kind == QWEN_VL else _gemma_processor(d, folder, config or {})
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{folder / PREPROCESSOR_FILE} has a value mlxinfer cannot use ({_one_line(e)}); "
                          "fix the file") from None


def _processor_settings(folder: Path) -> dict[str, Any] | None:
    for name, key in ((PREPROCESSOR_FILE, None), (PROCESSOR_FILE, "image_processor")):
        file = folder / name
        if not file.is_file():
            continue
        try:
            d = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {file} ({_one_line(e)}); re-download it") from None
        d = d.get(key) if key and isinstance(d, dict) else d
        if isinstance(d, dict):
            return {k: v for k, v in d.items() if v is not None}  # null: the processor's default
    return None


def _common(d: Mapping[str, Any], resample: int, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    out = {"resample": int(d.get("resample", resample)), "do_resize": bool(d.get("do_resize", True)),
           "do_rescale": bool(d.get("do_rescale", True)), "rescale_factor": float(d.get("rescale_factor", 1 / 255)),
           "do_normalize": bool(d.get("do_normalize", True)),
           "mean": _triple(d.get("image_mean", mean)), "std": _triple(d.get("image_std", std))}
    if out["resample"] not in range(6):
        raise ValueError(f"resample {out['resample']} is not a Pillow filter (0-5)")
    return out


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"a mean or std needs 3 values (RGB), got {len(values)}")
    return values[0], values[1], values[2]


def _qwen_processor(d: Mapping[str, Any]) -> ImageProcessor:
    size = dict(d.get("size") or {})
    low = d.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", 56 * 56)))
    high = d.get("max_pixels", size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280)))
    p = ImageProcessor(QWEN_VL, (int(low), int(high)), patch_size=int(d.get("patch_size", 14)),
                       temporal_patch_size=int(d.get("temporal_patch_size", 2)),
                       merge_size=int(d.get("merge_size", 2)), **_common(d, Image.BICUBIC, CLIP_MEAN, CLIP_STD))
    if min(p.size) < 1 or p.size[0] > p.size[1] or min(p.patch_size, p.merge_size, p.temporal_patch_size) < 1:
        raise ValueError(f"min/max pixels {p.size} or patch sizes are out of range")
    return p


def _gemma_processor(d: Mapping[str, Any], folder: Path, config: Mapping[str, Any]) -> ImageProcessor:
    size = d.get("size") or {"height": 224, "width": 224}
    if not {"height", "width"} <= set(size):
        raise ValueError(f"size {size} has no height and width")
    tokens = d.get("image_seq_length", _processor_key(folder, "image_seq_length") or config.get("mm_tokens_per_image", 256))
    p = ImageProcessor(GEMMA3, (int(size["height"]), int(size["width"])), tokens=int(tokens),
                       pan_and_scan=bool(d.get("do_pan_and_scan", False)),
                       **_common(d, Image.BILINEAR, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)))
    if min(p.size) < 1 or p.tokens < 1:
        raise ValueError(f"size {p.size} or image_seq_length {p.tokens} is out of range")
    return p


def _processor_key(folder: Path, key: str) -> Any:
    try:
        d = json.loads((folder / PROCESSOR_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d.get(key) if isinstance(d, dict) else None


# ---- images inside chat messages ----

IMAGE_PART = "image"  # what a message keeps where an image was: {"type": "image"}, the image itself held apart


def take_images(messages: Sequence[Mapping[str, Any]], limits: ImageLimits = LIMITS,
                sources: frozenset[str] = LOCAL) -> tuple[list[Mapping[str, Any]], list[LazyImage]]:
    """Chat messages with their image parts (`{"type": "image_url", "image_url": {"url"}}`,
    `{"type": "image", "image": PIL image | path | bytes}`) read and checked, in order, and each
    part left as `{"type": "image"}`, what chat templates render as the model's image placeholder.
    Their count is checked before any is read, their pixels together as each header is read (none
    is decoded here), and their URLs' downloads share one deadline."""
    count = sum(1 for m in messages for _ in _image_parts(m))
    if count > limits.max_images:
        raise ImageError(f"the request has {count} images; at most {limits.max_images} are accepted in one "
                         "request; send fewer")
    deadline = time.monotonic() + limits.url_seconds
    out, images, pixels = [], [], 0
    for message in messages:
        if next(_image_parts(message), None) is None:
            out.append(message)
            continue
        parts = []
        for part in message["content"]:
            if _is_image(part):
                image = open_image(_image_source(part), limits, sources, deadline)
                pixels += image.size[0] * image.size[1]
                if pixels > limits.max_request_pixels:
                    raise ImageError(f"the request's images are over {limits.max_request_pixels:,} pixels together "
                                     f"(its first {len(images) + 1} are {pixels:,}); send fewer or smaller images")
                images.append(image)
                parts.append({"type": IMAGE_PART})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def _image_parts(message: Any) -> Iterator[Mapping[str, Any]]:
    """A chat message's image parts, in order (none for text, or for what is not a message)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    return (p for p in content if _is_image(p)) if isinstance(content, list) else iter(())


def has_images(prompt: Any) -> bool:
    """Whether a prompt is chat messages with an image part in them."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        return False
    return any(next(_image_parts(m), None) is not None for m in prompt)


def downloads(prompt: Any, sources: frozenset[str]) -> bool:
    """Whether loading a prompt's images downloads one: an http(s) image URL, where `sources`
    allow them (elsewhere one is refused at once)."""
    if HTTP not in sources or not has_images(prompt):
        return False
    named = (p.get("image_url", p.get("image")) for m in prompt for p in _image_parts(m))
    return any(_scheme(url.get("url") if isinstance(url, Mapping) else url) in ("http", "https") for url in named)


def _scheme(url: Any) -> str:
    """A URL's scheme in lower case ("" for a path, or for what is not a string)."""
    return m.group(1).lower() if isinstance(url, str) and (m := SCHEME.match(url)) else ""


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in ("image", "image_url")


def _image_source(part: Mapping[str, Any]) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        if not isinstance(url, str):
            raise ImageError('an image_url part needs {"image_url": {"url": "data:image/...;base64,..."}}')
        return url
    if "image" not in part:
        raise ImageError('an image part needs {"image": <PIL image, path or bytes>}')
    return part["image"]


def data_url(image: Image.Image) -> str:
    """A lossless PNG data: URL of an RGB image (`load_image` reads back the same pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def expand_placeholders(text: str, images: Sequence[Pixels], processor: ImageProcessor, image_token: str) -> str:
    """The rendered prompt with each image's placeholder expanded to its tokens, as the HF
    processor does: Qwen-VL's `<|image_pad|>` repeated `tokens` times; Gemma 3's
    `<start_of_image>` becoming "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n"."""
    placeholder = QWEN_PLACEHOLDER if processor.kind == QWEN_VL else GEMMA_PLACEHOLDER
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise ImageError(f"the prompt has {len(pieces) - 1} image placeholders ({placeholder}) for {len(images)} "
                         "images; give one image per placeholder (chat templates write them for image parts)")
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        tokens = image_token * image.tokens
        out.append(tokens if processor.kind == QWEN_VL else f"\n\n{GEMMA_PLACEHOLDER}{tokens}{GEMMA_END}\n\n")
        out.append(piece)
    return "".join(out)


QWEN_PLACEHOLDER = "<|image_pad|>"
GEMMA_PLACEHOLDER, GEMMA_END = "<start_of_image>", "<end_of_image>"
