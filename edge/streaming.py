"""Streamed turns: deltas reach the client as the engine samples; the turn is committed at the end.

A :class:`TurnStream` runs the turn on a task of its own (so that a client going away
cannot cancel an append halfway) and hands wire-neutral events (:mod:`edge.chat.deltas`)
to the route through a mailbox, which the route empties one batch (one write) at a time;
:mod:`edge.routes.sse` writes them:

1. :meth:`TurnStream.open` selects and plans the turn (the chain stays busy until the
   stream ends) and waits for the engine's first tokens, so that a refused request or an
   engine that is down is still an HTTP error in the wire's shape;
2. tokens are decoded incrementally (:mod:`edge.tokens.detokenize`) and split into
   reasoning, content and tool calls (:mod:`edge.tokens.reply`); the exact token ids and
   log probs are kept aside;
3. when the engine is done, the turn is committed exactly as a plain request commits it
   (:meth:`TurnRunner.commit`: one envelope), and only once the log has acknowledged it
   do the held-back content, the tool calls and the finish event go out. What an agent
   saw is in the log.

A failure after the first event (the engine dies mid-stream, the log is unavailable)
ends the stream with an in-stream error event; the turn is not committed (an engine
failure is audited as ``engine_failed``).

**A client that disconnects mid-stream discards its turn.** :meth:`TurnStream.abandon`
cancels the task while it reads the engine's stream (the task records the rest), the engine
request is aborted (its stream is closed, which makes SGLang abort it), nothing of the turn reaches
the chain, and ``request_received`` + ``turn_abandoned`` (with the number of tokens
sampled) are recorded for audit. The chain is left exactly as it was, so the agent's
retry of the same request continues the same chain. A client that leaves after the last
token, while the turn is being committed, finds the turn committed: the log decides, and
its retry (which does not extend the committed reply) starts a new chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from edge.chat.conversation import TurnOutcome
from edge.chat.deltas import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    StreamFinished,
    StreamStarted,
    ToolCallReady,
)
from edge.engines.base import GenerateChunk, GenerateRequest, GenerateResult
from edge.live import LiveSession
from edge.tokens.detokenize import IncrementalDecoder
from edge.tokens.reply import ReplyStream, call_ids
from edge.turns import DISCONNECTED, PreparedTurn, TurnRequest, TurnRunner
from schemas.errors import EngineError, RollbusError

log = logging.getLogger(__name__)

Item = StreamEvent | RollbusError
_END = object()
_RUNNING: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones


class _Mailbox:
    """From the producer to the route: :meth:`put` never waits, :meth:`take` waits for one item and
    returns every item waiting (the frames of one engine chunk go out in one write). Lighter than an
    ``asyncio.Queue``: one reader, no bound, one future per wait."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def empty(self) -> bool:
        return not self._items

    def put(self, items: tuple[Any, ...]) -> None:
        self._items.extend(items)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Any]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class TurnStream:
    def __init__(self, runner: TurnRunner, live: LiveSession, request: TurnRequest) -> None:
        self._runner = runner
        self._live = live
        self._request = request
        self._mailbox = _Mailbox()
        self._held: list[Any] = []  # taken with the first event, not yet handed out
        self._task: asyncio.Task[None] | None = None
        self._reading = False  # the producer is reading the engine's stream (abandon cancels it then)
        self._gone = False
        self._sampled = 0

    @classmethod
    async def open(cls, runner: TurnRunner, live: LiveSession, request: TurnRequest) -> tuple[TurnStream, Item]:
        """Start the turn; returns the stream and its first event, or raises why it could not start."""
        stream = cls(runner, live, request)
        task = stream._task = asyncio.create_task(stream._produce(), name=f"stream {live.state.session_id}")
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)
        first, *stream._held = await stream._mailbox.take()
        if isinstance(first, RollbusError):
            raise first
        if first is _END:
            raise RollbusError("stream ended before it started")
        return stream, first

    async def events(self, before_wait: Callable[[], None] | None = None) -> AsyncIterator[list[Item]]:
        """The events after the first, in batches of those already waiting (one write each);
        leaving early (a client gone) abandons the turn. ``before_wait`` is called once, before the
        first wait for the producer (never when the turn is over before the route is back for more)."""
        try:
            batch, self._held = self._held, []
            while True:
                if not batch:
                    if before_wait is not None and self._mailbox.empty():
                        before_wait()
                        before_wait = None
                    batch = await self._mailbox.take()
                if batch[-1] is _END:  # the producer's last item: nothing is put after it
                    if len(batch) > 1:
                        yield batch[:-1]
                    return
                yield batch
                batch = []
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give the turn up unless it is already being committed (synchronous: safe while cancelled)."""
        self._gone = True
        if self._reading and self._task is not None:
            self._reading = False  # cancelled once: a second cancel would read as a shutdown
            self._task.cancel()

    def _put(self, *items: Any) -> None:
        self._mailbox.put(items)

    async def _produce(self) -> None:
        try:
            async with self._runner.begin(self._live, self._request) as turn:
                if turn.generate is None:
                    outcome = await self._runner.refuse(self._live, turn)
                    self._put(self._started(turn), StreamFinished(outcome))
                else:
                    await self._sample(turn, turn.generate)
        except RollbusError as exc:
            self._put(exc)
        except Exception:
            log.exception("streamed turn of %s failed", self._live.state.session_id)
            self._put(RollbusError("internal error"))
        finally:
            self._put(_END)

    async def _sample(self, turn: PreparedTurn, generate: GenerateRequest) -> None:
        runner, live = self._runner, self._live
        reply = runner.replies.stream(call_ids(turn.request_no), use_tools=turn.uses_tools,
                                      tools=turn.request.conversation.tools)
        decoder = IncrementalDecoder(runner.codec.tokenizer.decode, runner.codec.tokenizer.stop_token_ids)
        iterator = runner.engine.stream(generate)
        self._reading = not self._gone
        try:
            result: GenerateResult | None = await self._read(turn, iterator, reply, decoder)
        except asyncio.CancelledError:
            if not self._gone or _cancelled_more_than_once():
                raise  # not (only) the client leaving: shutdown
            _uncancel()  # abandoned while the engine sampled: record it below
            result = None
        except EngineError as exc:
            await runner.record_failure(live, turn, exc)
            raise
        finally:
            self._reading = False
            await _aclose(iterator)
        if result is None or self._gone:
            await runner.record_abandoned(live, turn, reason=DISCONNECTED, tokens_sampled=self._sampled)
            return
        self._feed(reply, decoder, result.token_ids[self._sampled:])
        flushed = reply.feed(decoder.flush())
        last, parsed = reply.finish()
        outcome = await runner.commit(live, turn, result, parsed)
        self._put(*flushed, *last, StreamFinished(outcome))

    async def _read(self, turn: PreparedTurn, iterator: AsyncIterator[GenerateChunk | GenerateResult],
                    reply: ReplyStream, decoder: IncrementalDecoder) -> GenerateResult:
        started = False
        async for item in iterator:
            if not started:
                self._put(self._started(turn))
                started = True
            if isinstance(item, GenerateResult):
                return item
            self._feed(reply, decoder, item.token_ids)
        raise EngineError(f"{self._runner.engine.name} stream ended without a result")

    def _feed(self, reply: ReplyStream, decoder: IncrementalDecoder, token_ids: tuple[int, ...]) -> None:
        if token_ids:
            self._sampled += len(token_ids)
            self._put(*reply.feed(decoder.feed(token_ids)))

    def _started(self, turn: PreparedTurn) -> StreamStarted:
        prompt = turn.plan.input_length if turn.plan is not None and turn.generate is not None else 0
        return StreamStarted(session_id=self._live.state.session_id, request_no=turn.request_no,
                             created=int(self._runner.clock()), prompt_tokens=prompt)


def _cancelled_more_than_once() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 1


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    """Close the engine stream (an SGLang stream closed early aborts its request)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with contextlib.suppress(RuntimeError):
            await close()


class RecordedStream:
    """The stream of a completion already recorded (an idempotent repeat): the events a live
    stream of it would have sent, all at once. Nothing runs and nothing is logged."""

    def __init__(self, outcome: TurnOutcome) -> None:
        self.first = StreamStarted(session_id=outcome.session_id, request_no=outcome.request_no,
                                   created=outcome.created, prompt_tokens=outcome.prompt_tokens)
        deltas: list[StreamEvent] = []
        if outcome.reasoning:
            deltas.append(ReasoningDelta(outcome.reasoning))
        if outcome.content:
            deltas.append(ContentDelta(outcome.content))
        deltas += [ToolCallReady(index, call) for index, call in enumerate(outcome.tool_calls)]
        self._rest: list[Item] = [*deltas, StreamFinished(outcome)]

    async def events(self, before_wait: Callable[[], None] | None = None) -> AsyncIterator[list[Item]]:
        """All at once: there is nothing to wait for."""
        yield self._rest

    def abandon(self) -> None:
        """Nothing to give up: the turn is in the log already."""
