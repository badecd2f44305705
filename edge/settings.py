"""Edge configuration (the composition root fills it from CLI flags and the environment)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from schemas.log import LogConfig
from vision.images import ImageLimits

Clock = Callable[[], float]
"""Where the edge reads the time (``time.time``; a test's own clock in tests)."""


LAG_INTERVAL_S = 5.0  # how often the consumers' lag is sampled (observability.lag.watch_lag)
SEND_TIMEOUT_S = 60.0  # a connection whose client takes none of its reply for this long is closed (TCP_USER_TIMEOUT)
IMAGE_LIMITS = ImageLimits()  # the defaults of the image limits below


class EdgeSettings(msgspec.Struct, frozen=True, kw_only=True):
    public_url: str = "http://127.0.0.1:8000"  # where agents reach this edge (session URLs)
    admin_token: str = ""
    tokenizer: str = "builtin:qwen2.5"
    tool_format: str = "hermes"  # multi_turn.format: must match the chat template
    reasoning_format: str = "think"  # how reasoning is read out of replies: think or sglang:NAME
    max_trajectory_length: int = 32768  # prompt + response tokens of one chain
    default_max_tokens: int = 4096  # per turn, when neither request nor session says
    max_request_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 30.0  # a request body that sends nothing for this long is refused (400)
    # and one that is not whole within body_base_s + its size / body_min_rate (its Content-Length, else
    # max_request_bytes) is refused too (400): a trickle holds its connection for a bounded time
    body_base_s: float = 10.0
    body_min_rate: float = 64 * 1024  # bytes per second
    max_open_sessions: int = 100_000
    edge_id: str = "edge-0"  # unique among running edges (a restarted edge with the same id takes over at once)
    lease_ttl_s: float = 15.0  # a crashed edge's open sessions can be taken over this long after its last renewal
    idle_timeout_s: float = 3600.0  # open sessions untouched this long are aborted ("idle_timeout"); 0: never
    rollback_rewritten_turns: bool = True  # a request that rewrites a chain's last reply rolls it back
    disconnect_grace_s: float = 10.0  # a plain turn whose client left is aborted this long after (unless retried)
    # Images (edge.images): "" refuses them; else builtin:qwen2.5-vl or a local Hugging Face processor directory
    processor: str = ""
    max_images: int = IMAGE_LIMITS.max_images  # per request (the history's too: the engine sees them all)
    max_image_bytes: int = IMAGE_LIMITS.max_bytes  # one image, decoded (or fetched)
    max_image_pixels: int = IMAGE_LIMITS.max_pixels  # width * height as the image's header declares them
    max_image_side: int = IMAGE_LIMITS.max_side
    image_fetch_allow: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched; none: only data URLs
    image_fetch_timeout_s: float = 10.0  # one fetch, connecting to its last byte
    log: LogConfig = LogConfig()

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(max_images=self.max_images, max_bytes=self.max_image_bytes,
                           max_pixels=self.max_image_pixels, max_side=self.max_image_side)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What a request body may be: at most ``max_bytes`` (sent, and decoded from its ``Content-Encoding``),
    never silent for ``silence_s`` seconds, and whole within :meth:`time_allowed`."""

    max_bytes: int
    silence_s: float
    base_s: float
    min_rate: float  # bytes per second

    def time_allowed(self, declared: int | None) -> float:
        """Seconds a body of ``declared`` bytes (``None``: chunked, so up to ``max_bytes``) may take to arrive."""
        return self.base_s + (self.max_bytes if declared is None else declared) / self.min_rate


def body_limits(settings: EdgeSettings, max_bytes: int | None = None) -> BodyLimits:
    """The edge's body limits (``max_bytes``: a route's own size limit, else the edge's)."""
    return BodyLimits(max_bytes=settings.max_request_bytes if max_bytes is None else max_bytes,
                      silence_s=settings.body_timeout_s, base_s=settings.body_base_s, min_rate=settings.body_min_rate)
