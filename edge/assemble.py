"""One function that wires an edge service on either log: :func:`build_edge`.

``stack.runtime.build_edge_service`` calls it with :class:`eventlog.jetstream.JetStreamPort` and the parts that
need NATS (leases, the session index, projections for summaries, metrics); ``rollbus.testing.memory_log``'s
``in_memory_service`` with the in-memory log and none of them. Whatever differs between the two is an argument
here, so that the two edges cannot be assembled differently by accident.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from edge.engines.base import Engine
from edge.images import EdgeImages, ImageFetcher
from edge.live import Registry, Summaries
from edge.metrics import TimedEngine, TimedLog
from edge.ownership import KvLeases
from edge.service import EdgeService
from edge.session_index import SessionIndex
from edge.settings import Clock, EdgeSettings
from edge.tokens.fidelity import load_codec
from edge.tokens.images import ImageTokens
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers.base import ToolParser
from edge.tokens.tokenizer import Tokenizer
from edge.turns import TurnRunner
from eventlog.publisher import Appended
from eventlog.reader import SessionLog
from observability.registry import Metrics
from schemas.events import Event
from session.fold import SessionState


class EdgeLog(Protocol):
    """What an edge needs of the log (both :class:`eventlog.port.LogPort` implementations have it)."""

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended: ...
    async def put_pieces(self, session_id: str, pieces: Mapping[bytes, bytes]) -> None: ...
    async def load_state(self, session_id: str, *, until: int | None = None) -> tuple[SessionState, int]: ...
    async def last_stream_seq(self, session_id: str) -> int: ...
    async def read_session(self, session_id: str, *, until: int | None = None) -> SessionLog: ...


def build_edge(
    settings: EdgeSettings,
    log: EdgeLog,
    engine: Engine,
    *,
    codec: tuple[TemplateCodec, ToolParser] | None = None,
    clock: Clock = time.time,
    metrics: Metrics | None = None,
    leases: KvLeases | None = None,
    index: SessionIndex | None = None,
    summaries: Summaries | None = None,
    images: EdgeImages | None = None,
) -> EdgeService:
    """An :class:`EdgeService` appending to ``log`` and rebuilding unknown sessions from it.

    ``codec``: the codec and parser for ``settings.tokenizer`` / ``tool_format`` when already loaded (else
    :func:`load_codec`, which refuses a mismatched pair); ``metrics``: where appends and engine calls are
    timed and turns counted (None: nothing timed, the turns counted in a registry of the runner's own);
    ``leases``: one writer per session across edges (None: the log's sequence check alone); ``index``: one
    session per (uid, session_index) (None: not checked); ``summaries``: a session's summary from its
    projection (None: a summary is a replay); ``images``: what the edge does with images (None:
    :func:`edge_images` for ``settings``, a ``ValueError`` when its processor does not load or fit the tokenizer)."""
    template, parser = codec if codec is not None else load_codec(settings.tokenizer, settings.tool_format)
    images = images if images is not None else edge_images(settings, template.tokenizer)
    event_log = TimedLog(log, metrics) if metrics is not None else log
    timed = TimedEngine(engine, metrics) if metrics is not None else engine
    registry = Registry(log.load_state, leases=leases, position=log.last_stream_seq, summaries=summaries, clock=clock)
    turns = TurnRunner(
        settings=settings, codec=template, engine=timed, log=event_log, parser=parser, clock=clock, metrics=metrics,
        images=images,
    )
    return EdgeService(
        settings=settings,
        registry=registry,
        log=event_log,
        turns=turns,
        leases=leases,
        clock=clock,
        index=index,
        reader=log.read_session,
    )


def edge_images(settings: EdgeSettings, tokenizer: Tokenizer) -> EdgeImages:
    """What the edge does with images: with ``settings.processor``, that processor (loaded offline; a ``ValueError``
    when it cannot be, or its placeholder is not the tokenizer's special tokens), the limits, and a fetcher when
    ``image_fetch_allow`` names hosts; without, images are refused."""
    if not settings.processor:
        return EdgeImages(None, settings.image_limits)
    from vision.processor import load_processor  # (transformers, only for an edge that takes images)

    tokens = ImageTokens(load_processor(settings.processor, tokenizer), tokenizer)
    fetcher = ImageFetcher(settings.image_fetch_allow, max_bytes=settings.max_image_bytes,
                           timeout=settings.image_fetch_timeout_s) if settings.image_fetch_allow else None
    return EdgeImages(tokens, settings.image_limits, fetcher=fetcher)
