"""Request.to_json / from_json: what a sharded model's leader sends its other ranks reads back
equal there, images included."""

from __future__ import annotations

import base64

import numpy as np
from PIL import Image

from mlxinfer.text.images import LIMITS
from mlxinfer.engine.request import Request


def test_an_image_larger_as_png_than_the_byte_limit_reads_back_with_equal_pixels():
    # noise does not compress: ~7.4 MP of it is over 20 MiB as PNG, as a 12-MP photo is
    pixels = np.random.default_rng(0).integers(0, 256, (2048, 3600, 3), dtype=np.uint8)
    image = {"type": "image", "image": Image.fromarray(pixels)}
    request = Request.of([{"role": "user", "content": [image, {"type": "text", "text": "what is this?"}]}])
    data = request.to_json()
    png = base64.b64decode(data["images"][0].partition(",")[2])
    assert len(png) > LIMITS.max_bytes  # the case: the leader accepted it, a follower must too
    again = Request.from_json(data)
    assert np.array_equal(np.asarray(again.images[0].rgb()), pixels) and again.prompt == request.prompt
