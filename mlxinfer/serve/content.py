"""A chat message's content as chat templates take it, whatever API sent it: its texts, and
its images where they were (`images.take_images` reads them out of the messages)."""

from __future__ import annotations

from typing import Any, Sequence


def image_part(url: str) -> dict[str, Any]:
    """An image as chat templates (and `images.take_images`) take it, whatever API sent it."""
    return {"type": "image_url", "image_url": {"url": url}}


def template_content(parts: Sequence[str | dict[str, Any]], separator: str = "") -> str | list[dict[str, Any]]:
    """A message's content as chat templates take it, from its parts in order (texts, and images
    as `image_part`s): the texts joined by `separator`; or, with an image among them, the parts
    as they came, so the template writes each image's placeholder where the image was."""
    if all(isinstance(p, str) for p in parts):
        return separator.join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
