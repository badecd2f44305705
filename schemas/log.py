"""Where events live: the stream, its subjects, and the rules every writer follows.

One JetStream stream (file storage) holds every session; a session's events are under
``<prefix>.<session_id>.>``. ``Nats-Msg-Id = <session_id>:<first seq>`` makes a retried
publish idempotent, and the expected-last-subject-sequence headers (filtered on the
session's subjects) make the edge the only writer of a session. An append that would
exceed the payload limit is split by one rule, :func:`fit_envelopes`, for every writer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from schemas import blobs, envelope
from schemas.errors import PayloadTooLarge, SessionNotFound
from schemas.events import Event, RequestReceived

# Lowercase hex (uuid4().hex) or a lowercased ULID: safe as one NATS subject token.
SESSION_ID_RE = re.compile(r"^[0-9a-z]{16,64}$")

# Headers carried by every envelope.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
HDR_SCHEMA = "Rollbus-Schema"
HDR_SEQ = "Rollbus-Seq"  # "<first>-<last>": the per-session sequence numbers the envelope holds
HDR_BLOBS = "Rollbus-Blobs"  # "<count>": values of the envelope kept in the object store (schemas/blobs.py)

MAX_PAYLOAD = 1024 * 1024  # NATS's default max_payload


class LogConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Names of the stream, its subjects and the companion buckets; tests isolate by prefix."""

    stream: str = "ROLLBUS"
    prefix: str = "rollbus"
    ready_stream: str = "ROLLBUS_READY"  # "finalized, ready to materialize" signals
    projections_bucket: str = "rollbus_sessions"
    markers_bucket: str = "rollbus_materialized"
    leases_bucket: str = "rollbus_leases"  # which edge writes which open session (edge.ownership)
    prompts_bucket: str = "rollbus_prompts"  # the materializer's per-prompt progress (verl prompt status)
    session_index_bucket: str = "rollbus_session_index"  # which session holds a (uid, session_index) (edge.service)
    pieces_bucket: str = "rollbus_pieces"  # object store: values too large for one message (schemas/blobs.py)
    duplicate_window_s: float = 600.0
    max_event_bytes: int = 900 * 1024  # an envelope stays under NATS's payload limit

    @classmethod
    def namespaced(cls, name: str) -> LogConfig:
        """A log of its own beside others on one server: every name derived from ``name``."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,31}", name):
            raise ValueError(f"a log namespace is 1-32 lowercase letters and digits, starting with a letter: {name!r}")
        return cls(stream=name.upper(), prefix=name, ready_stream=f"{name.upper()}_READY",
                   projections_bucket=f"{name}_sessions", markers_bucket=f"{name}_materialized",
                   leases_bucket=f"{name}_leases", prompts_bucket=f"{name}_prompts",
                   session_index_bucket=f"{name}_session_index", pieces_bucket=f"{name}_pieces")

    @property
    def subjects(self) -> str:
        return f"{self.prefix}.>"

    @property
    def ready_subjects(self) -> str:
        return f"{self.prefix}_ready.>"

    def subject(self, session_id: str, kind: str) -> str:
        return f"{self.prefix}.{session_id}.{kind}"

    def session_filter(self, session_id: str) -> str:
        return f"{self.prefix}.{session_id}.>"

    def kind_filter(self, kind: str) -> str:
        return f"{self.prefix}.*.{kind}"

    def ready_subject(self, session_id: str) -> str:
        return f"{self.prefix}_ready.{session_id}"

    def session_of(self, subject: str) -> str:
        """The session id in a subject of this log."""
        return subject.split(".", 2)[1]


def check_session_id(session_id: str) -> str:
    """A session id that is not subject-safe cannot exist: it is unknown, never sent to NATS."""
    if not SESSION_ID_RE.fullmatch(session_id):
        raise SessionNotFound(f"no session {session_id!r}", param="session_id")
    return session_id


def msg_id(session_id: str, first_seq: int) -> str:
    return f"{session_id}:{first_seq}"


def append_headers(cfg: LogConfig, session_id: str, first_seq: int, last_seq: int, expected_last: int, *,
                   schema: int, blobs: int = 0) -> dict[str, str]:
    """The headers of an envelope holding a session's events ``first_seq..last_seq``, appended after
    stream sequence ``expected_last`` (the log rules above); ``blobs``: its values in the object store."""
    headers = {
        HDR_MSG_ID: msg_id(session_id, first_seq),
        HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_last),
        HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: cfg.session_filter(session_id),
        HDR_SCHEMA: str(schema),
        HDR_SEQ: f"{first_seq}-{last_seq}",
    }
    if blobs:
        headers[HDR_BLOBS] = str(blobs)
    return headers


class Envelope(msgspec.Struct, frozen=True):
    """One message of an append: its events, their encoded envelope, and the values it refers to in
    the object store (object name -> bytes), which are stored before the message is published."""

    events: Sequence[Event]
    payload: bytes
    pieces: dict[str, bytes] = {}


def fit_envelopes(events: Sequence[Event], limit: int, payload: bytes | None = None) -> list[Envelope]:
    """``events`` (consecutive, of one session) as envelopes of at most ``limit`` bytes, in order:
    halved until each fits; a single event that does not fit has its largest values moved to the
    object store (:func:`schemas.blobs.externalize`), and is refused with :class:`PayloadTooLarge`
    if it still does not fit (nothing is stored then: the caller stores and publishes only after).
    ``payload``: ``envelope.encode(events)`` when the caller has it already.

    The base64 text of images a request body holds in parts of their own goes to the object store even when the
    envelope would fit (:func:`schemas.blobs.move_image_texts`, texts from 64 bytes): each envelope carries the
    pieces it refers to."""
    moved: dict[str, bytes] = {}
    events = [blobs.move_image_texts(event, moved) if type(event) is RequestReceived else event for event in events]
    if not moved:
        return _fit(events, limit, payload)
    fitted = _fit(events, limit, None)
    out = []
    for fit in fitted:
        names = {blobs.object_name(fit.events[0].session_id, digest) for digest in blobs.references(fit.payload)}
        mine = {name: data for name, data in moved.items() if name in names}
        out.append(Envelope(fit.events, fit.payload, {**fit.pieces, **mine}) if mine else fit)
    return out


def _fit(events: Sequence[Event], limit: int, payload: bytes | None) -> list[Envelope]:
    payload = envelope.encode(events) if payload is None else payload
    if len(payload) <= limit:
        return [Envelope(events, payload)]
    if len(events) > 1:
        middle = len(events) // 2
        return [*_fit(events[:middle], limit, None), *_fit(events[middle:], limit, None)]
    event, pieces = blobs.externalize(events[0], limit)
    payload = envelope.encode([event])
    if len(payload) > limit:
        raise PayloadTooLarge(f"one {type(event).__name__} event is {len(payload)} bytes (limit {limit})")
    return [Envelope([event], payload, pieces)]


# The parts of a stack: the log's writer (the edge) and its two consumers; each runs alone too.
COMPONENTS = ("edge", "projector", "materializer")


class ReadySignal(msgspec.Struct, frozen=True, kw_only=True):
    """On the ready stream: a session ended (finalized or aborted) and is ready to materialize. The projector
    publishes it, the materializer consumes it."""

    session_id: str
    stream_seq: int  # the finalize envelope's position: the session's log is complete up to here


class ProjectionHead(msgspec.Struct, frozen=True, kw_only=True):
    """The leading fields of a session's projection (the projections bucket's value): enough to list and
    filter sessions. The projector writes projections (:mod:`session_projector.projections`); the edge,
    the CLI and the viewer read them."""

    session_id: str
    status: str
    uid: str
    opened_at: float
    updated_at: float
    stream_seq: int  # log position of the last envelope folded in
