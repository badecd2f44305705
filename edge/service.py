"""The edge's application service: sessions, turns, rewards. Load, decide, append, answer.

Routes call these methods with decoded, wire-neutral arguments; the methods raise the
:mod:`schemas.errors` family and never know about HTTP. A new session is created with its
lease (:mod:`edge.ownership`); a model request that repeats a recorded one is answered
from the log (:mod:`edge.idempotency`); a finalized or aborted session is released.

One session per ``(uid, session_index)``: the materializer keys trajectories
``{uid}_{session_index}_{trajectory_index}``, so a second session with the pair would have its
records dropped. Opening a session with a client-chosen uid claims the pair in the session
index (:class:`KvSessionIndex`): refused with 409 while another session of the same or a newer
``metadata.attempt`` holds it; a newer attempt (verl re-issuing a prompt) takes it over. When
the session's own open fails after the claim (its lease or its first append), the claim is
undone (deleted, or the previous holder written back), so the pair is not held by a session
that does not exist; should undoing fail too (the log unreachable), the pair stays held until
a newer attempt takes it over or an operator deletes the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from edge.codec.conversation import Conversation
from edge.codec.strict import check_sampling
from edge.idempotency import RequestIdentity, identify, recorded_outcome, repeated_request
from edge.live import LiveSession, Registry
from edge.ownership import KvLeases
from edge.settings import EdgeSettings
from edge.stored import Decode, Stored, held, resolve
from edge.streaming import Item, RecordedStream, TurnStream
from edge.turns import Clock, TurnOutcome, TurnRequest, TurnRunner
from eventlog.publisher import EventLog
from eventlog.reader import SessionLog
from reward.intake import parse_reward_info
from schemas.errors import (
    CapacityExceeded,
    Conflict,
    LogUnavailable,
    MalformedRequest,
    OwnershipLost,
    ResponseNotFound,
    SessionClosed,
    Unauthorized,
)
from schemas.events import RewardReported, SamplingDefaults, SessionAborted, SessionFinalized, SessionOpened
from schemas.log import LogConfig, check_session_id
from schemas.metadata import or_default, read_settings
from schemas.values import INT32_MAX, check_free_form
from session.fold import apply
from session.summary import SessionSummary, summarize
from session_projector.projections import UNAVAILABLE

log = logging.getLogger(__name__)

T = TypeVar("T")
Reader = Callable[[str], Awaitable[SessionLog]]


class OpenSession(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /sessions`` body."""

    uid: str | None = None
    session_index: int = 0
    metadata: dict[str, Any] = {}
    sampling: SamplingDefaults = SamplingDefaults()


class OpenedSession(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    api_key: str


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def same_secret(given: str, expected: str) -> bool:
    """Constant-time equality of two keys, whatever characters the client sent (compared as bytes:
    ``hmac.compare_digest`` refuses non-ASCII strings)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def _check_metadata(metadata: dict[str, Any]) -> None:
    """Refuse (400) a setting the materializer reads (:mod:`schemas.metadata`) of the wrong type, and
    any value the log cannot hold: any other key is the task's, any JSON, its integers within 64 bits."""
    _, invalid = read_settings(metadata)
    if invalid:
        bad = invalid[0]
        raise MalformedRequest(f"metadata.{bad.key} must be {bad.expected}", param=f"metadata.{bad.key}")
    for key, value in metadata.items():
        check_free_form(value, f"metadata.{key}")


def _check_open_request(spec: OpenSession) -> str:
    """The session's uid; refuses (400, naming the field) what the records could not hold."""
    uid = spec.uid if spec.uid is not None else uuid.uuid4().hex
    if not uid or "_" in uid or len(uid) > 128:
        raise MalformedRequest("uid must be 1-128 characters without '_'", param="uid")
    if not 0 <= spec.session_index <= INT32_MAX:
        raise MalformedRequest(f"session_index must be an integer from 0 to {INT32_MAX}", param="session_index")
    _check_metadata(spec.metadata)
    s = spec.sampling
    check_sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, stop=s.stop,
                   prefix="sampling.")
    return uid


class IndexHolder(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a session index entry: the session that holds a (uid, session_index)."""

    session_id: str
    attempt: int = 0


_holder_decoder = msgspec.json.Decoder(IndexHolder)


def _holder(value: bytes, key: str) -> IndexHolder:
    try:
        return _holder_decoder.decode(value)
    except msgspec.DecodeError as exc:  # not written by an edge: who holds the pair is unknown
        raise LogUnavailable(f"session index entry {key} is not a session index entry: {exc}") from exc


def index_key(uid: str, session_index: int) -> str:
    """The session index key of ``(uid, session_index)``: a digest, safe as a KV key whatever the uid."""
    return hashlib.sha256(msgspec.json.encode([uid, session_index])).hexdigest()


def attempt_of(metadata: dict[str, Any]) -> int:
    """The session's dispatch attempt (``metadata.attempt``, checked by :func:`_check_metadata`; 0 without it)."""
    return or_default(read_settings(metadata)[0].attempt, 0)


class IndexClaim(Protocol):
    async def release(self) -> None:
        """Undo the claim (best effort): the session it was for was not opened."""


class SessionIndex(Protocol):
    async def claim(self, uid: str, session_index: int, attempt: int, session_id: str) -> IndexClaim:
        """Make ``session_id`` the holder of ``(uid, session_index)``, or raise :class:`Conflict`."""


class _KvClaim:
    def __init__(self, kv: KeyValue, key: str, revision: int, previous: bytes | None, timeout: float) -> None:
        self._kv = kv
        self._key = key
        self._revision = revision
        self._previous = previous
        self._timeout = timeout

    async def release(self) -> None:
        try:
            if self._previous is None:
                await asyncio.wait_for(self._kv.delete(self._key, last=self._revision), self._timeout)
            else:
                await asyncio.wait_for(self._kv.update(self._key, self._previous, last=self._revision), self._timeout)
        except (KeyWrongLastSequenceError, *UNAVAILABLE) as exc:
            log.warning("session index key %s not released: %r", self._key, exc)


class KvSessionIndex:
    """``cfg.session_index_bucket``: ``index_key(uid, session_index)`` -> :class:`IndexHolder`, written
    by compare-and-set (revision 0 to create). Read and written only when a session opens."""

    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, timeout: float = 5.0, tries: int = 4) -> None:
        self._js = js
        self._cfg = cfg
        self._timeout = timeout
        self._tries = tries
        self._kv: KeyValue | None = None

    async def claim(self, uid: str, session_index: int, attempt: int, session_id: str) -> IndexClaim:
        kv = await self._bucket()
        key = index_key(uid, session_index)
        value = msgspec.json.encode(IndexHolder(session_id=session_id, attempt=attempt))
        for _ in range(self._tries):
            try:
                entry = await self._bounded(kv.get(key))
            except KeyNotFoundError as exc:  # never held, or a released claim (its marker's revision)
                previous, revision = None, int(exc.entry.revision or 0) if exc.entry is not None else 0
            else:
                previous, revision = entry.value or b"", int(entry.revision or 0)
                holder = _holder(previous, key)
                if attempt <= holder.attempt:
                    raise Conflict(
                        f"uid {uid!r} session_index {session_index} is already taken by session "
                        f"{holder.session_id} (attempt {holder.attempt}); only a newer metadata.attempt "
                        f"than {holder.attempt} may open it again", param="session_index")
            try:
                new_revision = await self._bounded(kv.update(key, value, last=revision))
            except KeyWrongLastSequenceError:  # another open of the pair came first: look again
                continue
            if previous is not None:
                log.info("uid %r session_index %d: attempt %d takes over from session %s", uid, session_index,
                         attempt, _holder(previous, key).session_id)
            return _KvClaim(kv, key, new_revision, previous, self._timeout)
        raise Conflict(f"uid {uid!r} session_index {session_index} is being opened concurrently",
                       param="session_index")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self._bounded(self._js.key_value(self._cfg.session_index_bucket))
            except NotFoundError as exc:
                raise LogUnavailable(f"KV bucket {self._cfg.session_index_bucket} does not exist") from exc
        return self._kv

    async def _bounded(self, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, self._timeout)
        except UNAVAILABLE as exc:
            raise LogUnavailable("JetStream did not answer a session index operation") from exc


class _NoClaim:
    async def release(self) -> None:
        return None


_NO_CLAIM = _NoClaim()


class EdgeService:
    def __init__(self, *, settings: EdgeSettings, registry: Registry, log: EventLog, turns: TurnRunner,
                 clock: Clock = time.time, leases: KvLeases | None = None, index: SessionIndex | None = None,
                 reader: Reader | None = None) -> None:
        """``index``: the one-session-per-(uid, session_index) index (:class:`KvSessionIndex`; none in
        in-memory unit tests, which then do not check the pair). ``reader``: a session's events from the
        log, for what the live state does not hold (stored conversations, :mod:`edge.stored`)."""
        self.settings = settings
        self._registry = registry
        self._log = log
        self._turns = turns
        self._clock = clock
        self._leases = leases
        self._index = index
        self._reader = reader
        self.decoders: dict[str, Decode] = {}  # by wire: its adapter's decoding (the app registers them)
        self.metrics = turns.metrics  # the turns' registry: the edge's /metrics
        self.metrics.edge.sessions_open.set_function(registry.__len__)

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def leases(self) -> KvLeases | None:
        return self._leases

    async def close_log(self) -> None:
        """Close the log's own connection, if it has one (after the last request)."""
        close = getattr(self._log, "close", None)
        if close is not None:
            await close()

    async def open_session(self, spec: OpenSession) -> OpenedSession:
        uid = _check_open_request(spec)
        if len(self._registry) >= self.settings.max_open_sessions:
            raise CapacityExceeded(f"{len(self._registry)} sessions are open (limit {self.settings.max_open_sessions})")
        api_key = "rb-" + secrets.token_urlsafe(24)
        for _ in range(3):
            session_id = uuid.uuid4().hex
            opened = self._opened(session_id, uid, spec, api_key)
            claim = await self._claim(uid, spec, session_id)  # Conflict: the pair is another session's
            try:
                lease = await self._leases.create(session_id) if self._leases is not None else None
                appended = await self._log.append(session_id, [opened], 0)
            except OwnershipLost:  # the id is taken: draw another
                await claim.release()
                continue
            except BaseException:
                await claim.release()
                raise
            self._registry.add(LiveSession(apply(None, opened), appended.stream_seq, lease, clock=self._clock))
            return OpenedSession(session_id=session_id, api_key=api_key)
        raise Conflict("could not allocate a session id")

    async def _claim(self, uid: str, spec: OpenSession, session_id: str) -> IndexClaim:
        """Claim ``(uid, session_index)`` for the new session; a uid drawn here is unique already."""
        if self._index is None or spec.uid is None:
            return _NO_CLAIM
        return await self._index.claim(uid, spec.session_index, attempt_of(spec.metadata), session_id)

    def _opened(self, session_id: str, uid: str, spec: OpenSession, api_key: str) -> SessionOpened:
        agent_name = spec.metadata.get("agent_name", "")
        return SessionOpened(
            session_id=session_id, seq=1, time=self._clock(), uid=uid, session_index=spec.session_index,
            agent_name=agent_name if isinstance(agent_name, str) else "", metadata=spec.metadata,
            sampling=spec.sampling, api_key_digest=key_digest(api_key),
            max_trajectory_length=self.settings.max_trajectory_length, tokenizer=self.settings.tokenizer,
            tool_format=self.settings.tool_format, edge_id=self.settings.edge_id,
        )

    async def authorized(self, session_id: str, api_key: str | None) -> LiveSession:
        """The open session, if ``api_key`` is its key."""
        live = self._registry.peek(session_id)  # held here: its id was checked when it was taken
        if live is None:
            live = await self._registry.get(check_session_id(session_id))
        if api_key is None:
            raise Unauthorized("missing api key (Authorization: Bearer or x-api-key)")
        if live.verified_key is not None and same_secret(api_key, live.verified_key):
            return live
        if not hmac.compare_digest(key_digest(api_key), live.state.api_key_digest):
            raise Unauthorized("invalid api key for this session")
        live.verified_key = api_key
        return live

    async def complete(self, session_id: str, api_key: str | None, request: TurnRequest) -> TurnOutcome:
        """Run a model turn, or answer a repeated request with the completion recorded for it."""
        live, identity, request = await self._identified(session_id, api_key, request)
        with live.in_use():
            outcome = await self._recorded(live, identity) if identity.may_repeat else None
            if outcome is not None:
                self.metrics.edge.replayed(request.wire)
                return outcome
            with live.inflight.running(identity, request.disconnect):
                return await self._turns.run(live, request)

    async def stream(self, session_id: str, api_key: str | None,
                     request: TurnRequest) -> tuple[TurnStream | RecordedStream, Item]:
        """Start a streamed turn: the stream and its first event (see :mod:`edge.streaming`). A repeated
        request whose turn is recorded gets that completion streamed back; the engine is not called."""
        live, identity, request = await self._identified(session_id, api_key, request)
        with live.in_use():
            outcome = await self._recorded(live, identity)
        if outcome is not None:
            self.metrics.edge.replayed(request.wire)
            recorded = RecordedStream(outcome)
            return recorded, recorded.first
        return await TurnStream.open(self._turns, live, request)

    async def _identified(self, session_id: str, api_key: str | None,
                          request: TurnRequest) -> tuple[LiveSession, RequestIdentity, TurnRequest]:
        """The authorized session, the request's identity, and the request carrying its body digest."""
        live = await self.authorized(session_id, api_key)
        continues = request.conversation.continues
        if continues is not None and continues.session_id == live.session_id:
            await self._stored(live, continues.request_no, request.wire)
        conversation = resolve(request.conversation, live.session_id, live.stored)
        if conversation.known is not None:  # what the session's next request on this wire is decoded against
            live.known[request.wire] = conversation.known
        identity = identify(request.body, request.idempotency_key, request.retry_count, conversation.body_digest)
        return live, identity, msgspec.structs.replace(request, conversation=conversation,
                                                       body_digest=identity.body_digest)

    @staticmethod
    async def _recorded(live: LiveSession, identity: RequestIdentity) -> TurnOutcome | None:
        """The completion recorded for an earlier request this one repeats (after it settles), if any
        (never for one that may not repeat: see ``RequestIdentity.may_repeat``)."""
        await live.inflight.settled(identity)
        earlier = repeated_request(live.state, identity)
        return recorded_outcome(live.state, earlier) if earlier is not None else None

    async def count_tokens(self, live: LiveSession, conversation: Conversation) -> int:
        """The prompt tokens a turn for ``conversation`` would have now, on the authorized session ``live``
        (:meth:`TurnRunner.count_prompt`); nothing is recorded."""
        with live.in_use():
            return await self._turns.count_prompt(live, conversation)

    async def _stored(self, live: LiveSession, request_no: int, wire: str) -> Stored | None:
        """The stored conversation of request ``request_no``: held, or rebuilt from the log (edge.stored)."""
        reader, session_id = self._reader, live.session_id
        read = (lambda: reader(session_id)) if reader is not None else None
        return await held(live.stored, live.state, request_no, wire, self.decoders.get(wire), read)

    async def stored_response(self, session_id: str, api_key: str | None, request_no: int,
                              wire: str = "responses") -> tuple[TurnOutcome, Stored]:
        """The answer a stored response got, and what was stored with it (``GET .../responses/{id}``)."""
        live = await self.authorized(session_id, api_key)
        stored = await self._stored(live, request_no, wire)
        outcome = recorded_outcome(live.state, request_no) if stored is not None else None
        if stored is None or outcome is None:
            raise ResponseNotFound(f"session {session_id} holds no stored response {request_no}",
                                   param="response_id")
        return outcome, stored

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each sampled token as text (for ``logprobs`` in replies)."""
        return [self._turns.codec.tokenizer.decode([t]) for t in token_ids]

    async def report_reward(self, session_id: str, api_key: str | None, reward_info: dict[str, Any]) -> None:
        """Record a posted reward. After the session ended it is still recorded (for audit) but changes
        nothing: the records are derived from the session as it ended, so the caller gets 409."""
        posted = parse_reward_info(reward_info)
        event = RewardReported(session_id=session_id, seq=0, time=self._clock(), reward=posted.reward,
                               extra=posted.extra)
        try:
            live = await self.authorized(session_id, api_key)
            with live.in_use():
                await live.commit(self._log, lambda _: [event])
        except SessionClosed:
            status = await self._record_late_reward(session_id, api_key, event)
            raise SessionClosed(f"session {session_id} is {status}: its records are derived without this reward "
                                "(it was recorded in the log for audit)") from None

    async def _record_late_reward(self, session_id: str, api_key: str | None, event: RewardReported) -> str:
        late = await self._registry.load(session_id)
        if api_key is None or not hmac.compare_digest(key_digest(api_key), late.state.api_key_digest):
            raise Unauthorized("invalid api key for this session")
        await late.commit(self._log, lambda _: [event], allow_closed=True)
        return late.state.status

    async def summary(self, session_id: str) -> SessionSummary:
        return await self._registry.summary(check_session_id(session_id))

    async def finalize(self, session_id: str, reason: str = "finalized") -> SessionSummary:
        """Finalize (idempotent: finalizing a finalized session answers the same)."""
        return await self._end(session_id, "finalized", SessionFinalized, reason)

    async def abort(self, session_id: str, reason: str) -> SessionSummary:
        """Abort (idempotent likewise); a finalized session cannot be aborted (409)."""
        return await self._end(session_id, "aborted", SessionAborted, reason)

    async def _end(self, session_id: str, status: str, event_type: type[SessionFinalized] | type[SessionAborted],
                   reason: str) -> SessionSummary:
        summary = await self.summary(session_id)
        if summary.status == status:
            return summary
        if summary.status != "open":
            raise SessionClosed(f"session {session_id} is already {summary.status} ({summary.close_reason})")
        live = await self._registry.get(session_id)
        event = event_type(session_id=session_id, seq=0, time=self._clock(), reason=reason)
        await live.commit(self._log, lambda _: [event])
        await self._registry.release(session_id)
        if status == "aborted":
            self.metrics.failures.labels("edge", "session_aborted").inc()
        return summarize(live.state)

    async def abort_if_idle(self, session_id: str, idle_timeout: float, reason: str = "idle_timeout") -> bool:
        """Abort the session if nothing touched it for ``idle_timeout`` seconds (taking it over if needed)."""
        live = await self._registry.get(check_session_id(session_id))
        if live.idle_for() < idle_timeout:
            return False
        event = SessionAborted(session_id=session_id, seq=0, time=self._clock(), reason=reason)
        await live.commit(self._log, lambda _: [event])
        await self._registry.release(session_id)
        self.metrics.failures.labels("edge", "session_idle").inc()
        return True
