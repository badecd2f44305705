"""Images as requests carry them: their limits, their digest, data URLs, and what their header declares.

:func:`inspect` is what a request's image meets first. It refuses, in this order and before any heavy work:
more bytes than :attr:`ImageLimits.max_bytes`; data none of the readers of :data:`MEDIA_TYPES` recognises
(PIL tries no other format, so hostile bytes never reach its other parsers); a declared side over
:attr:`ImageLimits.max_side` or declared pixels over :attr:`ImageLimits.max_pixels`, read from the header
alone (a decompression bomb, a few hundred bytes of PNG declaring 100000x100000, is refused before a pixel is
inflated); then, with the dimensions known to be within the limits (so the work is bounded), the pixels are
decoded once, and data that does not decode (a truncated or corrupt body) is refused too. :class:`ImageTooLarge`
names the limit, :class:`ImageRefused` the reason; both carry the request's field as ``param`` when the caller
gives it. Decoding costs about 20 ms for a 1920x1080 JPEG and 45 ms for a PNG (a loaded 2-core machine): a
caller that meets the same image again keeps its :class:`ImageInfo`.

PIL is imported when the first image is inspected, not with this module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from typing import TYPE_CHECKING

import msgspec

from schemas.errors import ImageRefused, ImageTooLarge

if TYPE_CHECKING:
    from PIL.Image import Image as PilImage

# PIL's format name -> the media type the gateway records; no other format is taken.
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_FORMATS = tuple(MEDIA_TYPES)  # the only readers PIL tries: hostile bytes never reach its other parsers
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request's images may be; every limit is refused with :class:`ImageTooLarge` naming it."""

    max_images: int = 16  # per request
    max_bytes: int = 10 * 2**20  # one image, decoded from base64
    max_pixels: int = 16_777_216  # declared width*height (decompression bombs refused before decoding)
    max_side: int = 16_384  # declared width or height


class ImageInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an image is, from its bytes: all a processor needs to count its placeholder tokens."""

    digest: str  # sha256 hex of the image bytes
    media_type: str  # "image/png", "image/jpeg", "image/webp", "image/gif"
    width: int
    height: int


def image_digest(data: bytes) -> str:
    """The sha256 hex digest of an image's bytes: its name in the object store and in the log."""
    return hashlib.sha256(data).hexdigest()


def from_data_url(url: str, *, max_bytes: int | None = None, param: str | None = None) -> tuple[bytes, str]:
    """``(bytes, media type)`` of a base64 ``data:image/...`` URL.

    Refused (:class:`ImageRefused`): not a data URL, not base64, a media type that is not an image, base64 that
    does not decode. With ``max_bytes``, a payload over it is refused (:class:`ImageTooLarge`) from its length,
    before it is decoded. The media type is the one the URL declares; :func:`inspect` reads the real one."""
    match = _DATA_URL.fullmatch(url[:512]) if url.startswith("data:") else None
    if match is None:
        head = url.split(",", 1)[0] if url.startswith("data:") else url[:16]
        raise ImageRefused(f"an image must be a base64 data URL (data:image/png;base64,...), not {head[:40]!r}",
                           param=param)
    media_type = (match["type"] or "").lower()
    if not media_type.startswith("image/"):
        raise ImageRefused(f"a data URL of type {media_type or 'text/plain'!r} is not an image", param=param)
    if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise ImageRefused("an image data URL must be base64 (data:image/...;base64,...)", param=param)
    payload = url[url.index(",") + 1:].encode("ascii", "replace")
    return base64_image(payload, max_bytes=max_bytes, param=param), media_type


def base64_image(payload: bytes | str, *, max_bytes: int | None = None, param: str | None = None) -> bytes:
    """The bytes of a base64 image (Anthropic's ``source.data``; a data URL's payload), strictly decoded;
    with ``max_bytes``, one whose length says it decodes to more is refused before decoding."""
    data = payload.encode("ascii", "replace") if isinstance(payload, str) else payload
    data = data.replace(b"\n", b"").replace(b"\r", b"")
    if max_bytes is not None and len(data) // 4 * 3 - data[-2:].count(b"=") > max_bytes:
        raise ImageTooLarge(f"an image is over max_bytes ({max_bytes} bytes)", param=param)
    if len(data) % 4 or not _BASE64.fullmatch(data):
        raise ImageRefused("the image's base64 does not decode", param=param)
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as exc:  # pragma: no cover - the pattern and length above admit only valid base64
        raise ImageRefused("the image's base64 does not decode", param=param) from exc


def inspect(data: bytes, limits: ImageLimits, *, param: str | None = None) -> ImageInfo:
    """What the image is, refused when over a limit or not an image this gateway takes (module doc says the
    order: the limits from the header first, then one decode of the pixels within them)."""
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(f"an image of {len(data)} bytes is over max_bytes ({limits.max_bytes})", param=param)
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=_FORMATS)  # reads the header only
        except Image.DecompressionBombError as exc:  # declared past PIL's own bound: over ours too
            raise ImageTooLarge(f"an image declares more than max_pixels ({limits.max_pixels})",
                                param=param) from exc
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise ImageRefused("the image does not decode as PNG, JPEG, WebP or GIF", param=param) from exc
        with image:
            info = _declared(image, data, limits, param)
            _decode(image, param)
    return info


def _declared(image: PilImage, data: bytes, limits: ImageLimits, param: str | None) -> ImageInfo:
    """The header's format and size, within the limits."""
    media_type = MEDIA_TYPES[str(image.format)]  # (opened with these formats only)
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageRefused(f"the image declares {width}x{height} pixels", param=param)
    if max(width, height) > limits.max_side:
        raise ImageTooLarge(f"an image of {width}x{height} is over max_side ({limits.max_side})", param=param)
    if width * height > limits.max_pixels:
        raise ImageTooLarge(f"an image of {width}x{height} ({width * height} pixels) is over max_pixels "
                            f"({limits.max_pixels})", param=param)
    return ImageInfo(digest=image_digest(data), media_type=media_type, width=width, height=height)


def _decode(image: PilImage, param: str | None) -> None:
    """Decode the pixels (bounded: the header was checked), refusing a truncated or corrupt body."""
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageRefused("the image's data does not decode (truncated or corrupt)", param=param) from exc


def open_image(data: bytes) -> PilImage:
    """A decoded RGB ``PIL.Image`` of bytes :func:`inspect` took (what processors are given); bytes that do not
    decode are refused (:class:`ImageRefused`), as :func:`inspect` refuses them."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
                return image.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
            raise ImageRefused("the image's data does not decode") from exc
