"""Stalls: something the edge depends on stops answering without going away (nats-server paused with
SIGSTOP, an engine that accepts a request and never answers or answers a byte at a time, a client that
stops reading its stream, a materializer paused while sessions end). The edge answers every client
within its own timeouts, in the wire's error shape, never holds a turn forever, keeps serving other
sessions and ``/healthz``, and recovers by itself when the stall ends: nothing is restarted.

Each test has a nats-server of its own (they pause it) and a real stack (edge and projector, and the
materializer but in the last test, which runs it as a process of its own) in front of a scripted SGLang
engine, driven with the official ``openai`` and ``anthropic`` SDKs (``max_retries=0``: the test sees
every answer)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletion

from edge.tokens.tokenizer import Tokenizer
from rollbus.testing.burst import Driver, Outcome, outcome, tool_responder, wait_marked
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.events import EngineFailed, TurnAbandoned, TurnCompleted
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from tests.e2e import conftest as e2e
from tests.e2e.test_engines_stack import eventually, open_session
from tests.e2e.test_openai_session import reply
from tests.processes import MaterializerProcess

ENGINE_TIMEOUT_S = 2.0  # --engine-timeout of the engine tests: the longest wait for one read (silent)
ENGINE_DEADLINE_S = 3.0  # --engine-deadline of the engine tests: the longest whole call (trickle)
SEND_TIMEOUT_S = 4.0  # --send-timeout of the slow client's test
LOG_WAIT_S = 4 * 5.0  # what an append waits for JetStream at most: 4 attempts of 5 s (JetStreamLog's defaults)
SLACK_S = 5.0  # a loaded machine answers late, never this late
HI = [{"role": "user", "content": "hi"}]

make_stack, tokenizer = e2e.make_stack, e2e.tokenizer  # the end-to-end tests' fixtures


@pytest.fixture
def nats_server(tmp_path) -> Iterator[EmbeddedNats]:
    """A nats-server of the test's own (the tests pause it), in place of the session's shared one."""
    with EmbeddedNats(tmp_path / "nats", name="stalls") as server:
        yield server


@pytest.fixture
def log_config() -> LogConfig:
    """The default log (a ``rollbus materializer`` process reads it): the server is the test's own."""
    return LogConfig()


@pytest.fixture
def engine(tokenizer: Tokenizer) -> Iterator[ScriptedEngineServer]:
    """The burst's engine (a tool call, then the answer); replies pushed take precedence."""
    with ScriptedEngineServer(responder=tool_responder(tokenizer.encode, tokenizer.decode,
                                                       tokenizer.eos_token_id)) as server:
        yield server


def openai_client(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=60)


def anthropic_client(session: dict[str, Any]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0,
                               timeout=60)


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """What ``call`` returned or raised, and how long it took."""
    started = time.monotonic()
    try:
        result: Any = call()
    except Exception as exc:  # the answer under test
        result = exc
    return result, time.monotonic() - started


def drained(stream: Any) -> int:
    return sum(1 for _ in stream)


# --- 1. nats-server paused ----------------------------------------------------------------------------


def test_a_paused_nats_server_is_a_503_in_each_wire_and_the_edge_recovers_when_it_resumes(make_stack, nats_server):
    stack = make_stack()
    plain, streamed, claude = (open_session(stack) for _ in range(3))
    assert openai_client(plain).chat.completions.create(model="m", messages=HI).choices  # one turn before
    os.kill(nats_server.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(3) as pool:
            turns = [pool.submit(timed, call) for call in (
                lambda: openai_client(plain).chat.completions.create(model="m", messages=HI),
                lambda: drained(openai_client(streamed).chat.completions.create(model="m", messages=HI, stream=True)),
                lambda: anthropic_client(claude).messages.create(model="m", max_tokens=64, messages=HI))]
            probes = []
            while not all(turn.done() for turn in turns):
                probes.append(timed(lambda: httpx.get(f"{stack.url}/healthz", timeout=10)))
                time.sleep(0.5)
            (chat, chat_s), (stream, stream_s), (message, message_s) = (turn.result() for turn in turns)
    finally:
        os.kill(nats_server.pid, signal.SIGCONT)
    print(f"paused: chat {chat_s:.1f} s, stream {stream_s:.1f} s, messages {message_s:.1f} s; /healthz "
          f"{[(p.status_code if isinstance(p, httpx.Response) else repr(p), round(s, 2)) for p, s in probes]}")
    assert max(chat_s, stream_s, message_s) < LOG_WAIT_S + SLACK_S
    assert isinstance(chat, openai.APIStatusError) and chat.status_code == 503, chat
    assert chat.body["code"] == "log_unavailable" and int(chat.response.headers["retry-after"]) >= 1
    assert isinstance(stream, openai.APIError) and stream.body["code"] == "log_unavailable", stream  # in-stream
    assert isinstance(message, anthropic.APIStatusError) and message.status_code == 503, message
    assert message.body["error"]["type"] == "overloaded_error" and int(message.response.headers["retry-after"]) >= 1
    assert probes and all(isinstance(p, httpx.Response) and s < 2.0 for p, s in probes)  # /healthz answered

    # resumed: the same sessions and new ones are served, nothing restarted
    assert openai_client(plain).chat.completions.create(model="m", messages=HI).choices
    assert drained(openai_client(streamed).chat.completions.create(model="m", messages=HI, stream=True))
    assert anthropic_client(claude).messages.create(model="m", max_tokens=64, messages=HI).content
    assert openai_client(open_session(stack)).chat.completions.create(model="m", messages=HI).choices
    assert httpx.get(f"{stack.url}/healthz").status_code == 200


# --- 2, 3. an engine that never answers, or trickles --------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("stall", ["silent", "trickle"])
def test_an_engine_that_stalls_ends_the_turn_504_within_its_timeouts(make_stack, engine, tokenizer, stall, stream):
    """``silent``: the engine takes the request and sends nothing: 504 at ``--engine-timeout``, long before
    the deadline; ``trickle``: it sends its headers and then its body a byte every half second (plain), or
    its events half a second apart (streamed), each read well within the timeout, the whole reply far
    past ``--engine-deadline``: 504 at the deadline."""
    limit = {"silent": ENGINE_TIMEOUT_S, "trickle": ENGINE_DEADLINE_S}[stall]
    stack = make_stack(engine_timeout=ENGINE_TIMEOUT_S,
                       engine_deadline={"silent": 600.0, "trickle": ENGINE_DEADLINE_S}[stall])
    session = open_session(stack)
    client = openai_client(session)
    long = reply(tokenizer, "and then " * 200)  # ~400 tokens: 100 events of 4, ~6 KB as one body
    slow = {"silent": {"delay_s": 60.0}, "trickle": {"chunk_delay_s": 0.5} if stream else {"trickle_s": 0.5}}
    engine.push(msgspec.structs.replace(long, **slow[stall]))

    def turn() -> int:
        if stream:
            return drained(client.chat.completions.create(model="m", messages=HI, stream=True))
        return len(client.chat.completions.create(model="m", messages=HI).choices)

    failed, took = timed(turn)
    assert limit <= took + 0.2 and took < limit + SLACK_S, f"the turn took {took:.1f} s"
    assert isinstance(failed, openai.APIError), failed
    assert failed.body["code"] == "engine_timeout", failed.body
    if isinstance(failed, openai.APIStatusError):  # else reported in the stream, after its first event
        assert failed.status_code == 504
    rid = engine.requests[0]["rid"]
    eventually(lambda: rid in engine.aborted)  # the engine is told to stop
    assert any(isinstance(e, EngineFailed) for e in stack.events(session["session_id"]))
    assert turn() >= 1  # the session is usable: the next turn is answered
    assert isinstance(stack.events(session["session_id"])[-1], TurnCompleted)


# --- 4. a client that stops reading -------------------------------------------------------------------


def test_a_client_that_stops_reading_holds_no_turn_stalls_no_one_and_is_disconnected(make_stack, engine, tokenizer):
    """The client asks for a long streamed reply, takes its first bytes and then reads nothing, its socket
    alive (a receive buffer of 4 KiB: the window closes at once). Meanwhile other sessions, the same
    session's next turn and ``/healthz`` are served; once the reply has not moved for ``--send-timeout``
    the edge drops the connection: read again, it is cut off (reset, or ended without ``[DONE]``), where a
    connection nothing bounds would deliver it all, however late; and the turn has ended (committed, or
    abandoned as a client gone)."""
    stack = make_stack(send_timeout=SEND_TIMEOUT_S)
    stuck, other = open_session(stack), open_session(stack)
    engine.push(reply(tokenizer, "lorem ipsum dolor sit amet, " * 500))  # ~3,000 tokens, ~750 events
    body = msgspec.json.encode({"model": "m", "messages": HI, "stream": True, "logprobs": True})
    host, port = stack.url.removeprefix("http://").split(":")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, int(port)))
    try:
        client.sendall(f"POST /sessions/{stuck['session_id']}/v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
                       f"authorization: Bearer {stuck['api_key']}\r\ncontent-type: application/json\r\n"
                       f"content-length: {len(body)}\r\n\r\n".encode() + body)
        client.settimeout(10)
        assert client.recv(64).startswith(b"HTTP/1.1 200")  # then nothing more is read
        stalled = time.monotonic()
        served = [timed(lambda: httpx.get(f"{stack.url}/healthz", timeout=10)),
                  timed(lambda: drained(openai_client(other).chat.completions.create(model="m", messages=HI,
                                                                                      stream=True))),
                  timed(lambda: openai_client(stuck).chat.completions.create(model="m", messages=HI))]
        time.sleep(max(0.0, SEND_TIMEOUT_S + 1.0 - (time.monotonic() - stalled)))
        got, reset = b"", False
        try:
            while chunk := client.recv(65536):
                got += chunk
        except ConnectionResetError:
            reset = True
    finally:
        client.close()
    print(f"while stalled: {[(type(r).__name__, round(t, 2)) for r, t in served]}; read {len(got)} bytes after "
          f"{SEND_TIMEOUT_S + 1:g} s, {'reset' if reset else 'closed'}")
    (health, health_s), (streamed, _), (plain, _) = served
    assert isinstance(health, httpx.Response) and health.status_code == 200 and health_s < 2.0
    assert isinstance(streamed, int) and streamed > 0, streamed
    assert isinstance(plain, ChatCompletion), plain
    assert reset or b"data: [DONE]" not in got, "the edge held the stalled reply until the client read it all"
    ended = (TurnCompleted, TurnAbandoned)  # committed (the edge never waits for a client), or abandoned
    eventually(lambda: sorted(e.request_no for e in stack.events(stuck["session_id"]) if isinstance(e, ended))
               == [1, 2])


# --- 5. a slow consumer -------------------------------------------------------------------------------


async def test_a_paused_materializer_stalls_no_turn_and_everything_is_materialized_once_after(make_stack, nats_server,
                                                                                              tmp_path):
    """``rollbus materializer`` as a process of its own, paused (SIGSTOP) for longer than its ``--ack-wait``
    while a step's sessions run and are finalized: the edge serves them as fast as without it (the log
    absorbs the backlog: no request needs a retry), nothing is materialized meanwhile; resumed, it
    materializes every session exactly once, those of the step before the pause too."""
    stack = make_stack(components=("edge", "projector"))
    data = tmp_path / "materialized"
    materializer = MaterializerProcess(nats_server.url, data, tmp_path / "materializer.log",
                                       ["--metrics-port", "off", "--batch-size", "8"])
    driver = Driver(stack.url, e2e.ADMIN_TOKEN, concurrency=8, n=4)
    try:
        await materializer.ready()
        before = await driver.step(8, uid_prefix="before")
        assert len((await wait_marked(nats_server.url, before.session_ids, timeout=30))[0]) == 8  # it runs
        os.kill(materializer.proc.pid, signal.SIGSTOP)
        try:
            during = await driver.step(32, uid_prefix="during")
            await asyncio.sleep(3.0)  # past its --ack-wait (2 s): signals it held are handed out again
            assert (await wait_marked(nats_server.url, during.session_ids, timeout=0.5))[0] == {}
        finally:
            os.kill(materializer.proc.pid, signal.SIGCONT)
        ids = before.session_ids + during.session_ids
        statuses, _ = await wait_marked(nats_server.url, ids, timeout=60)
    finally:
        assert materializer.stop() == 0, materializer.output.read_text()[-3000:]
    print(f"paused: 32 sessions ran in {during.ran_s:.1f} s, finalized in {during.finalize_s:.1f} s "
          f"(before the pause: 8 in {before.ran_s:.1f} s, {before.finalize_s:.1f} s); {materializer.batches()} batches")
    assert not driver.retried, driver.retried  # every request answered the first time
    assert during.trajectories == 32
    assert outcome(data / "trajectories", ids, statuses) == \
        Outcome(sessions=40, lost=0, duplicated=0, quarantined=0, other={}, stray=0)
