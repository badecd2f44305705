"""A request's images, made ready before its turn: refused, fetched, inspected, within the limits.

The wire adapters leave a message's images as they came (:mod:`edge.wires.images`): decoded bytes,
or an http(s) URL. Before a turn (or a token count) is decided, :meth:`EdgeImages.prepare`:

1. refuses any image when the edge has no processor (400, naming the field: ``--processor`` starts
   one), and more images than ``max_images`` in the request (its history's too: the engine sees
   them all);
2. refuses an http(s) URL unless fetching is enabled and its host allowed
   (``--image-fetch-allow HOST``): a gateway does not fetch arbitrary URLs for its clients;
3. reads each image's header and checks it against the limits (:func:`vision.images.inspect`:
   undecodable, too many bytes, too many pixels, a side too long; a decompression bomb is refused by
   its declared size, before any pixel is decoded), 400 or 413 naming the limit;
4. fetches the allowed URLs (:class:`ImageFetcher`: no redirects, a size cap, a timeout), each once
   per session (a resent URL gets the bytes it got the first time, so its chain's tokens and images
   agree), and inspects them as in 3.

All of it comes before the turn is recorded or any text is tokenized. An image's header is read
once per distinct bytes (cached). The bytes themselves go to the log's object store when the turn
that first holds them is committed (:meth:`edge.turns.TurnRunner.commit`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping, Sequence
from urllib.parse import urlsplit

import httpx
import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import Conversation, ImagePart, Message
from edge.tokens.images import ImageTokens
from schemas.errors import ImageRefused, ImageTooLarge
from vision.images import ImageInfo, ImageLimits, inspect

MAX_FETCHED = 64  # URLs a session remembers the fetched bytes of
NO_PROCESSOR = ("this edge has no image processor, so it takes no images (start it with --processor "
                "builtin:qwen2.5-vl, or a local Hugging Face processor directory)")


class ImageFetcher:
    """Fetches image URLs from allowed hosts only, bounded in size and time, following no redirect."""

    def __init__(self, allow: Sequence[str], *, max_bytes: int, timeout: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.allow = frozenset(host.lower() for host in allow)
        self._max_bytes = max_bytes
        self._timeout = timeout
        self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, transport=transport)

    def check(self, url: str, param: str) -> None:
        """Refuse (400) a URL whose host is not allowed."""
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.allow:
            allowed = ", ".join(sorted(self.allow)) or "none"
            raise ImageRefused(f"images are fetched only from the hosts --image-fetch-allow names ({allowed}); "
                               f"{host or url[:40]!r} is not one of them: send the image as a data URL",
                               param=param)

    async def fetch(self, url: str, param: str) -> bytes:
        self.check(url, param)
        try:
            async with asyncio.timeout(self._timeout):
                return await self._get(url, param)
        except TimeoutError:
            raise ImageRefused(f"fetching the image took more than {self._timeout:g} s", param=param) from None
        except httpx.HTTPError as exc:
            raise ImageRefused(f"could not fetch the image: {type(exc).__name__}: {exc}", param=param) from None

    async def _get(self, url: str, param: str) -> bytes:
        async with self._client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ImageRefused(f"fetching the image answered HTTP {response.status_code}", param=param)
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self._max_bytes:  # refused before any of it is read
                raise self._too_large(param)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self._max_bytes:
                    raise self._too_large(param)
                chunks.append(chunk)
            return b"".join(chunks)

    def _too_large(self, param: str) -> ImageTooLarge:
        return ImageTooLarge(f"the fetched image exceeds {self._max_bytes} bytes (max_image_bytes, --image-max-bytes)",
                             param=param)

    async def aclose(self) -> None:
        await self._client.aclose()


class EdgeImages:
    """What the edge does with a request's images (see the module docstring). ``tokens``: the processor's
    placeholder and its expansion (None: no processor, images refused)."""

    def __init__(self, tokens: ImageTokens | None, limits: ImageLimits = ImageLimits(), *,
                 fetcher: ImageFetcher | None = None) -> None:
        self.tokens = tokens
        self.limits = limits
        self.fetcher = fetcher
        self._inspected: BoundedCache[bytes, ImageInfo] = BoundedCache(max_items=4096, max_bytes=512 * 2**20)

    @property
    def processor_name(self) -> str | None:
        return self.tokens.processor.name if self.tokens is not None else None

    async def prepare(self, conversation: Conversation, fetched: MutableMapping[str, bytes]) -> Conversation:
        """``conversation`` with every image fetched and inspected (``fetched``: the session's URLs fetched
        before, which this adds to); refused as the module docstring says."""
        if not any_image(conversation.messages):
            return conversation
        found = list(_images(conversation.messages))
        if self.tokens is None:
            raise ImageRefused(NO_PROCESSOR, param=found[0][2].param)
        if len(found) > self.limits.max_images:
            raise ImageRefused(f"{len(found)} images in the request (its history's included); the limit is "
                               f"{self.limits.max_images} (max_images, --image-max-count)",
                               param=found[self.limits.max_images][2].param)
        for _, _, image in found:  # every refusal that needs no fetch, first
            if image.url and not image.data:
                if self.fetcher is None:
                    raise ImageRefused("image URLs are not fetched: send the image as a data URL "
                                       "(or allow its host with --image-fetch-allow HOST)", param=image.param)
                self.fetcher.check(image.url, image.param)
            elif image.info is None:
                self._inspect(image.data, image.param)
        ready = [await self._ready(image, fetched) for _, _, image in found]
        return _with_images(conversation, found, ready)

    def _inspect(self, data: bytes, param: str) -> ImageInfo:
        info = self._inspected.get(data)
        if info is None:
            info = self._inspected.put(data, inspect(data, self.limits, param=param), len(data))
        return info

    async def _ready(self, image: ImagePart, fetched: MutableMapping[str, bytes]) -> ImagePart:
        if image.info is not None:
            return image
        data = image.data
        if image.url and not data:
            data = fetched.get(image.url) or b""
            if not data:
                if self.fetcher is None:  # (prepare refused it before)
                    raise ImageRefused("image URLs are not fetched", param=image.param)
                data = await self.fetcher.fetch(image.url, image.param)
                if len(fetched) >= MAX_FETCHED:
                    fetched.pop(next(iter(fetched)))
                fetched[image.url] = data
        return msgspec.structs.replace(image, data=data, info=self._inspect(data, image.param))

    async def aclose(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.aclose()


def any_image(messages: Sequence[Message]) -> bool:
    """Whether any of ``messages`` has an image (the usual request has none: it is not looked for further)."""
    return any(message.images for message in messages)


def _images(messages: Sequence[Message]) -> Iterator[tuple[int, int, ImagePart]]:
    for i, message in enumerate(messages):
        for j, image in enumerate(message.images):
            yield i, j, image


def _with_images(conversation: Conversation, found: list[tuple[int, int, ImagePart]],
                 ready: list[ImagePart]) -> Conversation:
    messages = list(conversation.messages)
    changed: dict[int, list[ImagePart]] = {}
    for (i, j, image), done in zip(found, ready, strict=True):
        if done is not image:
            changed.setdefault(i, list(messages[i].images))[j] = done
    if not changed:
        return conversation
    for i, images in changed.items():
        messages[i] = msgspec.structs.replace(messages[i], images=tuple(images))
    return msgspec.structs.replace(conversation, messages=tuple(messages))
