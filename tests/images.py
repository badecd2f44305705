"""Images for tests: real PNGs made with PIL, the headers of decompression bombs, and how each wire sends them."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from typing import Any

from PIL import Image


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    """A plain PNG of one color (small: it compresses)."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels: about 3 bytes a pixel, whatever the compression (a screenshot's worth of bytes)."""
    rng = random.Random(seed)
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)).save(out, "PNG")
    return out.getvalue()


def bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` over a few bytes of data (a decompression bomb's head)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def data_url(image: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(image).decode()}"


def openai_image(image: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def anthropic_image(image: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": base64.b64encode(image).decode()}}


def responses_image(image: bytes) -> dict[str, Any]:
    return {"type": "input_image", "image_url": data_url(image)}
