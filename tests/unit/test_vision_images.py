"""Images as requests carry them: data URLs, digests, and what ``inspect`` refuses before any heavy work
(too many bytes, no image, a format not taken, a decompression bomb declared in a header, a corrupt body)."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import time
import zlib

import pytest
from PIL import Image

from schemas.errors import ImageRefused, ImageTooLarge, MalformedRequest, PayloadTooLarge
from vision.images import ImageInfo, ImageLimits, base64_image, from_data_url, image_digest, inspect


def encoded(width: int, height: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 90)).save(out, fmt)
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` and whose one IDAT holds a few bytes: what a
    decompression bomb's header looks like, without the bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_the_errors_are_a_400_and_a_413_in_the_tree() -> None:
    assert issubclass(ImageRefused, MalformedRequest) and issubclass(ImageTooLarge, PayloadTooLarge)


@pytest.mark.parametrize(("fmt", "media_type"), [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                                 ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_inspect_reads_format_and_size(fmt: str, media_type: str) -> None:
    data = encoded(123, 45, fmt)
    assert inspect(data, ImageLimits()) == ImageInfo(digest=hashlib.sha256(data).hexdigest(), media_type=media_type,
                                                     width=123, height=45)
    assert image_digest(data) == hashlib.sha256(data).hexdigest()


def test_a_decompression_bomb_is_refused_from_its_header_before_decoding() -> None:
    bomb = png_header_only(100_000, 100_000)
    assert len(bomb) < 200
    began = time.perf_counter()
    with pytest.raises(ImageTooLarge, match="max_pixels") as caught:
        inspect(bomb, ImageLimits(), param="messages[0].content[1].image_url")
    assert time.perf_counter() - began < 0.5  # 10^10 pixels would take minutes and 30 GB to inflate
    assert caught.value.param == "messages[0].content[1].image_url"
    with pytest.raises(ImageTooLarge, match=r"5000x5000 \(25000000 pixels\) is over max_pixels \(16777216\)"):
        inspect(png_header_only(5_000, 5_000), ImageLimits())  # under PIL's own bomb bound: ours refuses it


def test_each_limit_is_named() -> None:
    data = encoded(200, 100)
    with pytest.raises(ImageTooLarge, match=r"max_side \(150\)"):
        inspect(data, ImageLimits(max_side=150))
    with pytest.raises(ImageTooLarge, match=r"max_pixels \(19999\)"):
        inspect(data, ImageLimits(max_pixels=19_999))
    assert inspect(data, ImageLimits(max_pixels=20_000, max_side=200)).width == 200
    with pytest.raises(ImageTooLarge, match=rf"max_bytes \({len(data) - 1}\)"):
        inspect(data, ImageLimits(max_bytes=len(data) - 1))


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"GIF89a", b"\x89PNG\r\n\x1a\n" + b"\0" * 40],
                         ids=["empty", "text", "gif-magic-only", "png-magic-only"])
def test_undecodable_data_is_refused(data: bytes) -> None:
    with pytest.raises(ImageRefused, match="does not decode"):
        inspect(data, ImageLimits())


def test_a_truncated_body_is_refused() -> None:
    data = encoded(300, 300, "JPEG")
    with pytest.raises(ImageRefused, match="truncated or corrupt"):
        inspect(data[: len(data) // 2], ImageLimits())
    with pytest.raises(ImageRefused, match="truncated or corrupt"):
        inspect(png_header_only(64, 64), ImageLimits())  # a header within the limits, too little data


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO"])
def test_a_format_not_taken_is_refused(fmt: str) -> None:
    with pytest.raises(ImageRefused, match="does not decode as PNG, JPEG, WebP or GIF"):
        inspect(encoded(16, 16, fmt), ImageLimits())


def test_a_data_url_gives_bytes_and_its_declared_type() -> None:
    data = encoded(8, 8)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert from_data_url(url) == (data, "image/png")
    assert from_data_url(url.replace("image/png", "IMAGE/JPEG")) == (data, "image/jpeg")
    assert from_data_url(url.replace(";base64", ";charset=utf-8;base64")) == (data, "image/png")
    assert base64_image(base64.encodebytes(data)) == data  # line breaks, as some clients wrap base64


@pytest.mark.parametrize(("url", "why"), [
    ("https://example.com/cat.png", "base64 data URL"),
    ("data:text/plain;base64,aGk=", "'text/plain' is not an image"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64,@@@@", "does not decode"),
    ("data:image/png;base64,abc", "does not decode"),
    ("data:image/png;base64", "base64 data URL"),
])
def test_what_is_not_a_base64_image_data_url_is_refused(url: str, why: str) -> None:
    with pytest.raises(ImageRefused, match=why) as caught:
        from_data_url(url, param="image_url.url")
    assert caught.value.param == "image_url.url"


def test_a_data_url_over_max_bytes_is_refused_before_decoding() -> None:
    payload = base64.b64encode(b"\0" * 3000).decode()
    assert len(from_data_url("data:image/png;base64," + payload, max_bytes=3000)[0]) == 3000
    with pytest.raises(ImageTooLarge, match=r"max_bytes \(2999 bytes\)"):
        from_data_url("data:image/png;base64," + payload, max_bytes=2999)
