"""Images in wire requests, read the same way on every wire.

OpenAI's ``image_url`` parts (``{"url": "data:image/png;base64,..."}``), the Responses API's
``input_image`` parts (``image_url``: the same URLs) and Anthropic's ``image`` blocks (``source``
``{"type": "base64", "media_type", "data"}`` or ``{"type": "url", "url"}``) become
:class:`~edge.chat.conversation.ImagePart`\\ s of the message they stand in, at the character of its
text where they stand (:class:`TextWithImages`). A data URL or a base64 source is decoded here (the
decoding is cached with the message, so a resent image is decoded once); an http(s) URL is kept as
it is, for the edge to fetch or refuse (:mod:`edge.images`: only from allowed hosts); anything else
(a ``file_id``, another scheme) is refused (400, naming the field). Whether the edge can take images at
all (a processor), and their limits, are the edge's to check, before any heavy work.
"""

from __future__ import annotations

from edge.chat.conversation import ImagePart
from schemas.errors import ImageRefused
from vision.images import base64_image, from_data_url

_FETCHED = ("http://", "https://")


def from_url(url: str, at: int, param: str) -> ImagePart:
    """An image given by URL: a data URL decoded, an http(s) URL kept for the edge to fetch."""
    if url[:5].lower() == "data:":
        data, media_type = from_data_url(url, param=param)
        return ImagePart(at=at, param=param, data=data, media_type=media_type)
    if url[:8].lower().startswith(_FETCHED):
        return ImagePart(at=at, param=param, url=url)
    scheme = url.partition(":")[0][:20] if ":" in url else ""
    raise ImageRefused("an image URL must be a data URL (data:image/...;base64,...) or http(s)"
                       + (f", not {scheme!r}" if scheme else ""), param=param)


def from_base64(data: str, media_type: str | None, at: int, param: str) -> ImagePart:
    """An image given as base64 text (Anthropic's ``source`` of type ``base64``)."""
    return ImagePart(at=at, param=param, data=base64_image(data, param=param), media_type=media_type or "")


class TextWithImages:
    """A message's content as it is read part by part: its text, and its images where they stand."""

    __slots__ = ("_length", "images", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.images: list[ImagePart] = []
        self._length = 0

    @property
    def at(self) -> int:
        """Where in the text an image read now stands."""
        return self._length

    def text(self, text: str) -> None:
        self.texts.append(text)
        self._length += len(text)

    def image(self, part: ImagePart) -> None:
        self.images.append(part)

    def content(self) -> str:
        return "".join(self.texts)

    def __bool__(self) -> bool:
        return bool(self._length or self.images)
