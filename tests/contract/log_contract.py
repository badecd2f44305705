"""The event log's contract: what the edge relies on when it appends and what recovery relies on
when it reads back, as one suite run against every log (as eventsourcing runs its recorder tests
against POPO, SQLite and PostgreSQL).

The second half, :class:`PortContract`, holds what the projector and the materializer use beyond the
append (:class:`eventlog.port.LogPort`): the ready signal's publish, durable consumers (ack, nak,
``ack_wait``, resume), the reads of a session's last message and envelopes, and KV buckets.

A module binds the suite to a log by subclassing :class:`LogContract` (and :class:`PortContract`) and
giving it a ``backend`` fixture (a :class:`Backend`): ``tests/unit/test_log_contract_memory.py`` (the
in-memory log, no NATS) and ``tests/integration/test_log_contract_jetstream.py`` (JetStream, on a real
nats-server). Every
backend's log is configured with ``max_event_bytes = LIMIT``, so that large events are cheap to make.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import msgspec
import pytest

from eventlog.port import Delivery, LogPort
from eventlog.reader import SessionLog
from rollbus.testing.memory_log import StoredMessage
from schemas import envelope, tokens
from schemas.bodies import literal
from schemas.errors import OwnershipLost, PayloadTooLarge, SessionNotFound
from schemas.events import SCHEMA_VERSION, AnyEvent, Event, RequestReceived, body_digest
from schemas.log import (
    HDR_BLOBS,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
    HDR_MSG_ID,
    HDR_SCHEMA,
    HDR_SEQ,
    LogConfig,
    append_headers,
    msg_id,
)
from session.fold import SessionState, fold
from tests.helpers import SessionScript, envelopes

LIMIT = 32 * 1024  # every contract log's max_event_bytes
A = "0123456789abcdef0123456789abcdef"
B = "fedcba9876543210fedcba9876543210"


class Backend(Protocol):
    """One log under test: its writer, its readers, and what it has stored."""

    cfg: LogConfig
    log: LogPort

    async def read(self, session_id: str, until: int | None = None) -> SessionLog: ...

    async def load(self, session_id: str, until: int | None = None) -> tuple[SessionState, int]: ...

    async def position(self, session_id: str) -> int:
        """Stream sequence of the session's last message (0: none)."""
        ...

    async def stored(self) -> list[StoredMessage]:
        """Every message of the stream, in order."""
        ...

    async def piece(self, name: str) -> bytes | None:
        """A value in the object store, by object name."""
        ...

    def lose_next_ack(self) -> None:
        """The next append's first acknowledgement is lost after its message was stored."""


def session(session_id: str = A, *, turns: int = 2) -> SessionScript:
    """A session with ``turns`` turns on one chain, a reward and its finalization."""
    script = SessionScript(session_id=session_id)
    for turn in range(turns):
        script.turn(0, [10 + turn, 11 + turn], [20 + turn, 21 + turn], new_chain=turn == 0)
    script.reward(1.0, acc=1.0)
    script.finalize()
    return script


def big_request(session_id: str, seq: int, size: int) -> RequestReceived:
    body = bytes(range(256)) * (size // 256)
    return RequestReceived(session_id=session_id, seq=seq, time=1.0, request_no=1, wire="openai",
                           parts=literal(body), body_size=len(body), body_digest=body_digest(body))


async def append_all(backend: Backend, session_id: str, groups: Sequence[Sequence[Event]], after: int = 0) -> list[int]:
    """Append the envelopes in order; their stream sequences."""
    seqs = []
    for group in groups:
        after = (await backend.log.append(session_id, group, after)).stream_seq
        seqs.append(after)
    return seqs


def events_of(groups: Sequence[Sequence[Event]]) -> list[Event]:
    return [event for group in groups for event in group]


class LogContract:
    """The suite; a subclass provides the ``backend`` fixture."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("a contract module provides the backend")

    async def test_envelopes_are_numbered_in_the_stream_and_read_back_in_order(self, backend: Backend) -> None:
        groups = envelopes(session().events)
        assert await append_all(backend, A, groups) == list(range(1, len(groups) + 1))
        read: list[AnyEvent] = (await backend.read(A)).events
        assert read == events_of(groups)
        assert [type(e) for e in read] == [type(e) for e in events_of(groups)]
        assert await backend.position(A) == len(groups)

    async def test_an_append_acknowledges_where_it_landed(self, backend: Backend) -> None:
        groups = envelopes(session().events)
        appended = await backend.log.append(A, groups[0], 0)
        assert (appended.stream, appended.stream_seq, appended.duplicate, appended.envelopes) == (
            backend.cfg.stream, 1, False, 1)

    async def test_each_envelope_is_stored_under_its_session_and_kind_with_the_log_headers(
            self, backend: Backend) -> None:
        groups = envelopes(session().events)
        await append_all(backend, A, groups)
        stored = await backend.stored()
        assert [m.seq for m in stored] == list(range(1, len(groups) + 1))
        for message, group in zip(stored, groups, strict=True):
            assert message.subject == backend.cfg.subject(A, envelope.kind_of(group))
            assert message.data == envelope.encode(group)
            assert message.headers == {  # exactly these: JetStream keeps every header it is sent
                HDR_MSG_ID: msg_id(A, group[0].seq),
                HDR_EXPECTED_LAST_SUBJECT_SEQ: str(message.seq - 1),  # (the previous message is this session's)
                HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: backend.cfg.session_filter(A),
                HDR_SCHEMA: str(SCHEMA_VERSION),
                HDR_SEQ: f"{group[0].seq}-{group[-1].seq}",
            }

    async def test_an_append_after_another_last_is_ownership_lost_and_stores_nothing(self, backend: Backend) -> None:
        groups = envelopes(session().events)
        await append_all(backend, A, groups[:2])
        for stale in (0, 1, 3, 99):  # behind the session's last message, or ahead of it
            with pytest.raises(OwnershipLost):
                await backend.log.append(A, groups[2], stale)
        with pytest.raises(OwnershipLost):  # a new session under an id that exists (open_session draws again)
            await backend.log.append(A, SessionScript(session_id=A, uid="another").events, 0)
        assert [m.seq for m in await backend.stored()] == [1, 2]
        assert (await backend.read(A)).events == events_of(groups[:2])
        assert (await backend.log.append(A, groups[2], 2)).stream_seq == 3

    async def test_a_stored_envelope_appended_again_after_the_sessions_last_is_a_duplicate(
            self, backend: Backend) -> None:
        """The duplicate window, by ``Nats-Msg-Id`` (``<session>:<first seq>``) alone: acknowledged where the
        envelope was stored, and not stored again, whatever the content."""
        groups = envelopes(session().events)
        first = await backend.log.append(A, groups[0], 0)
        again = await backend.log.append(A, groups[0], first.stream_seq)
        assert (again.stream_seq, again.duplicate, again.envelopes) == (first.stream_seq, True, 1)
        second = await backend.log.append(A, groups[1], first.stream_seq)
        assert (second.stream_seq, second.duplicate) == (2, False)
        older = await backend.log.append(A, groups[0], second.stream_seq)
        assert (older.stream_seq, older.duplicate) == (1, True)  # where it was stored, not the session's last
        other = [msgspec.structs.replace(groups[1][0], idempotency_key="another"), *groups[1][1:]]
        assert (await backend.log.append(A, other, 2)).duplicate  # the same id: the content is not compared
        assert [m.seq for m in await backend.stored()] == [1, 2]
        assert (await backend.read(A)).events == events_of(groups[:2])

    async def test_a_retry_with_the_first_tries_last_is_refused_before_the_duplicate_window(
            self, backend: Backend) -> None:
        """JetStream checks the expected last sequence first: a caller that retries with the sequence its
        first try was made after is refused (only the log's own read-back, below, recovers a lost ack)."""
        groups = envelopes(session().events)
        await backend.log.append(A, groups[0], 0)
        with pytest.raises(OwnershipLost):
            await backend.log.append(A, groups[0], 0)
        assert len(await backend.stored()) == 1

    async def test_an_append_whose_ack_was_lost_is_stored_once_and_reported_a_duplicate(
            self, backend: Backend) -> None:
        groups = envelopes(session().events)
        backend.lose_next_ack()
        appended = await backend.log.append(A, groups[0], 0)
        assert (appended.stream_seq, appended.duplicate) == (1, True)
        after = await backend.log.append(A, groups[1], appended.stream_seq)
        assert (after.stream_seq, after.duplicate) == (2, False)
        assert [m.seq for m in await backend.stored()] == [1, 2]
        assert (await backend.read(A)).events == events_of(groups[:2])

    async def test_interleaved_sessions_share_the_stream_and_keep_their_own_sequence_checks(
            self, backend: Backend) -> None:
        a, b = envelopes(session(A).events), envelopes(session(B, turns=1).events)
        assert (await backend.log.append(A, a[0], 0)).stream_seq == 1
        assert (await backend.log.append(B, b[0], 0)).stream_seq == 2
        assert (await backend.log.append(A, a[1], 1)).stream_seq == 3
        assert (await backend.log.append(B, b[1], 2)).stream_seq == 4
        with pytest.raises(OwnershipLost):  # the stream's last, but not this session's
            await backend.log.append(A, a[2], 4)
        assert (await backend.log.append(A, a[2], 3)).stream_seq == 5
        assert (await backend.read(A)).events == events_of(a[:3])
        assert (await backend.read(B)).events == events_of(b[:2])
        assert (await backend.position(A), await backend.position(B)) == (5, 4)
        assert [backend.cfg.session_of(m.subject) for m in await backend.stored()] == [A, B, A, B, A]

    async def test_an_append_over_the_limit_is_split_into_envelopes_that_fit(self, backend: Backend) -> None:
        script = SessionScript(session_id=A)
        for n in range(6):  # each under the limit (and its values too small to be kept aside), together over it
            script.reward(float(n), note="x" * 10_000)
        appended = await backend.log.append(A, script.events, 0)
        stored = await backend.stored()
        assert appended.envelopes == len(stored) > 1 and appended.stream_seq == stored[-1].seq
        assert all(len(m.data) <= LIMIT and HDR_BLOBS not in m.headers for m in stored)
        assert [m.headers[HDR_MSG_ID] for m in stored] == [
            msg_id(A, envelope.decode(m.data)[0].seq) for m in stored]
        assert (await backend.read(A)).events == script.events

    async def test_a_single_event_over_the_limit_has_its_large_values_kept_in_the_object_store(
            self, backend: Backend) -> None:
        script = SessionScript(session_id=A)
        request = big_request(A, 2, 4 * LIMIT)
        await append_all(backend, A, [script.events, [request]])
        message = (await backend.stored())[-1]
        assert len(message.data) <= LIMIT and message.headers[HDR_BLOBS] == "1"
        body = request.parts[0].data
        assert await backend.piece(f"{A}/{body_digest(body)}") == body
        assert (await backend.read(A)).events == [*script.events, request]

    async def test_an_event_that_cannot_fit_is_payload_too_large_and_nothing_is_stored(
            self, backend: Backend) -> None:
        many = SessionScript(session_id=A, metadata={f"key{i}": "v" * 100 for i in range(2 * LIMIT // 100)})
        with pytest.raises(PayloadTooLarge):
            await backend.log.append(A, many.events, 0)
        assert await backend.stored() == []
        with pytest.raises(SessionNotFound):
            await backend.read(A)

    async def test_an_append_refused_as_too_large_keeps_no_values_of_its_other_events_either(
            self, backend: Backend) -> None:
        script = SessionScript(session_id=A)
        request = big_request(A, 2, 4 * LIMIT)  # fits, once its body is kept aside
        script.events.append(request)
        script.reward(1.0, **{f"key{i}": "v" * 100 for i in range(2 * LIMIT // 100)})  # cannot fit
        with pytest.raises(PayloadTooLarge):
            await backend.log.append(A, script.events, 0)
        assert await backend.stored() == []
        assert await backend.piece(f"{A}/{body_digest(request.parts[0].data)}") is None

    async def test_the_loader_rebuilds_the_fold_of_the_appended_events(self, backend: Backend) -> None:
        script = session()
        groups = envelopes(script.events)
        seqs = await append_all(backend, A, groups)
        state, last = await backend.load(A)
        assert (state, last) == (fold(script.events), seqs[-1])
        assert state.status == "finalized" and state.turns == 2 and state.chains[0].token_ids()[:2] == [10, 11]
        assert tokens.unpack_ids(state.chains[0].segments[0].token_ids).tolist() == [20, 21]
        partial, at = await backend.load(A, until=seqs[1])
        assert (partial, at) == (fold(events_of(groups[:2])), seqs[1])

    async def test_an_unknown_session_is_not_found(self, backend: Backend) -> None:
        await append_all(backend, A, envelopes(session().events)[:1])
        for unknown in (B, "not a session id"):
            with pytest.raises(SessionNotFound):
                await backend.read(unknown)
            with pytest.raises(SessionNotFound):
                await backend.load(unknown)
        assert await backend.position(B) == 0



async def fetch(log: LogPort, stream: str, subject: str, durable: str, *, n: int = 16, timeout: float = 2.0,
                ack_wait: float = 30.0) -> list[Delivery]:
    """What one fetch of the durable consumer (created or bound now) delivers: [] when nothing came."""
    sub = await log.subscribe(stream, subject, durable, ack_wait=ack_wait, max_ack_pending=256)
    try:
        return await sub.fetch(n, timeout=timeout)
    except TimeoutError:
        return []
    finally:
        await sub.unsubscribe()


def ready_signal(cfg: LogConfig, session_id: str, *, message_id: str | None = None
                 ) -> tuple[str, bytes, dict[str, str]]:
    return cfg.ready_subject(session_id), session_id.encode(), {HDR_MSG_ID: message_id or f"ready:{session_id}"}


class PortContract:
    """The log's port beyond the append; a subclass provides the ``backend`` fixture."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("a contract module provides the backend")

    async def test_a_consumer_delivers_in_stream_order_what_its_filter_takes_and_decodes_it(
            self, backend: Backend) -> None:
        cfg = backend.cfg
        groups = envelopes(session().events)
        seqs = await append_all(backend, A, groups)
        await backend.log.publish(*ready_signal(cfg, A))  # another stream: not this consumer's
        got = await fetch(backend.log, cfg.stream, cfg.subjects, "c")
        assert [d.metadata.sequence.stream for d in got] == seqs
        assert [d.subject for d in got] == [cfg.subject(A, envelope.kind_of(g)) for g in groups]
        assert [await backend.log.decode(d) for d in got] == groups

    async def test_an_acknowledged_message_is_not_delivered_again_and_a_consumer_resumes_after_its_acks(
            self, backend: Backend) -> None:
        cfg = backend.cfg
        for sid in (A, B):
            await backend.log.publish(*ready_signal(cfg, sid))
        first = await fetch(backend.log, cfg.ready_stream, cfg.ready_subjects, "m", n=1)
        assert [d.data for d in first] == [A.encode()]
        await first[0].ack()
        again = await fetch(backend.log, cfg.ready_stream, cfg.ready_subjects, "m")  # the same durable
        assert [d.data for d in again] == [B.encode()]
        await again[0].ack()
        assert await fetch(backend.log, cfg.ready_stream, cfg.ready_subjects, "m", timeout=0.3) == []
        other = await fetch(backend.log, cfg.ready_stream, cfg.ready_subjects, "another")  # its own position
        assert [d.data for d in other] == [A.encode(), B.encode()]

    async def test_a_nak_is_delivered_again_and_an_ack_is_not(self, backend: Backend) -> None:
        cfg = backend.cfg
        for sid in (A, B):
            await backend.log.publish(*ready_signal(cfg, sid))
        sub = await backend.log.subscribe(cfg.ready_stream, cfg.ready_subjects, "m", ack_wait=30.0,
                                          max_ack_pending=256)
        try:
            first = await sub.fetch(2, timeout=2.0)
            assert [d.metadata.num_delivered for d in first] == [1, 1]
            await first[0].nak(delay=0.05)
            await first[1].ack()
            again = await sub.fetch(2, timeout=2.0)
            assert [(d.data, d.metadata.num_delivered) for d in again] == [(A.encode(), 2)]
            await again[0].ack()
        finally:
            await sub.unsubscribe()

    async def test_a_message_neither_acked_nor_nakd_within_ack_wait_is_delivered_again(
            self, backend: Backend) -> None:
        cfg = backend.cfg
        await backend.log.publish(*ready_signal(cfg, A))
        sub = await backend.log.subscribe(cfg.ready_stream, cfg.ready_subjects, "m", ack_wait=0.5,
                                          max_ack_pending=256)
        try:
            assert len(await sub.fetch(1, timeout=2.0)) == 1  # and never acknowledged: its process died
            again = await sub.fetch(1, timeout=5.0)
            assert [(d.data, d.metadata.num_delivered) for d in again] == [(A.encode(), 2)]
        finally:
            await sub.unsubscribe()

    async def test_a_ready_signal_is_stored_once_by_its_message_id(self, backend: Backend) -> None:
        cfg = backend.cfg
        first = await backend.log.publish(*ready_signal(cfg, A))
        again = await backend.log.publish(*ready_signal(cfg, A))
        other = await backend.log.publish(*ready_signal(cfg, A, message_id="another"))
        assert (first.stream, first.duplicate) == (cfg.ready_stream, False)
        assert (again.seq, again.duplicate) == (first.seq, True)
        assert (other.seq, other.duplicate) == (first.seq + 1, False)
        got = await fetch(backend.log, cfg.ready_stream, cfg.ready_subjects, "m")
        assert [d.headers[HDR_MSG_ID] for d in got if d.headers] == [f"ready:{A}", "another"]

    async def test_a_sessions_last_message_and_envelopes_are_read_back(self, backend: Backend) -> None:
        cfg = backend.cfg
        groups = envelopes(session().events)
        seqs = await append_all(backend, A, groups[:-1])
        await append_all(backend, B, envelopes(session(B).events)[:1])
        seqs += await append_all(backend, A, groups[-1:], after=seqs[-1])
        last = await backend.log.last_message(cfg.session_filter(A))
        assert last is not None and (last.seq, last.data) == (seqs[-1], envelope.encode(groups[-1]))
        assert last.headers is not None and last.headers[HDR_MSG_ID] == msg_id(A, groups[-1][0].seq)
        opened = await backend.log.last_message(cfg.subject(A, envelope.kind_of(groups[0])))
        assert opened is not None and opened.seq == seqs[0]
        assert await backend.log.last_message(cfg.session_filter("c" * 32)) is None
        assert [item async for item in backend.log.envelopes(A)] == list(zip(seqs, groups, strict=True))
        assert await backend.log.last_stream_seq(A) == seqs[-1]

    async def test_an_envelope_published_as_it_is_follows_the_appends_rules(self, backend: Backend) -> None:
        """What an import does: the stored message, its headers kept, under the expected-last check and the
        duplicate window."""
        cfg = backend.cfg
        groups = envelopes(session().events)

        def message(i: int, after: int) -> tuple[str, bytes, dict[str, str]]:
            group = groups[i]
            return (cfg.subject(A, envelope.kind_of(group)), envelope.encode(group),
                    append_headers(cfg, A, group[0].seq, group[-1].seq, after, schema=SCHEMA_VERSION))

        first = await backend.log.publish(*message(0, 0))
        assert (first.seq, first.duplicate) == (1, False)
        with pytest.raises(OwnershipLost):  # the session's last is 1 now
            await backend.log.publish(*message(1, 0))
        again = await backend.log.publish(*message(0, 1))
        assert (again.seq, again.duplicate) == (1, True)
        assert (await backend.log.publish(*message(1, 1))).seq == 2
        assert (await backend.read(A)).events == events_of(groups[:2])

    async def test_its_kv_buckets_are_the_logs(self, backend: Backend) -> None:
        bucket = backend.log.kv(backend.cfg.markers_bucket)
        revision = await bucket.create("k", b"v")
        assert await backend.log.kv(backend.cfg.markers_bucket).get("k") == (b"v", revision)

    async def test_an_image_stored_for_a_session_is_read_back_by_its_digest_and_only_for_it(
            self, backend: Backend) -> None:
        data = bytes(range(256)) * 40
        digest = hashlib.sha256(data).digest()
        await backend.log.put_pieces(A, {digest: data})  # as the edge stores an image, before its events
        assert await backend.log.image(A, digest.hex()) == data
        assert await backend.log.image(B, digest.hex()) is None  # images are kept per session
        assert await backend.log.image(A, "00" * 32) is None
