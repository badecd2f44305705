"""One contract, every HTTP engine client: SGLang (cumulative and incremental streaming) and
vLLM (``/inference/v1/generate`` and ``/v1/completions``), each against its scripted server
over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from edge.engines import Engine, GenerateChunk, GenerateRequest, GenerateResult, SamplingParams
from edge.engines.http import HttpEngine
from edge.engines.sglang import SGLangEngine
from edge.engines.vllm import VLLMEngine
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, ScriptedServer, default_logprobs
from rollbus.testing.scripted_vllm import ScriptedVLLMServer
from schemas.errors import EngineError, EngineTimeout, EngineUnavailable

TOKENS = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100]


@dataclass(frozen=True)
class Backend:
    name: str
    server: Callable[..., ScriptedServer]
    engine: Callable[..., HttpEngine]
    abort_prefix: str


BACKENDS = [
    Backend("sglang", ScriptedEngineServer, SGLangEngine, ""),
    Backend("sglang-incremental", lambda **kw: ScriptedEngineServer(incremental_streaming_output=True, **kw),
            SGLangEngine, ""),
    Backend("vllm-generate", ScriptedVLLMServer, lambda urls, **kw: VLLMEngine(urls, api="generate", **kw),
            "generate-tokens-"),
    Backend("vllm-completions", ScriptedVLLMServer, lambda urls, **kw: VLLMEngine(urls, api="completions", **kw),
            "cmpl-"),
]


def request(max_new_tokens: int = 64, request_id: str = "ab12:0", return_logprob: bool = True,
            **sampling: Any) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, input_ids=[1, 2, 3],
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling),
                           return_logprob=return_logprob)


async def collect(engine: HttpEngine, req: GenerateRequest) -> tuple[list[GenerateChunk], GenerateResult]:
    items = [item async for item in engine.stream(req)]
    chunks, final = items[:-1], items[-1]
    assert all(isinstance(chunk, GenerateChunk) for chunk in chunks)
    assert isinstance(final, GenerateResult)
    return chunks, final  # type: ignore[return-value]


async def run(engine: HttpEngine, req: GenerateRequest, streamed: bool) -> GenerateResult:
    return (await collect(engine, req))[1] if streamed else await engine.generate(req)


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param


@pytest.fixture
def server(backend: Backend) -> Iterator[ScriptedServer]:
    with backend.server(chunk_size=4) as running:
        yield running


@pytest.fixture
async def engine(backend: Backend, server: ScriptedServer) -> AsyncIterator[HttpEngine]:
    client = backend.engine([server.url], timeout=5.0)
    yield client
    await client.aclose()


STREAMED = pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])


def test_satisfies_the_engine_protocol(engine: HttpEngine) -> None:
    assert isinstance(engine, Engine)


@STREAMED
async def test_exact_tokens_logprobs_and_finish(server, engine, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS[:3], logprobs=[-0.5, -1.5, -2.5]))
    result = await run(engine, request(temperature=0.7, top_p=0.9, top_k=20), streamed)
    assert (result.token_ids, result.logprobs, result.finish_reason) == ((11, 22, 33), (-0.5, -1.5, -2.5), "stop")


@STREAMED
async def test_the_token_limit_truncates_with_finish_length(server, engine, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS))
    result = await run(engine, request(max_new_tokens=6), streamed)
    assert result.token_ids == tuple(TOKENS[:6]) and result.logprobs == tuple(default_logprobs(6))
    assert result.finish_reason == "length"


@STREAMED
async def test_a_stop_token_is_kept_and_finishes_with_stop(server, engine, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, finish_reason="length"))
    result = await run(engine, request(stop_token_ids=(44,)), streamed)
    assert result.token_ids == (11, 22, 33, 44) and result.finish_reason == "stop"


@STREAMED
async def test_abort_finish_and_no_logprobs_when_not_asked(server, engine, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS[:2], finish_reason="abort"))
    result = await run(engine, request(return_logprob=False), streamed)
    assert (result.token_ids, result.logprobs, result.finish_reason) == ((11, 22), None, "abort")


async def test_stream_yields_only_new_tokens_then_the_whole_result(server, engine) -> None:
    server.push(ScriptedReply(TOKENS))
    chunks, final = await collect(engine, request())
    assert [chunk.token_ids for chunk in chunks] == [(11, 22, 33, 44), (55, 66, 77, 88), (99, 100)]
    assert [lp for chunk in chunks for lp in chunk.logprobs or ()] == default_logprobs(10)
    assert final.token_ids == tuple(TOKENS) and final.logprobs == tuple(default_logprobs(10))
    assert server.requests[-1]["stream"] is True


async def test_an_empty_queue_fails_loudly(engine) -> None:
    with pytest.raises(EngineError, match="no reply queued") as caught:
        await engine.generate(request())
    assert type(caught.value) is EngineError


@STREAMED
async def test_a_refused_connection_is_unavailable(backend, streamed: bool) -> None:
    engine = backend.engine([closed_port_url()], connect_timeout=1.0)
    with pytest.raises(EngineUnavailable) as caught:
        await run(engine, request(), streamed)
    assert caught.value.__cause__ is not None
    assert await engine.health() is False
    await engine.aclose()


@STREAMED
async def test_a_slow_server_is_a_timeout_and_gets_an_abort(backend, server, streamed: bool) -> None:
    engine = backend.engine([server.url], timeout=0.2)
    server.push(ScriptedReply(TOKENS, delay_s=1.0))
    with pytest.raises(EngineTimeout):
        await run(engine, request(request_id="ab12:5"), streamed)
    await eventually(lambda: server.aborted == [backend.abort_prefix + "ab12:5"])
    await engine.aclose()


@STREAMED
async def test_a_trickling_server_is_a_timeout_at_the_deadline_of_the_whole_call(backend, server, streamed) -> None:
    """Every read is answered within the timeout (a byte, or an event, every 0.1 s), the reply is not: the
    deadline bounds the whole call (a per-read timeout alone let the stream run its whole 2 s, the plain
    call past 30 s)."""
    engine = backend.engine([server.url], timeout=5.0, deadline=0.5)
    server.push(ScriptedReply(TOKENS * 8, chunk_delay_s=0.1, trickle_s=0.1))  # 20 events of 4
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match=r"did not complete its reply within 0\.5 s"):
        await run(engine, request(request_id="ab12:6", max_new_tokens=80), streamed)
    assert time.monotonic() - started < 1.5
    await eventually(lambda: server.aborted == [backend.abort_prefix + "ab12:6"])
    await engine.aclose()


@STREAMED
async def test_a_silent_server_is_a_timeout_at_the_wait_for_one_read_long_before_the_deadline(backend, server,
                                                                                              streamed) -> None:
    """The per-read wait bounds a server that takes the request and answers nothing, whatever the deadline
    (which is sized for the longest generation)."""
    engine = backend.engine([server.url], timeout=0.5, deadline=600.0)
    server.push(ScriptedReply(TOKENS, delay_s=30.0))
    started = time.monotonic()
    with pytest.raises(EngineTimeout):
        await run(engine, request(request_id="ab12:7", max_new_tokens=8), streamed)
    assert time.monotonic() - started < 1.5
    await eventually(lambda: server.aborted == [backend.abort_prefix + "ab12:7"])
    await engine.aclose()


FAULTS = [
    ("http_500", EngineError, "500"),
    ("http_503", EngineUnavailable, "503"),
    ("malformed_json", EngineError, "does not decode"),
    ("missing_fields", EngineError, "lacks"),
    ("engine_error", EngineError, "scripted engine error"),
]


@STREAMED
@pytest.mark.parametrize(("fault", "error", "message"), FAULTS, ids=[fault[0] for fault in FAULTS])
async def test_faults_map_to_engine_errors(server, engine, fault, error, message, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, fault=fault))
    with pytest.raises(EngineError, match=message) as caught:
        await run(engine, request(), streamed)
    assert type(caught.value) is error


async def test_a_truncated_stream_is_an_error(server, engine) -> None:
    server.push(ScriptedReply(TOKENS, fault="truncated_stream"))
    with pytest.raises(EngineError, match="without a finish reason"):
        await collect(engine, request())


@STREAMED
@pytest.mark.parametrize("logprobs", [[-0.1, -0.2], [-0.1] * 11], ids=["fewer", "more"])
async def test_a_logprob_count_mismatch_is_an_error(server, engine, logprobs, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, logprobs=logprobs))
    with pytest.raises(EngineError, match="log probs"):
        await run(engine, request(), streamed)


async def test_health_follows_the_server_after_two_failed_probes(server, engine) -> None:
    assert await engine.health() is True
    server.healthy = False
    assert await engine.health() is False
    assert engine.pool.healthy() == (server.url,)  # one slow or failed probe is not enough
    assert await engine.health() is False
    assert engine.pool.healthy() == ()
    server.healthy = True
    assert await engine.health() is True and engine.pool.healthy() == (server.url,)


async def test_closing_a_stream_early_aborts_it_on_the_server(backend, server, engine) -> None:
    server.push(ScriptedReply(TOKENS, chunk_delay_s=1.0), ScriptedReply([5]))
    stream = engine.stream(request(request_id="ab12:3"))
    first = await anext(stream)
    await stream.aclose()
    assert first == GenerateChunk(token_ids=(11, 22, 33, 44), logprobs=tuple(default_logprobs(4)))
    await eventually(lambda: server.aborted == [backend.abort_prefix + "ab12:3"])
    assert (await engine.generate(request())).token_ids == (5,)


async def test_cancelling_a_generate_call_aborts_it_on_the_server(backend, server, engine) -> None:
    server.push(ScriptedReply(TOKENS, delay_s=3.0))
    task = asyncio.create_task(engine.generate(request(request_id="ab12:4")))
    await eventually(lambda: len(server.requests) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: server.aborted == [backend.abort_prefix + "ab12:4"])


async def test_a_complete_reply_sends_no_abort(server, engine) -> None:
    server.push(ScriptedReply(TOKENS), ScriptedReply(TOKENS))
    await engine.generate(request())
    await collect(engine, request())
    await engine.probe()  # a round trip after both calls: any abort would have been sent by now
    assert server.aborted == []


async def test_abort_reaches_the_server(backend, server, engine) -> None:
    await engine.abort("ab12:3")
    assert server.aborted == [backend.abort_prefix + "ab12:3"]


class Dropping:
    """A TCP front for a server that reads the first ``drops`` POST requests of new connections and closes
    them without a reply (a keep-alive connection the server closed as the request went out); the rest
    are piped through."""

    def __init__(self, upstream: str, drops: int) -> None:
        self._host, self._port = upstream.removeprefix("http://").split(":")
        self.drops = drops
        self.url = ""
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Dropping:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        first = await reader.read(65536)
        if self.drops > 0 and first.startswith(b"POST"):  # a generation (not a health probe) is dropped
            self.drops -= 1
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(self._host, int(self._port))
        up_writer.write(first)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)


@STREAMED
async def test_a_request_dropped_before_any_reply_is_retried_once_on_a_fresh_connection(backend, server,
                                                                                         streamed: bool) -> None:
    async with Dropping(server.url, drops=1) as front:
        engine = backend.engine([front.url], timeout=5.0)
        server.push(ScriptedReply(TOKENS))
        result = await run(engine, request(), streamed)
        assert result.token_ids == tuple(TOKENS) and front.drops == 0
        assert engine.pool.is_healthy(front.url)  # a dropped connection says nothing of the server's health

        await engine.aclose()

        front.drops = 2  # dropped twice: the retry is dropped too, and the agent gets the error
        engine = backend.engine([front.url], timeout=5.0)
        with pytest.raises(EngineError, match="closed the connection before its reply"):
            await run(engine, request(), streamed)
        await engine.aclose()
