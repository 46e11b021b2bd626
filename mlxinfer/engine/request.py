"""The typed request: what to generate, parsed once where it enters and passed down unchanged.

Every front end (the Python API, the CLI, the chat session, each HTTP API) turns its own
input into one `Request`: the prompt (text, token ids or chat messages), the sampling
config and the generation options, each checked when it is made. The engine takes it as
it is; nothing below re-validates a loose dict. `to_json`/`from_json` carry it across
ranks of a sharded model (and anywhere else a request is stored) as plain data.

Images in chat messages are read here, once (`images.take_images`: bounded, checked, not yet
decoded); the messages keep `{"type": "image"}` where each was, for the chat template, and the
request holds the images in order (`images.LazyImage`: decoded one at a time when the engine
prepares the request). In JSON they travel as data URLs: their bytes as they came, or a PIL
image a caller gave as lossless PNG.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..base.errors import InvalidOptionError
from .options import GenerationOptions, Prompt, split_options
from ..text.images import DATA, LIMITS, LOCAL, ImageLimits, LazyImage, has_images, open_image, take_images
from ..decode.sample import SamplingConfig

# Options that hold runtime objects (a loaded draft model, its cache): they configure this
# process only, so a request carrying them cannot be written out.
RUNTIME_OPTIONS = ("draft_model", "draft_cache")

# Images a request carries in JSON were accepted (within `LIMITS.max_pixels`) where it was made;
# one a caller gave as a PIL image is written as PNG, which for a photo can be larger than the
# byte bound (a 12-MP photo is ~22 MiB as PNG): read back, they are bounded by their raw RGB size.
RELAYED = ImageLimits(max_bytes=4 * LIMITS.max_pixels + (1 << 20))


@dataclass(frozen=True)
class Request:
    """One generation request, validated at construction (`Request.of`)."""

    prompt: str | tuple[int, ...] | tuple[Mapping[str, Any], ...]
    sampling: SamplingConfig
    options: GenerationOptions
    images: tuple[LazyImage, ...] = ()  # the messages' images in order, checked, decoded when prepared

    @classmethod
    def of(cls, prompt: Prompt, vocab_size: int | None = None, defaults: Mapping[str, Any] | None = None,
           image_sources: frozenset[str] = LOCAL, image_limits: ImageLimits = LIMITS, **options: Any) -> Request:
        """The one place keyword options (`stream_generate`'s) become typed configs; `defaults`
        (an engine's) are overridden by `options`; token ids are checked against `vocab_size`;
        images in chat messages are read and checked, from where `image_sources` allows (`images.LOCAL`:
        files and data: URLs; a server: data: URLs, http(s) only when started to fetch them), each
        within `image_limits`."""
        sampling, generation = split_options({**(defaults or {}), **options}, vocab_size)
        prompt, images = _with_images(prompt, image_sources, image_limits)
        return cls(_frozen(prompt), sampling, generation, images)

    def keywords(self) -> dict[str, Any]:
        """Its configs as keyword options again (`of` reads them back to equal configs), less the
        loaded objects (RUNTIME_OPTIONS): for a front end that changes one option of a request it keeps."""
        return {f.name: getattr(c, f.name) for c in (self.sampling, self.options) for f in dataclasses.fields(c)
                if f.name not in RUNTIME_OPTIONS}

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (`from_json` reads it back to an equal request)."""
        held = [k for k in RUNTIME_OPTIONS if getattr(self.options, k) is not None]
        if held:
            raise InvalidOptionError(f"a request with {held[0]} (a loaded object) cannot be written out")
        sampling = dataclasses.asdict(self.sampling)
        sampling["logit_bias"] = {str(k): v for k, v in self.sampling.logit_bias.items()}
        options = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)
                   if f.name not in RUNTIME_OPTIONS}
        options["stop"] = list(self.options.stop)
        prompt = self.prompt if isinstance(self.prompt, str) else [dict(m) if isinstance(m, Mapping) else m
                                                                   for m in self.prompt]
        return {"prompt": prompt, "sampling": sampling, "options": options, "images": [i.encoded() for i in self.images]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Request:
        sampling = dict(data["sampling"])
        # JSON object keys are strings; one that is not a token id stays as it is, for the vocabulary check to name
        sampling["logit_bias"] = {int(k) if k.isascii() and k.isdigit() else k: v
                                  for k, v in sampling["logit_bias"].items()}
        options = dict(data["options"])
        options["stop"] = tuple(options["stop"])
        images = tuple(open_image(url, RELAYED, frozenset({DATA})) for url in data.get("images", ()))
        return cls(_frozen(data["prompt"]), SamplingConfig(**sampling), GenerationOptions(**options), images)


def _with_images(prompt: Prompt, sources: frozenset[str],
                 limits: ImageLimits) -> tuple[Prompt, tuple[LazyImage, ...]]:
    """Chat messages with their images taken out and read (`images.take_images`); other prompts as they are."""
    if not has_images(prompt):
        return prompt, ()
    messages, images = take_images(prompt, limits, sources)
    return messages, tuple(images)


def _frozen(prompt: Prompt) -> str | tuple:
    """The prompt as an immutable value: text, or a tuple of token ids or of messages."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, Sequence):
        raise InvalidOptionError(f"the prompt must be text, token ids or chat messages, got {type(prompt).__name__}")
    return tuple(prompt)
