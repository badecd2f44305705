"""Verification: re-derive a session's training records from the log and compare them with
what the materializer recorded (its marker: :class:`schemas.records.MaterializedMarker`,
one per session in the markers KV bucket, ``digests[key] = record_digest(record)``).

Kinds of difference, per session:

* ``missing_marker``: a finalized session with records but no marker;
* ``missing_key``: a record the log derives that the marker does not list;
* ``extra_key``: a key the marker lists that the log does not derive;
* ``digest_mismatch``: the same key, different content;
* ``unreadable``: the session's events do not fold (a corrupt log);
* ``quarantined``: the materializer set the session aside (its marker says ``quarantined``):
  none of its records are in the sinks (its ``session_quarantined`` event says why);
* ``orphan_marker``: a marker for a session the log never finalized (``--all`` only);
* ``image_missing``: an image the session's events reference (by digest) that the log's object
  store does not hold; ``image_altered``: one whose stored bytes do not have its sha256.

:func:`compare` and :func:`image_differences` are pure; the reading is :func:`load_markers` /
:func:`read_marker` (and the caller's fetch of :func:`session_images`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import msgspec
from nats.js.client import JetStreamContext

from eventlog.kv import KvStore, iter_bucket
from materializer.metadata import record_options
from materializer.records import RecordOptions, derive_records, rederive
from schemas.events import ImageRef
from schemas.log import LogConfig
from schemas.records import MaterializedMarker, record_digest
from session.fold import SessionState

_marker = msgspec.json.Decoder(MaterializedMarker)


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    kind: str
    key: str | None = None
    detail: str = ""


def body_differences(session_id: str, bad_requests: Sequence[int]) -> list[Difference]:
    """A difference per request whose raw body, rebuilt from the log, does not have its recorded digest."""
    return [Difference(session_id=session_id, kind="request_body", key=str(n),
                       detail="the body rebuilt from the log does not match its recorded sha256")
            for n in bad_requests]


def session_images(state: SessionState) -> dict[str, ImageRef]:
    """Every image the session's chains hold, by digest (the first place each stands)."""
    found: dict[str, ImageRef] = {}
    for chain in state.chains:
        for image in chain.images:
            found.setdefault(image.digest, image)
    return found


def image_differences(session_id: str, images: Mapping[str, ImageRef], stored: Mapping[str, bytes | None]
                      ) -> list[Difference]:
    """A difference per image (``images``, by digest) the object store does not hold (``stored[digest]`` None) or
    holds altered (bytes without that sha256)."""
    out = []
    for digest, image in images.items():
        data = stored.get(digest)
        where = f"{image.media_type} {image.width}x{image.height}"
        if data is None:
            out.append(Difference(session_id=session_id, kind="image_missing", key=digest,
                                  detail=f"{where}: not in the log's object store"))
        elif hashlib.sha256(data).hexdigest() != digest:
            out.append(Difference(session_id=session_id, kind="image_altered", key=digest,
                                  detail=f"{where}: the stored {len(data)} bytes do not have its sha256"))
    return out


def derived_digests(state: SessionState, marker: MaterializedMarker | None = None,
                    options: RecordOptions = RecordOptions()) -> dict[str, str]:
    """Digests of the records the log derives: as the marker says they were derived (its options,
    its scorer's reward), else with ``options`` (and the session's own overrides of them)."""
    records = rederive(state, marker) if marker is not None else derive_records(state, record_options(state, options))
    return {record.key: record_digest(record) for record in records}


def compare(state: SessionState, marker: MaterializedMarker | None,
            options: RecordOptions = RecordOptions()) -> list[Difference]:
    """What differs between the records the log derives and the marker (empty: nothing).

    Only a finalized session has records: an open or aborted one is expected to have none.
    """
    sid = state.session_id
    derived = derived_digests(state, marker, options) if state.status == "finalized" else {}
    if marker is None:
        return [Difference(session_id=sid, kind="missing_marker", detail=f"{len(derived)} records derived")] \
            if derived else []
    if marker.status == "quarantined":
        return [Difference(session_id=sid, kind="quarantined", detail=f"none of its {len(derived)} records are in "
                           f"the sinks: {state.quarantined or 'see its session_quarantined event'}")]
    recorded = marker.digests
    out = [Difference(session_id=sid, kind="missing_key", key=k, detail="derived from the log, not in the marker")
           for k in sorted(derived.keys() - recorded.keys())]
    out += [Difference(session_id=sid, kind="extra_key", key=k, detail="in the marker, not derived from the log")
            for k in sorted(recorded.keys() - derived.keys())]
    out += [Difference(session_id=sid, kind="digest_mismatch", key=k,
                       detail=f"log {derived[k][:16]} marker {recorded[k][:16]}")
            for k in sorted(derived.keys() & recorded.keys()) if derived[k] != recorded[k]]
    return out


async def read_marker(js: JetStreamContext, cfg: LogConfig, session_id: str,
                      timeout: float = 5.0) -> MaterializedMarker | None:
    found = await KvStore(js, cfg.markers_bucket, timeout=timeout).get(session_id)
    return _marker.decode(found[0]) if found is not None else None


async def load_markers(js: JetStreamContext, cfg: LogConfig) -> dict[str, MaterializedMarker]:
    """Every marker, in one pass over the bucket."""
    return {key: _marker.decode(value) async for key, value in iter_bucket(js, cfg.markers_bucket)}
