"""The edge's application service: sessions, turns, rewards. Load, decide, append, answer.

Routes call these methods with decoded, wire-neutral arguments; the methods raise the
:mod:`schemas.errors` family and never know about HTTP. A new session is created with its
lease (:mod:`edge.ownership`); a model request that repeats a recorded one is answered
from the log (:mod:`edge.idempotency`); a finalized or aborted session is released.

One session per ``(uid, session_index)``: the materializer keys trajectories
``{uid}_{session_index}_{trajectory_index}``, so a second session with the pair would have its
records dropped. Opening a session with a client-chosen uid claims the pair in the session
index (:class:`edge.session_index.KvSessionIndex`): refused with 409 while another session of the same or a newer
``metadata.attempt`` holds it; a newer attempt (verl re-issuing a prompt) takes it over. When
the session's own open fails after the claim (its lease or its first append), the claim is
undone (deleted, or the previous holder written back), so the pair is not held by a session
that does not exist; should undoing fail too (the log unreachable), the pair stays held until
a newer attempt takes it over or an operator deletes the key.

A model or reward request is authorized (:meth:`EdgeService.authorize`) from its headers alone,
before its body is read; the turn then runs in the session that authorization found.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from edge.chat.conversation import Conversation
from edge.forks import recover_histories
from edge.idempotency import RequestIdentity, identify, recorded_outcome, repeated_request
from edge.live import LiveSession, Registry
from edge.metrics import EdgeMetrics
from edge.ownership import KvLeases
from edge.session_index import NO_CLAIM, IndexClaim, SessionIndex, attempt_of
from edge.settings import EdgeSettings, body_limits
from edge.stored import Decode, Stored, held, resolve
from edge.streaming import Item, RecordedStream, TurnStream
from edge.tokens.incremental import TemplateMode
from edge.turns import Clock, TurnOutcome, TurnRequest, TurnRunner
from edge.wires.strict import check_sampling
from eventlog.publisher import EventLog
from eventlog.reader import SessionLog
from reward.intake import parse_reward_info
from schemas.errors import (
    CapacityExceeded,
    Conflict,
    MalformedRequest,
    OwnershipLost,
    ResponseNotFound,
    RollbusError,
    SessionClosed,
    SessionNotFound,
    Unauthorized,
)
from schemas.events import RewardReported, SamplingDefaults, SessionAborted, SessionFinalized, SessionOpened
from schemas.log import check_session_id
from schemas.metadata import read_settings
from schemas.values import INT32_MAX, check_free_form
from session.fold import apply
from session.numbering import UNNUMBERED, numbered
from session.summary import SessionSummary, summarize

log = logging.getLogger(__name__)

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


REFUSED = "a valid api key for this session is required (Authorization: Bearer or x-api-key)"
"""The one answer (401) to a model or reward request without its session's key, whatever else is wrong."""


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
        if reader is not None:
            turns.recover_histories = self._recover_histories
        self.body_limits = body_limits(settings)  # the model routes' request bodies
        self.metrics = turns.metrics  # the turns' registry: the edge's /metrics
        self.metrics.group(EdgeMetrics).sessions_open.set_function(registry.__len__)

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def leases(self) -> KvLeases | None:
        return self._leases

    @property
    def template_mode(self) -> TemplateMode:
        """How the chat template's chains are encoded (prefix-stable or continuous tokens), and why."""
        return self._turns.codec.mode

    async def close_log(self) -> None:
        """Close the log's own connection, if it has one, and the image fetcher's (after the last request)."""
        await self._turns.images.aclose()
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
            return NO_CLAIM
        return await self._index.claim(uid, spec.session_index, attempt_of(spec.metadata), session_id)

    def _opened(self, session_id: str, uid: str, spec: OpenSession, api_key: str) -> SessionOpened:
        agent_name = spec.metadata.get("agent_name", "")
        return SessionOpened(
            session_id=session_id, seq=1, time=self._clock(), uid=uid, session_index=spec.session_index,
            agent_name=agent_name if isinstance(agent_name, str) else "", metadata=spec.metadata,
            sampling=spec.sampling, api_key_digest=key_digest(api_key),
            max_trajectory_length=self.settings.max_trajectory_length, tokenizer=self.settings.tokenizer,
            tool_format=self.settings.tool_format, edge_id=self.settings.edge_id,
            reasoning_format=self.settings.reasoning_format, template_mode=self.template_mode.name,
            processor=self._turns.images.processor_name or msgspec.UNSET,
        )

    async def authorize(self, session_id: str, api_key: str | None) -> LiveSession:
        """The open session whose key ``api_key`` is: what a model or reward request is checked against
        from its headers alone, before its body is read. Without the session's key every refusal is the
        same :data:`REFUSED` (no key, a wrong one, a malformed, unknown, finalized or aborted session), so
        that such a client learns nothing about the session; with it, a closed session is
        :class:`SessionClosed`."""
        if api_key is None:
            raise Unauthorized(REFUSED)
        live = self._registry.peek(session_id)
        if live is not None and live.verified_key is not None and same_secret(api_key, live.verified_key):
            return live
        digest = key_digest(api_key)

        def admit(expected: str) -> None:
            if not hmac.compare_digest(digest, expected):
                raise Unauthorized(REFUSED)

        try:
            live = await self._registry.get(check_session_id(session_id), admit)
        except SessionNotFound:
            raise Unauthorized(REFUSED) from None
        live.verified_key = api_key
        return live

    async def complete(self, live: LiveSession, request: TurnRequest) -> TurnOutcome:
        """Run a model turn in the authorized session (:meth:`authorize`), or answer a repeated request
        with the completion recorded for it."""
        live, identity, request = await self._identified(live, request)
        with live.in_use():
            outcome = await self._recorded(live, identity) if identity.may_repeat else None
            if outcome is not None:
                self.metrics.group(EdgeMetrics).replayed(request.wire)
                return outcome
            with live.inflight.running(identity, request.disconnect):
                return await self._turns.run(live, request)

    async def stream(self, live: LiveSession, request: TurnRequest) -> tuple[TurnStream | RecordedStream, Item]:
        """Start a streamed turn in the authorized session: the stream and its first event (see
        :mod:`edge.streaming`). A repeated request whose turn is recorded gets that completion streamed
        back; the engine is not called."""
        live, identity, request = await self._identified(live, request)
        with live.in_use():
            outcome = await self._recorded(live, identity)
        if outcome is not None:
            self.metrics.group(EdgeMetrics).replayed(request.wire)
            recorded = RecordedStream(outcome)
            return recorded, recorded.first
        return await TurnStream.open(self._turns, live, request)

    async def _identified(self, live: LiveSession,
                          request: TurnRequest) -> tuple[LiveSession, RequestIdentity, TurnRequest]:
        """The session as this edge holds it now, the request's identity, and the request carrying its
        body digest (and what it names of the session resolved: a stored conversation, reasoning)."""
        if live.lost:  # let go while the body was read (its log moved, or an append's outcome is unknown)
            live = await self._registry.get(live.session_id)
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

    async def _recover_histories(self, live: LiveSession) -> None:
        """A taken-over session's chain histories, from its log (once): where its next forks come from."""
        if self._reader is None or not live.histories.to_recover:
            return
        try:
            events = (await self._reader(live.session_id)).events
        except RollbusError as exc:  # the turn goes on: its fork's cause is then unknown
            log.warning("could not read %s to recover its chains' histories: %s", live.session_id, exc)
            live.histories.recovered(())
            return
        live.histories.recovered(recover_histories(events, live.state, self.decoders))

    async def stored_response(self, live: LiveSession, request_no: int,
                              wire: str = "responses") -> tuple[TurnOutcome, Stored]:
        """The answer a stored response of the authorized session got, and what was stored with it
        (``GET .../responses/{id}``)."""
        session_id = live.session_id
        stored = await self._stored(live, request_no, wire)
        outcome = recorded_outcome(live.state, request_no) if stored is not None else None
        if stored is None or outcome is None:
            raise ResponseNotFound(f"session {session_id} holds no stored response {request_no}",
                                   param="response_id")
        return outcome, stored

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each sampled token as text (for ``logprobs`` in replies)."""
        return [self._turns.codec.tokenizer.decode([t]) for t in token_ids]

    async def reward_access(self, session_id: str, api_key: str | None) -> LiveSession:
        """The session a reward is posted to, authorized like a model request (:meth:`authorize`); with
        its key, a closed session too, read from the log (the reward is recorded there for audit)."""
        try:
            return await self.authorize(session_id, api_key)
        except SessionClosed:  # the key is the session's: checked first
            return await self._registry.load(session_id)

    async def report_reward(self, live: LiveSession, reward_info: dict[str, Any]) -> None:
        """Record a posted reward (``live``: from :meth:`reward_access`). After the session ended it is
        still recorded (for audit) but changes nothing: the records are derived from the session as it
        ended, so the caller gets 409."""
        posted = parse_reward_info(reward_info)
        event = RewardReported(session_id=live.session_id, seq=UNNUMBERED, time=self._clock(), reward=posted.reward,
                               extra=posted.extra)
        if live.state.status == "open":
            try:
                with live.in_use():
                    await live.commit(self._log, lambda state: numbered([event], state.seq))
                return
            except SessionClosed:  # it ended since
                live = await self._registry.load(live.session_id)
        await live.commit(self._log, lambda state: numbered([event], state.seq), allow_closed=True)
        raise SessionClosed(f"session {live.session_id} is {live.state.status}: its records are derived without "
                            "this reward (it was recorded in the log for audit)")

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
        event = event_type(session_id=session_id, seq=UNNUMBERED, time=self._clock(), reason=reason)
        await live.commit(self._log, lambda state: numbered([event], state.seq))
        await self._registry.release(session_id)
        if status == "aborted":
            self.metrics.failures.labels("edge", "session_aborted").inc()
        return summarize(live.state)

    async def abort_if_idle(self, session_id: str, idle_timeout: float, reason: str = "idle_timeout") -> bool:
        """Abort the session if nothing touched it for ``idle_timeout`` seconds (taking it over if needed)."""
        live = await self._registry.get(check_session_id(session_id))
        if live.idle_for() < idle_timeout:
            return False
        event = SessionAborted(session_id=session_id, seq=UNNUMBERED, time=self._clock(), reason=reason)
        await live.commit(self._log, lambda state: numbered([event], state.seq))
        await self._registry.release(session_id)
        self.metrics.failures.labels("edge", "session_idle").inc()
        return True
