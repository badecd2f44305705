"""Where events live: the stream, its subjects, and the rules every writer follows.

One JetStream stream (file storage) holds every session; a session's events are under
``<prefix>.<session_id>.>``. ``Nats-Msg-Id = <session_id>:<first seq>`` makes a retried
publish idempotent, and the expected-last-subject-sequence headers (filtered on the
session's subjects) make the edge the only writer of a session.
"""

from __future__ import annotations

import re

import msgspec

from schemas.errors import SessionNotFound

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
