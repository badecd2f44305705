"""One model turn: load, decide, generate, append, answer.

The turn is decided from the session's fold state, read and never changed while planning: the
decisions are pure (:mod:`session.chains` selects the chain, :mod:`session.turn` plans the turn
and gives its events, numbered), the encoding is :mod:`edge.tokens`'s.
:meth:`TurnRunner.begin` loads and decides, the engine samples, :meth:`TurnRunner.commit`
appends (:meth:`edge.live.LiveSession.commit`, which gets the events from
:func:`session.turn.turn_events` for the state as it is then). :meth:`TurnRunner.run` does the
three for a plain request; :mod:`edge.streaming` does them for a streamed one. The agent gets
its answer (or a stream's last event) only after the turn's events are acknowledged by the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar, overload

import msgspec

from edge.chat.conversation import Conversation, Message, TurnOutcome
from edge.chat.digest import extend, prefix_digests, tools_digest
from edge.engine_input import MIN_TOKENS, InputBuffer
from edge.engines.base import Constraint, Engine, GenerateRequest, GenerateResult, SamplingParams
from edge.forks import Histories, classify, reserialized_continuation
from edge.images import EdgeImages
from edge.live import Decide, LiveSession
from edge.metrics import ABANDONED, ENGINE_ERROR, OK, REFUSED, EdgeMetrics
from edge.settings import Clock, EdgeSettings
from edge.stored import with_reasoning
from edge.tokens.constraint import MARKERS, derive_constraint
from edge.tokens.images import digested, images_of
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers import make_reasoning
from edge.tokens.parsers.base import ParsedOutput, ToolParser
from edge.tokens.reasoning import opens_reasoning
from edge.tokens.reply import ReplyParser, call_ids
from eventlog.publisher import EventLog
from observability.registry import Metrics
from schemas import tokens
from schemas.errors import EngineError, NoRoom, RollbusError, TemplateNotIncremental
from schemas.events import ImageRef, TurnCompleted, body_digest
from session.chains import Continue, Exhausted, NewChain, Rollback, Selection, select_chain
from session.fold import SessionState
from session.turn import (
    Received,
    Sampled,
    TurnFacts,
    TurnPlan,
    abandoned_events,
    engine_ids,
    failure_events,
    fills,
    plan_turn,
    refusal_events,
    refuses,
    turn_events,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


DISCONNECTED = "client_disconnected"


class Disconnect:
    """A client's disconnect, which may abort its plain turn while the engine samples.

    The route calls :meth:`client_gone` when the connection drops. The turn is not cut at
    once: an SDK that timed out retries the same request, and the retry should get this
    turn's completion (:mod:`edge.idempotency`), not sample again. So the abort waits
    ``grace`` seconds; a repeat that arrives meanwhile *adopts* the turn (:meth:`adopted`)
    and it runs to its end. Otherwise the engine request is cancelled (and aborted), the
    chain is left as it was and ``turn_abandoned`` is recorded, as for a stream. A turn
    whose sampling is over when the timer fires commits (the log decides): only the answer
    is lost.
    """

    def __init__(self, grace: float = 10.0) -> None:
        self.gone = False
        self._grace = grace
        self._adopted = False
        self._sampling: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def client_gone(self) -> None:
        self.gone = True
        if not self._adopted:
            self._timer = asyncio.get_running_loop().call_later(self._grace, self._abort)

    def adopted(self) -> None:
        """A repeat of this request is waiting for it: let it finish."""
        self._adopted = True
        if self._timer is not None:
            self._timer.cancel()

    def _abort(self) -> None:
        if self._sampling is not None and not self._adopted:
            self._sampling.cancel()

    def sampling(self) -> Disconnect:
        """``with disconnect.sampling():`` around the engine call, which the abort cancels."""
        return self

    def __enter__(self) -> None:
        self._sampling = asyncio.current_task()

    def __exit__(self, *exc: object) -> None:
        self._sampling = None
        if self._timer is not None:
            self._timer.cancel()


class TurnRequest(msgspec.Struct, frozen=True, kw_only=True):
    conversation: Conversation
    wire: str
    body: bytes
    idempotency_key: str | None = None
    retry_count: int = 0  # the SDK's x-stainless-retry-count (edge.idempotency)
    disconnect: Disconnect | None = None
    body_digest: str = ""  # sha256 of ``body`` once computed (schemas.events.body_digest)


class PreparedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A turn decided up to the engine call: ``generate`` is None when it is refused (no room)."""

    request: TurnRequest
    received: Received
    plan: TurnPlan | None = None
    generate: GenerateRequest | None = None
    closing: int | None = None  # refused: the chain its refusal closes (None: none)
    images: tuple[tuple[str, bytes], ...] = ()  # (digest, bytes) of the request's images, in order
    image_bytes: dict[str, bytes] = {}  # the plan's images' bytes, by digest (stored before its events)

    @property
    def request_no(self) -> int:
        return self.received.request_no

    @property
    def uses_tools(self) -> bool:
        return self.request.conversation.tool_choice != "none"


class _Roles(Sequence[str]):
    """The messages' roles, each read only if chain selection looks at it (a rollback check)."""

    __slots__ = ("_messages",)

    def __init__(self, messages: Sequence[Message]) -> None:
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [m.role for m in self._messages[index]]
        return self._messages[index].role


OFFLOAD_CHARS = 64 * 1024
"""New text from which a turn is planned off the event loop (~0.1 s of tokenizing here)."""
OFFLOADED = 2
"""Turns planned on worker threads at once; more wait their turn (each holds its request)."""


def _text_size(messages: Sequence[Message]) -> int:
    """Characters to tokenize in ``messages``, roughly (what the template adds is left out)."""
    return sum(len(m.content) + len(m.reasoning or "") + sum(len(c.arguments) for c in m.tool_calls)
               for m in messages)


def _chat_turns(messages: Sequence[Message]) -> int:
    return sum(1 for m in messages if m.role in ("user", "assistant"))


class TurnRunner:
    def __init__(self, *, settings: EdgeSettings, codec: TemplateCodec, engine: Engine, log: EventLog,
                 parser: ToolParser, clock: Clock = time.time, metrics: Metrics | None = None,
                 images: EdgeImages | None = None) -> None:
        """``metrics``: where turns, tokens and rollbacks are counted (a registry of its own if None); ``images``:
        what is done with a request's images (None: no processor, images refused)."""
        self._settings = settings
        self.codec = codec
        self.images = images if images is not None else EdgeImages(None)
        if self.images.tokens is not None:
            codec.image_placeholder = self.images.tokens.placeholder
        self._engine = engine
        self._log = log
        self._clock = clock
        opened = opens_reasoning(codec.generation_prompt)
        self.replies = ReplyParser(parser, starts_in_reasoning=opened,
                                   reasoning=make_reasoning(settings.reasoning_format, starts_open=opened))
        self._token_markers = frozenset(m for m in MARKERS if codec.tokenizer.is_added_token(m))
        self._offloaded = asyncio.Semaphore(OFFLOADED)
        self.metrics = metrics if metrics is not None else Metrics()
        self._counted = self.metrics.group(EdgeMetrics)
        # recovers a taken-over session's chain histories from the log (the service sets it: edge.forks)
        self.recover_histories: Callable[[LiveSession], Awaitable[None]] | None = None

    @property
    def engine(self) -> Engine:
        return self._engine

    def clock(self) -> float:
        return self._clock()

    async def run(self, live: LiveSession, request: TurnRequest) -> TurnOutcome:
        turn, busy = await self._begin(live, request)  # as ``begin`` does, without its context manager
        try:
            if turn.generate is None:
                return await self.refuse(live, turn)
            result = await self._generate(live, turn, turn.generate, request.disconnect)
            return await self.commit(live, turn, result, self.parse(turn, result))
        finally:
            if busy is not None:
                live.busy.discard(busy)

    async def _generate(self, live: LiveSession, turn: PreparedTurn, generate: GenerateRequest,
                        disconnect: Disconnect | None) -> GenerateResult:
        try:
            if disconnect is None:
                return await self._engine.generate(generate)
            with disconnect.sampling():
                return await self._engine.generate(generate)
        except EngineError as exc:
            await self.record_failure(live, turn, exc)
            raise
        except asyncio.CancelledError:
            if disconnect is not None and disconnect.gone:  # the client left: the engine call was aborted
                await self.record_abandoned(live, turn, reason=DISCONNECTED, tokens_sampled=0)
            raise

    @asynccontextmanager
    async def begin(self, live: LiveSession, request: TurnRequest) -> AsyncIterator[PreparedTurn]:
        """``async with runner.begin(live, request) as turn:`` selects the chain and plans the turn;
        a continued chain stays busy until the block ends."""
        turn, busy = await self._begin(live, request)
        try:
            yield turn
        finally:
            if busy is not None:
                live.busy.discard(busy)

    def constraint(self, conversation: Conversation) -> Constraint | None:
        """What the request forces the reply to be, in this session's tool format (None: nothing);
        a request that cannot be constrained is refused here, before anything is recorded."""
        return derive_constraint(self.replies.tools.name, conversation.tools, conversation.tool_choice,
                                 parallel=conversation.parallel_tool_calls, output_format=conversation.output_format,
                                 token_markers=self._token_markers, reasoning_open=self.replies.starts_in_reasoning)

    async def _begin(self, live: LiveSession, request: TurnRequest) -> tuple[PreparedTurn, int | None]:
        """The prepared turn, and the chain it keeps busy (marked busy here) if any.

        Load, decide: the turn is decided from one fold state, which planning never changes
        (:mod:`session.turn`); what the runner itself takes from the live session is the request's
        number, the chain it keeps busy, and the engine input it grows in place (:meth:`_engine_input`).

        A turn with much new text to tokenize (:data:`OFFLOAD_CHARS`) is planned on a worker
        thread, at most :data:`OFFLOADED` at a time, so that the event loop keeps serving every
        other session (tokenizing megabytes takes seconds; long pieces are encoded with the GIL
        released, :data:`edge.tokens.pieces.RELEASE_GIL_CHARS`).
        The codec's caches are only ever missed, never corrupted, by a planning thread.
        The request's images are made ready first (:mod:`edge.images`: refused, fetched, inspected)."""
        conversation = await self.images.prepare(request.conversation, live.fetched_images)
        if conversation is not request.conversation:
            request = msgspec.structs.replace(request, conversation=conversation)
        self.codec.check_system_placement(conversation.messages)
        constraint = self.constraint(conversation)
        request_no = live.take_request_no()
        state = live.state
        digests, selection = self._select(state, conversation, live.busy)
        if isinstance(selection, (NewChain, Rollback)) and live.histories.to_recover and \
                self.recover_histories is not None:  # taken over: the earlier chains' histories, from the log
            await self.recover_histories(live)
            state = live.state  # other turns may have been appended meanwhile: decided again, from now
            selection = self._select(state, conversation, live.busy, digests)[1]
        selection, reserialized = self._reserialized(live, state, conversation, selection)
        images = tuple(digested(images_of(conversation.messages)))  # the chain's and the new ones: all the engine sees
        received = self._received(live, request, request_no,
                                  None if isinstance(selection, (Exhausted, NewChain)) else selection.chain.index,
                                  images)
        if isinstance(selection, Exhausted):
            return PreparedTurn(request=request, received=received, images=images), None
        busy = None if isinstance(selection, NewChain) else selection.chain.index
        if busy is not None:
            live.busy.add(busy)
        try:
            new = conversation.messages if isinstance(selection, NewChain) else \
                conversation.messages[selection.n_history:]
            if _text_size(new) < OFFLOAD_CHARS:
                return self._prepare(live, state, request, selection, digests, received, constraint,
                                     reserialized, images), busy
            async with self._offloaded:
                return await asyncio.to_thread(self._prepare, live, state, request, selection, digests, received,
                                               constraint, reserialized, images), busy
        except BaseException:
            if busy is not None:
                live.busy.discard(busy)
            raise

    def _select(self, state: SessionState, conversation: Conversation, busy: Collection[int],
                digests: Sequence[str] = ()) -> tuple[Sequence[str], Selection]:
        """The request's history digests, and the chain it continues (or not)."""
        digests = digests or conversation.history_digests or tuple(
            map(bytes.hex, prefix_digests(tools_digest(conversation.tools), conversation.messages)))
        return digests, select_chain(state, digests, busy, _Roles(conversation.messages),
                                     rollback=self._settings.rollback_rewritten_turns)

    @staticmethod
    def _reserialized(live: LiveSession, state: SessionState, conversation: Conversation,
                      selection: Selection) -> tuple[Selection, str | None]:
        """With the session's ``continue_reserialized_turns``, a request that would start a chain (or roll a
        chain's last reply back) only because it re-sent a chain's replies other than sampled
        (edge.forks.CONTINUABLE) continues that chain with its logged tokens instead: the selection, and the
        cause it was continued despite (None: as selected)."""
        if not isinstance(selection, (NewChain, Rollback)) or not live.continues_reserialized:
            return selection, None
        found = reserialized_continuation(conversation.messages, conversation.tools, live.histories.known())
        if found is None:
            return selection, None
        index, n_history, cause = found
        chain = state.chain(index)
        if index in live.busy or chain.closed is not None:
            return selection, None
        return Continue(chain, n_history), cause

    async def count_prompt(self, live: LiveSession, conversation: Conversation) -> int:
        """How many tokens the engine would be given for ``conversation`` were it sent now (the turn's
        ``prompt_tokens``): its chain's tokens and the increment, or a new chain's prompt; past the
        trajectory length (where a turn is refused), the whole conversation's render. Nothing is
        recorded. Much new text is tokenized on a worker thread, as a turn's."""
        conversation = await self.images.prepare(conversation, live.fetched_images)
        self.codec.check_system_placement(conversation.messages)
        state = live.state
        digests, selection = self._select(state, conversation, ())
        selection = self._reserialized(live, state, conversation, selection)[0]
        if isinstance(selection, Exhausted):
            selection = Continue(selection.chain, selection.chain.n_messages)

        def count() -> int:
            try:
                return self._plan(state, conversation, selection, digests, 0)[0].input_length
            except NoRoom:
                return len(self.codec.encode_prompt(conversation.messages, conversation.tools))

        new = conversation.messages[selection.n_history:] if isinstance(selection, (Continue, Rollback)) else \
            conversation.messages
        if _text_size(new) < OFFLOAD_CHARS:
            return count()
        async with self._offloaded:
            return await asyncio.to_thread(count)

    def _prepare(self, live: LiveSession, state: SessionState, request: TurnRequest,
                 selection: Continue | Rollback | NewChain, digests: Sequence[str], received: Received,
                 constraint: Constraint | None = None, reserialized: str | None = None,
                 images: tuple[tuple[str, bytes], ...] = ()) -> PreparedTurn:
        """Decide the turn from ``state`` (:func:`session.turn.plan_turn`), then give the engine its input;
        ``images``: (digest, bytes) of the request's images."""
        limit = self._settings.max_trajectory_length
        try:
            plan, prompt = self._plan(state, request.conversation, selection, digests, received.request_no,
                                      histories=live.histories, reserialized=reserialized)
        except NoRoom:  # known to be too long before it was tokenized
            closing = None if isinstance(selection, NewChain) else selection.chain.index
            return PreparedTurn(request=request, received=received, closing=closing, images=images)
        prepared = PreparedTurn(request=request, received=received, plan=plan, images=images)
        if refuses(plan, limit):
            return msgspec.structs.replace(prepared, closing=plan.chain)
        sampling = self._sampling(state, request.conversation, limit - plan.input_length)
        input_ids = self._engine_input(live, state, plan, prompt)
        if self.images.tokens is not None:
            self.images.tokens.check_input(input_ids, len(images))
        generate = GenerateRequest(request_id=f"{state.session_id}:{received.request_no}", input_ids=input_ids,
                                   sampling=sampling, constraint=constraint, images=tuple(data for _, data in images))
        new = dict(images) if plan.images else {}
        return msgspec.structs.replace(prepared, generate=generate,
                                       image_bytes={ref.digest: new[ref.digest] for ref in plan.images})

    @staticmethod
    def _engine_input(live: LiveSession, state: SessionState, plan: TurnPlan,
                      prompt: Sequence[int] | None) -> Sequence[int]:
        """What the engine sees: a new chain's ``prompt``; a long chain's tokens grown in place (the live
        session's :class:`edge.engine_input.InputBuffer`, with no say in the turn); else joined afresh."""
        if prompt is not None:
            return prompt
        chain = state.chain(plan.chain) if plan.chain is not None else None
        if chain is not None and plan.rollback is None and chain.length >= MIN_TOKENS:
            return live.inputs.setdefault(chain.index, InputBuffer()).input_ids(chain, plan.context)
        return tokens.unpack_ids(engine_ids(state, plan))

    async def commit(self, live: LiveSession, turn: PreparedTurn, result: GenerateResult,
                     parsed: ParsedOutput) -> TurnOutcome:
        """Append the turn (context, tokens, reply) in one envelope; answer once it is acknowledged."""
        plan = turn.plan
        if plan is None:
            raise RollbusError("commit of a turn without a plan")
        reply = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
        tip = extend(bytes.fromhex(plan.prefix_digest), reply).hex()
        conversation = turn.request.conversation
        limit = self._settings.max_trajectory_length
        constraint = turn.generate.constraint if turn.generate is not None else None
        sampled = Sampled(token_ids=tokens.pack_ids(result.token_ids),
                          logprobs=tokens.pack_logprobs(result.logprobs) if result.logprobs is not None else None,
                          finish_reason=result.finish_reason, text=parsed.content, reasoning=parsed.reasoning,
                          tool_calls=parsed.tool_calls, tip_digest=tip, weight_version=result.weight_version,
                          constrained=constraint.label if constraint is not None else None)
        await self._store_images(live, turn)
        now = self._clock()
        events = await live.commit(self._log, lambda state: turn_events(state, plan, turn.received, sampled,
                                                                         limit=limit, time=now))
        completed = next(e for e in events if type(e) is TurnCompleted)
        request_no = turn.request_no
        live.bodies.stored(completed.chain, request_no, turn.request.body, turn.images)
        replied = msgspec.structs.replace(reply, reasoning=parsed.reasoning)
        live.histories.remember(completed.chain, (*conversation.messages, replied), conversation.tools)
        if plan.fork is not None and completed.chain > 0:
            self._counted.forks.labels(plan.fork.cause).inc()
        if conversation.store:
            live.stored.put(request_no, conversation, replied, tip)
        outcome = self._outcome(live, plan, result, parsed, fills(plan, len(result.token_ids), limit))
        self._counted.turn(turn.request.wire, outcome.finish_reason, OK, outcome.prompt_tokens,
                           outcome.completion_tokens)
        if plan.rollback is not None:
            self._counted.rollbacks.inc()
        return outcome

    async def _store_images(self, live: LiveSession, turn: PreparedTurn) -> None:
        """The bytes of the images the turn's events reference, into the log's object store before them: once a
        session (a screenshot resent every turn is stored with the turn that first holds it)."""
        new = {digest: data for digest, data in turn.image_bytes.items() if digest not in live.images_stored}
        if not new:
            return
        await self._log.put_pieces(live.session_id, {bytes.fromhex(digest): data for digest, data in new.items()})
        live.images_stored.update(new)

    def _expand(self, ids: list[int], messages: Sequence[Message]) -> tuple[list[int], tuple[ImageRef, ...]]:
        """A render's ids with the images of ``messages`` expanded into their tokens (edge.tokens.images), and
        where each stands; as they are without a processor (no image gets this far then)."""
        expander = self.images.tokens
        return (ids, ()) if expander is None else expander.expand(ids, images_of(messages))

    def _plan(self, state: SessionState, conversation: Conversation, selection: Continue | Rollback | NewChain,
              digests: Sequence[str], request_no: int, *, histories: Histories | None = None,
              reserialized: str | None = None) -> tuple[TurnPlan, list[int] | None]:
        """Encode what the turn appends and plan it (:func:`session.turn.plan_turn`), reading ``state`` only: the
        plan, and a new chain's prompt ids. ``histories``: to tell where a new chain forks from (None: not told)."""
        messages = conversation.messages
        limit = self._settings.max_trajectory_length
        facts = {"request_no": request_no, "n_messages": len(messages), "prefix_digest": digests[-1]}
        if isinstance(selection, (Continue, Rollback)):
            chain, new = selection.chain, with_reasoning(state, messages[selection.n_history:])
            try:
                context = self.codec.encode_rewrite(new, room=limit) if isinstance(selection, Rollback) else \
                    self.codec.encode_increment(new, last_token=chain.last_token(), room=limit - chain.length)
            except TemplateNotIncremental:  # the template cannot express the rewrite: a new chain
                selection = NewChain()
            else:
                context, images = self._expand(context, new)
                return plan_turn(state, selection, TurnFacts(context=tokens.pack_ids(context), chat_turns=_chat_turns(
                    new), reserialized=reserialized, images=images, **facts)), None
        prompt, images = self._expand(self.codec.encode_prompt(with_reasoning(state, messages), conversation.tools,
                                                               room=limit), messages)
        fork = None if histories is None else \
            classify(messages, conversation.tools, histories.known(), had_chains=bool(state.chains))
        return plan_turn(state, selection, TurnFacts(context=tokens.pack_ids(prompt), chat_turns=_chat_turns(messages),
                                                     fork=fork, images=images, **facts)), prompt

    def _sampling(self, state: SessionState, conversation: Conversation, room: int) -> SamplingParams:
        asked, defaults = conversation.sampling, state.sampling
        wanted = asked.max_tokens or defaults.max_tokens or self._settings.default_max_tokens
        return SamplingParams(
            max_new_tokens=max(1, min(wanted, room)),
            temperature=_first(asked.temperature, defaults.temperature, 1.0),
            top_p=_first(asked.top_p, defaults.top_p, 1.0),
            top_k=_first(asked.top_k, defaults.top_k, -1),
            stop=tuple(_first(asked.stop, defaults.stop, ())),
            stop_token_ids=self.codec.tokenizer.stop_token_ids,
        )

    def parse(self, turn: PreparedTurn, result: GenerateResult) -> ParsedOutput:
        text = self.codec.reply_text(result.token_ids)
        return self.replies.parse(text, call_ids(turn.request_no), use_tools=turn.uses_tools,
                                  tools=turn.request.conversation.tools)

    def _received(self, live: LiveSession, request: TurnRequest, request_no: int, chain: int | None,
                  images: Sequence[tuple[str, bytes]]) -> Received:
        """The request, its body stored against the latest one on its chain (schemas/bodies.py); ``images``:
        (digest, bytes) of its images."""
        body = request.body
        return Received(request_no=request_no, wire=request.wire, parts=live.bodies.parts(body, chain, images),
                        body_size=len(body), idempotency_key=request.idempotency_key,
                        body_digest=request.body_digest or body_digest(body), time=self._clock())

    # --- turns that did not sample -------------------------------------------------------

    async def record_failure(self, live: LiveSession, turn: PreparedTurn, exc: EngineError) -> None:
        """Audit a failed engine call; the chain is left as it was, free for a retry."""
        chain = turn.plan.chain if turn.plan is not None else None
        self._counted.turn(turn.request.wire, "none", ENGINE_ERROR)
        self.metrics.failures.labels("edge", ENGINE_ERROR).inc()
        now = self._clock()
        await self._audit(live, "EngineFailed", lambda state: failure_events(
            state, turn.received, chain, error=type(exc).__name__, message=exc.message, time=now))

    async def record_abandoned(self, live: LiveSession, turn: PreparedTurn, *, reason: str,
                               tokens_sampled: int) -> None:
        """Audit a turn given up before its end (its client left); the chain is left as it was."""
        chain = turn.plan.chain if turn.plan is not None else None
        self._counted.turn(turn.request.wire, "none", ABANDONED)
        self.metrics.failures.labels("edge", reason).inc()
        now = self._clock()
        await self._audit(live, "TurnAbandoned", lambda state: abandoned_events(
            state, turn.received, chain, reason=reason, tokens_sampled=tokens_sampled, time=now))

    async def _audit(self, live: LiveSession, what: str, decide: Decide) -> None:
        try:
            await live.commit(self._log, decide)
        except RollbusError as audit_exc:  # the agent still gets the turn's own error
            log.warning("could not record %s for %s: %s", what, live.state.session_id, audit_exc)

    # --- answers ------------------------------------------------------------------------

    async def refuse(self, live: LiveSession, turn: PreparedTurn) -> TurnOutcome:
        """No room: record the request (and the chain's closing) and answer ``length``."""
        await live.commit(self._log, lambda state: refusal_events(state, turn.received, turn.closing))
        self._counted.turn(turn.request.wire, "length", REFUSED)
        return TurnOutcome(session_id=live.state.session_id, request_no=turn.request_no, content="",
                           finish_reason="length", prompt_tokens=0, completion_tokens=0, created=int(self._clock()))

    def _outcome(self, live: LiveSession, plan: TurnPlan, result: GenerateResult, parsed: ParsedOutput,
                 full: bool) -> TurnOutcome:
        if parsed.tool_calls:
            finish = "tool_calls"
        elif full or result.finish_reason == "length":
            finish = "length"
        else:
            finish = "stop"
        return TurnOutcome(
            session_id=live.state.session_id, request_no=plan.request_no, content=parsed.content,
            reasoning=parsed.reasoning, tool_calls=parsed.tool_calls, finish_reason=finish,
            prompt_tokens=plan.input_length, completion_tokens=len(result.token_ids),
            token_ids=result.token_ids, logprobs=result.logprobs, created=int(self._clock()),
        )


def _first(asked: T | None, default: T | None, fallback: T) -> T:
    """The request's value, else the session's default, else ``fallback``."""
    return asked if asked is not None else default if default is not None else fallback
