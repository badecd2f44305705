"""The edge's turn runner, live sessions, registry and service on the in-memory log and an in-process
engine (rollbus/testing): the real fold, envelope codec, TurnRunner and Qwen2.5 template, no NATS."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from edge.chat.deltas import ContentDelta, StreamFinished, StreamStarted
from edge.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams, id_list
from edge.live import LiveSession, Registry
from edge.service import EdgeService, OpenSession
from edge.settings import EdgeSettings
from edge.tokens.fidelity import load_codec
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers.base import ToolParser
from edge.turns import TurnOutcome, TurnRequest, TurnRunner
from edge.wires.openai import decode_request
from rollbus.testing.engine import HandlerEngine, replying, result
from rollbus.testing.memory_log import InMemoryLog, in_memory_service
from schemas.errors import (
    EngineUnavailable,
    FoldError,
    LogUnavailable,
    OutOfOrderEvent,
    OwnershipLost,
    SessionClosed,
)
from schemas.events import (
    ChainClosed,
    ChainStarted,
    ContextAppended,
    EngineFailed,
    Event,
    RequestReceived,
    RewardReported,
    SessionFinalized,
    SessionOpened,
    TokensGenerated,
    TurnCompleted,
)
from session.fold import SessionState, apply, fold
from session.numbering import UNNUMBERED, numbered
from session.turn import CAPACITY

SID = "0123456789abcdef0123456789abcdef"
IM_END = 151645
NOW = 1_800_000_000.0


def clock() -> float:
    return NOW


@pytest.fixture(scope="module")
def codec() -> tuple[TemplateCodec, ToolParser]:
    return load_codec("builtin:qwen2.5", "hermes")


def answer(codec: TemplateCodec) -> Callable[[GenerateRequest], GenerateResult]:
    """Replies that depend only on the engine's input."""

    def handler(request: GenerateRequest) -> GenerateResult:
        text = f"reply to {len(request.input_ids)} tokens"
        return result([*codec.tokenizer.encode(text), IM_END])

    return handler


class Agent:
    """One OpenAI conversation, as a route hands it to the edge."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]

    def request(self, user: str | None, *, key: str | None = None) -> TurnRequest:
        if user is not None:
            self.messages.append({"role": "user", "content": user})
        body = json.dumps({"model": "m", "messages": self.messages}).encode()
        return TurnRequest(conversation=decode_request(body), wire="openai", body=body, idempotency_key=key)

    def heard(self, outcome: TurnOutcome) -> TurnOutcome:
        self.messages.append({"role": "assistant", "content": outcome.content})
        return outcome


async def opened(log: InMemoryLog, max_len: int = 4096) -> LiveSession:
    event = SessionOpened(session_id=SID, seq=1, time=NOW, uid="uid1", session_index=0, api_key_digest="x",
                          max_trajectory_length=max_len, tokenizer="builtin:qwen2.5", tool_format="hermes")
    appended = await log.append(SID, [event], 0)
    return LiveSession(apply(None, event), appended.stream_seq, clock=clock)


def runner(codec: tuple[TemplateCodec, ToolParser], log: InMemoryLog, engine: HandlerEngine,
           max_len: int = 4096) -> TurnRunner:
    settings = EdgeSettings(max_trajectory_length=max_len)
    return TurnRunner(settings=settings, codec=codec[0], engine=engine, log=log, parser=codec[1], clock=clock)


async def logged(log: InMemoryLog, session_id: str = SID) -> list[type]:
    return [type(e) for e in (await log.read_session(session_id)).events]


# --- the turn runner ----------------------------------------------------------------------------


async def test_a_plain_turn_starts_a_chain_and_is_in_the_log_when_answered(codec) -> None:
    log, engine = InMemoryLog(), HandlerEngine(answer(codec[0]))
    live, agent = await opened(log), Agent()
    outcome = await runner(codec, log, engine).run(live, agent.request("hi"))
    (sent,) = engine.requests
    assert outcome.content == f"reply to {len(sent.input_ids)} tokens" and outcome.finish_reason == "stop"
    assert await logged(log) == [SessionOpened, RequestReceived, ChainStarted, TokensGenerated, TurnCompleted]
    assert (await log.load_state(SID)) == (live.state, live.stream_seq) == (live.state, 2)
    (chain,) = live.state.chains
    assert chain.token_ids() == [*id_list(sent.input_ids), *outcome.token_ids]
    assert sent.request_id == f"{SID}:1" and sent.sampling.stop_token_ids == codec[0].tokenizer.stop_token_ids


async def test_a_request_that_extends_the_chain_continues_it_with_the_increment(codec) -> None:
    log, engine = InMemoryLog(), HandlerEngine(answer(codec[0]))
    live, agent, turns = await opened(log), Agent(), runner(codec, log, engine)
    agent.heard(await turns.run(live, agent.request("one")))
    before = live.state.chains[0].token_ids()
    second = agent.heard(await turns.run(live, agent.request("two")))
    assert id_list(engine.requests[1].input_ids)[: len(before)] == before  # the stored tokens, never re-encoded
    (chain,) = live.state.chains
    assert len(chain.turns) == 2 and chain.token_ids()[-len(second.token_ids):] == list(second.token_ids)
    events = (await log.read_session(SID)).events
    assert [type(e) for e in events[5:]] == [RequestReceived, ContextAppended, TokensGenerated, TurnCompleted]
    assert fold(events) == live.state and not live.busy


async def test_an_engine_failure_is_recorded_and_the_chain_left_free_for_the_retry(codec) -> None:
    calls = []

    def flaky(request: GenerateRequest) -> GenerateResult:
        calls.append(request)
        if len(calls) == 2:
            raise EngineUnavailable("the engine is down")
        return answer(codec[0])(request)

    log = InMemoryLog()
    live, agent, turns = await opened(log), Agent(), runner(codec, log, HandlerEngine(flaky))
    agent.heard(await turns.run(live, agent.request("one")))
    chain = live.state.chains[0]
    with pytest.raises(EngineUnavailable):
        await turns.run(live, agent.request("two"))
    failed = (await log.read_session(SID)).events[-1]
    assert isinstance(failed, EngineFailed) and (failed.chain, failed.request_no) == (0, 2)
    assert failed.error == "EngineUnavailable" and failed.message == "the engine is down"
    assert live.state.chains == (chain,) and not live.busy
    retried = await turns.run(live, agent.request(None))  # the same request again continues the same chain
    assert retried.request_no == 3 and len(live.state.chains) == 1 and len(live.state.chains[0].turns) == 2
    assert id_list(calls[2].input_ids) == id_list(calls[1].input_ids)


async def test_a_prompt_that_cannot_fit_is_answered_length_without_sampling(codec) -> None:
    log, engine = InMemoryLog(), HandlerEngine(answer(codec[0]))
    live = await opened(log, max_len=64)
    outcome = await runner(codec, log, engine, max_len=64).run(live, Agent().request("word " * 200))
    assert (outcome.finish_reason, outcome.content, outcome.completion_tokens) == ("length", "", 0)
    assert engine.requests == [] and live.state.chains == ()
    assert await logged(log) == [SessionOpened, RequestReceived]


async def test_a_turn_that_fills_its_chain_closes_it_and_the_next_is_refused(codec) -> None:
    log = InMemoryLog()
    engine = HandlerEngine(replying([*codec[0].tokenizer.encode("long " * 100), IM_END]))  # cut at max_new_tokens
    live, agent, turns = await opened(log, max_len=64), Agent(), runner(codec, log, engine, max_len=64)
    full = agent.heard(await turns.run(live, agent.request("hi")))
    assert full.finish_reason == "length" and live.state.chains[0].length == 64  # sampled up to the room left
    closing = (await log.read_session(SID)).events[-1]
    assert isinstance(closing, ChainClosed) and closing.reason == CAPACITY == live.state.chains[0].closed
    refused = await turns.run(live, agent.request("more"))
    assert refused.finish_reason == "length" and len(engine.requests) == 1
    assert (await logged(log))[-1] is RequestReceived and len(live.state.chains) == 1


# --- the live session and the registry ----------------------------------------------------------


def next_events(*events: Event) -> Callable[[SessionState], tuple[Event, ...]]:
    """Decides ``events``, numbered after the state they are appended to."""
    return lambda state: numbered(events, state.seq)


async def test_commit_appends_the_events_decided_from_the_state_and_applies_them() -> None:
    log = InMemoryLog()
    live = await opened(log)
    reward = RewardReported(session_id=SID, seq=UNNUMBERED, time=NOW, reward=1.0)
    committed = await live.commit(log, lambda state: numbered([reward, reward], state.seq))
    assert [e.seq for e in committed] == [2, 3] and live.state.seq == 3 and live.stream_seq == 2
    assert (await log.read_session(SID)).events[1:] == committed
    with pytest.raises(FoldError):  # an event the fold refuses never reaches the log
        await live.commit(log, lambda state: numbered([TokensGenerated(session_id=SID, seq=UNNUMBERED, time=NOW,
                                                                       chain=5, request_no=1, token_ids=b"")],
                                                      state.seq))
    with pytest.raises(OutOfOrderEvent):  # nor one not numbered next: commit numbers nothing itself
        await live.commit(log, lambda state: [reward])
    assert live.state.seq == 3 and len(log.messages) == 2 and not live.lost


async def test_a_foreign_append_loses_the_live_session_and_the_registry_rebuilds_it() -> None:
    log = InMemoryLog()
    await opened(log)
    registry = Registry(log.load_state, position=log.last_stream_seq, clock=clock)
    live = await registry.get(SID)
    foreign = RewardReported(session_id=SID, seq=2, time=NOW, reward=0.5)
    await log.append(SID, [foreign], live.stream_seq)  # another writer, behind this one's back
    with pytest.raises(OwnershipLost):
        await live.commit(log, next_events(RewardReported(session_id=SID, seq=UNNUMBERED, time=NOW, reward=1.0)))
    assert live.lost and not registry.holds(SID) and len(log.messages) == 2
    rebuilt = await registry.get(SID)
    assert rebuilt is not live and rebuilt.state.reward == foreign and rebuilt.stream_seq == 2
    with pytest.raises(OwnershipLost):  # the lost session stays lost
        await live.commit(log, lambda state: [])
    await rebuilt.commit(log, next_events(SessionFinalized(session_id=SID, seq=UNNUMBERED, time=NOW)))
    assert (await log.load_state(SID))[0].status == "finalized"


@pytest.mark.parametrize("stored", [False, True])
async def test_an_unacknowledged_append_drops_the_live_state_and_the_log_decides(stored: bool) -> None:
    log = InMemoryLog()
    await opened(log)
    registry = Registry(log.load_state, position=log.last_stream_seq, clock=clock)
    live = await registry.get(SID)
    log.fail_next(LogUnavailable("JetStream did not acknowledge"), stored=stored)
    with pytest.raises(LogUnavailable):
        await live.commit(log, next_events(RewardReported(session_id=SID, seq=UNNUMBERED, time=NOW, reward=1.0)))
    assert live.state.reward is None and not registry.holds(SID)
    rebuilt = await registry.get(SID)
    assert (rebuilt.state.reward is not None) is stored and rebuilt.stream_seq == 1 + stored


# --- the service ---------------------------------------------------------------------------------


def service(codec, log: InMemoryLog, engine: HandlerEngine) -> EdgeService:
    return in_memory_service(engine, log=log, codec=codec, clock=clock,
                             settings=EdgeSettings(max_trajectory_length=4096))


async def test_a_session_is_opened_served_and_finalized(codec) -> None:
    log, engine = InMemoryLog(), HandlerEngine(answer(codec[0]))
    edge, agent = service(codec, log, engine), Agent()
    opened_session = await edge.open_session(OpenSession(uid="task1", metadata={"agent_name": "solver"}))
    sid, key = opened_session.session_id, opened_session.api_key
    outcome = agent.heard(await edge.complete(await edge.authorize(sid, key), agent.request("hi")))
    await edge.report_reward(await edge.reward_access(sid, key), {"reward": 1.0})
    summary = await edge.finalize(sid)
    assert (summary.status, summary.turns, summary.trajectories, summary.reward) == ("finalized", 1, 1, 1.0)
    assert await edge.finalize(sid) == summary and not edge.registry.holds(sid)  # idempotent, released
    state, _ = await log.load_state(sid)
    assert (state.uid, state.agent_name, state.status) == ("task1", "solver", "finalized")
    assert state.chains[0].turns[0].text == outcome.content
    with pytest.raises(SessionClosed):
        await edge.complete(await edge.authorize(sid, key), agent.request("again"))


async def test_a_restarted_edge_rebuilds_the_session_from_the_log_and_continues_its_chain(codec) -> None:
    log, engine = InMemoryLog(), HandlerEngine(answer(codec[0]))
    first, agent = service(codec, log, engine), Agent()
    opened_session = await first.open_session(OpenSession())
    sid, key = opened_session.session_id, opened_session.api_key
    request = agent.request("one", key="req-1")
    original = await first.complete(await first.authorize(sid, key), request)
    before = (await log.load_state(sid))[0].chains[0].token_ids()

    restarted = service(codec, log, engine)  # a new registry, nothing in memory: the log is all it has
    assert not restarted.registry.holds(sid)
    again = await restarted.complete(await restarted.authorize(sid, key), request)
    assert len(engine.requests) == 1  # a retry: answered from the log (log probs as stored: float32)
    assert msgspec.structs.replace(again, logprobs=None) == msgspec.structs.replace(original, logprobs=None)
    assert np.array_equal(np.float32(again.logprobs), np.float32(original.logprobs))
    agent.heard(original)
    await restarted.complete(await restarted.authorize(sid, key), agent.request("two"))
    assert id_list(engine.requests[-1].input_ids)[: len(before)] == before and restarted.registry.holds(sid)
    state, _ = await log.load_state(sid)
    assert len(state.chains) == 1 and len(state.chains[0].turns) == 2

    with pytest.raises(OwnershipLost):  # the first edge's state is stale: the log refuses its append
        await first.complete(await first.authorize(sid, key), agent.request("three"))
    assert not first.registry.holds(sid)
    assert (await log.load_state(sid))[0] == (await restarted.registry.get(sid)).state


async def test_a_streamed_turn_reaches_its_finish_only_once_it_is_in_the_log(codec) -> None:
    log, engine = InMemoryLog(), HandlerEngine(answer(codec[0]), chunk_tokens=2)
    edge, agent = service(codec, log, engine), Agent()
    opened_session = await edge.open_session(OpenSession())
    sid = opened_session.session_id
    stream, first = await edge.stream(await edge.authorize(sid, opened_session.api_key), agent.request("hi"))
    assert isinstance(first, StreamStarted) and first.prompt_tokens == len(engine.requests[0].input_ids)
    texts, finished = [], []
    async for batch in stream.events():
        for item in batch:
            if isinstance(item, ContentDelta):
                texts.append(item.text)
            elif isinstance(item, StreamFinished):
                assert (await logged(log, sid))[-1] is TurnCompleted  # committed before the client hears of it
                finished.append(item.outcome)
    (outcome,) = finished
    assert outcome.finish_reason == "stop" and "".join(texts) == outcome.content
    state, _ = await log.load_state(sid)
    assert state.chains[0].turns[0].text == outcome.content
    assert state.chains[0].token_ids()[-len(outcome.token_ids):] == list(outcome.token_ids)


# --- the in-process engine -----------------------------------------------------------------------


async def test_the_handler_engine_answers_from_its_handler_as_an_engine_would() -> None:
    sampling = SamplingParams(max_new_tokens=3, stop_token_ids=(IM_END,))
    request = GenerateRequest(request_id=f"{SID}:1", input_ids=[1, 2], sampling=sampling)
    engine = HandlerEngine(replying([5, IM_END, 6], [7, 8, 9, 10]), chunk_tokens=2)
    assert isinstance(engine, Engine)
    first = await engine.generate(request)
    assert (first.token_ids, first.finish_reason, first.logprobs) == ((5, IM_END), "stop", (-0.01, -0.02))
    streamed = [item async for item in engine.stream(request)]
    assert [c.token_ids for c in streamed[:-1]] == [(7, 8), (9,)]
    assert streamed[-1] == GenerateResult(token_ids=(7, 8, 9), logprobs=(-0.01, -0.02, -0.03), finish_reason="length",
                                          weight_version="handler")
    with pytest.raises(LookupError):  # more calls than replies: the test's mistake, loudly
        await engine.generate(request)

    async def later(request: GenerateRequest) -> GenerateResult:
        return result([4])

    assert (await HandlerEngine(later).generate(request)).token_ids == (4,)
    await engine.aclose()
    assert engine.closed and len(engine.requests) == 3
