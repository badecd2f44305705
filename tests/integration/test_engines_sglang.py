"""The SGLang client against the scripted SGLang server, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from edge.engines import Engine, GenerateChunk, GenerateRequest, GenerateResult, SamplingParams
from edge.engines.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from edge.engines.sglang import SGLangEngine
from schemas.errors import EngineError, EngineTimeout, EngineUnavailable

TOKENS = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100]


def request(
    max_new_tokens: int = 64, request_id: str = "ab12:0", return_logprob: bool = True, **sampling: object
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling),
        return_logprob=return_logprob,
    )


@pytest.fixture
def server() -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(chunk_size=4) as running:
        yield running


@pytest.fixture
async def engine(server: ScriptedEngineServer) -> AsyncIterator[SGLangEngine]:
    client = SGLangEngine([server.url], timeout=5.0)
    yield client
    await client.aclose()


async def collect(engine: SGLangEngine, req: GenerateRequest) -> tuple[list[GenerateChunk], GenerateResult]:
    items = [item async for item in engine.stream(req)]
    chunks, final = items[:-1], items[-1]
    assert all(isinstance(chunk, GenerateChunk) for chunk in chunks)
    assert isinstance(final, GenerateResult)
    return chunks, final  # type: ignore[return-value]


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_satisfies_the_engine_protocol(engine: SGLangEngine) -> None:
    assert isinstance(engine, Engine)


async def test_generate_returns_exact_tokens_logprobs_and_finish(server, engine) -> None:
    server.push(ScriptedReply(TOKENS[:3], logprobs=[-0.5, -1.5, -2.5], weight_version="w7"))
    result = await engine.generate(request(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(7,)))
    assert result == GenerateResult(
        token_ids=(11, 22, 33), logprobs=(-0.5, -1.5, -2.5), finish_reason="stop", weight_version="w7"
    )
    body = server.requests[-1]
    assert body["input_ids"] == [1, 2, 3]
    assert body["rid"] == "ab12:0"
    assert body["stream"] is False and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "max_new_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop": [],
        "stop_token_ids": [7],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


async def test_numpy_token_ids_are_sent_as_plain_ints(server, engine) -> None:
    server.push(ScriptedReply([4]))
    req = GenerateRequest(
        request_id="ab12:1", input_ids=np.array([7, 8], dtype=np.uint32), sampling=SamplingParams(max_new_tokens=2)
    )
    assert (await engine.generate(req)).token_ids == (4,)
    assert server.requests[-1]["input_ids"] == [7, 8]


async def test_max_new_tokens_truncates_with_finish_length(server, engine) -> None:
    server.push(ScriptedReply(TOKENS))
    result = await engine.generate(request(max_new_tokens=4))
    assert result.token_ids == tuple(TOKENS[:4])
    assert result.logprobs == tuple(default_logprobs(4))
    assert result.finish_reason == "length"


async def test_stop_token_is_kept_and_finishes_with_stop(server, engine) -> None:
    server.push(ScriptedReply(TOKENS, finish_reason="length"))
    result = await engine.generate(request(stop_token_ids=(44,)))
    assert result.token_ids == (11, 22, 33, 44)
    assert result.finish_reason == "stop"


async def test_abort_finish_and_no_logprobs_when_not_asked(server, engine) -> None:
    server.push(ScriptedReply(TOKENS[:2], finish_reason="abort"))
    result = await engine.generate(request(return_logprob=False))
    assert result.finish_reason == "abort"
    assert result.token_ids == (11, 22)
    assert result.logprobs is None


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_stream_yields_only_new_tokens_then_the_whole_result(incremental: bool) -> None:
    with ScriptedEngineServer(chunk_size=4, incremental_streaming_output=incremental) as server:
        engine = SGLangEngine([server.url])
        server.push(ScriptedReply(TOKENS))
        chunks, final = await collect(engine, request())
        await engine.aclose()
    assert [chunk.token_ids for chunk in chunks] == [(11, 22, 33, 44), (55, 66, 77, 88), (99, 100)]
    assert [lp for chunk in chunks for lp in chunk.logprobs or ()] == default_logprobs(10)
    assert final.token_ids == tuple(TOKENS)
    assert final.logprobs == tuple(default_logprobs(10))
    assert final.finish_reason == "stop"
    assert server.requests[-1]["stream"] is True


async def test_stream_honours_max_new_tokens(server, engine) -> None:
    server.push(ScriptedReply(TOKENS))
    chunks, final = await collect(engine, request(max_new_tokens=6))
    assert [chunk.token_ids for chunk in chunks] == [(11, 22, 33, 44), (55, 66)]
    assert final.finish_reason == "length"


async def test_empty_generation_streams_no_chunk(server, engine) -> None:
    server.push(ScriptedReply([]))
    chunks, final = await collect(engine, request())
    assert chunks == []
    assert final.token_ids == () and final.finish_reason == "stop"


async def test_responder_answers_when_the_queue_is_empty() -> None:
    with ScriptedEngineServer(responder=lambda ids, body: ScriptedReply([*reversed(ids)])) as server:
        client = SGLangEngine([server.url])
        result = await client.generate(request())
        await client.aclose()
    assert result.token_ids == (3, 2, 1)


async def test_empty_queue_fails_loudly(engine) -> None:
    with pytest.raises(EngineError, match="no reply queued") as caught:
        await engine.generate(request())
    assert type(caught.value) is EngineError


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
async def test_connection_refused_is_unavailable(streamed: bool) -> None:
    engine = SGLangEngine([closed_port_url()], connect_timeout=1.0)
    with pytest.raises(EngineUnavailable) as caught:
        await (collect(engine, request()) if streamed else engine.generate(request()))
    assert caught.value.__cause__ is not None
    assert await engine.health() is False
    await engine.aclose()


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
async def test_slow_server_is_a_timeout(server, streamed: bool) -> None:
    engine = SGLangEngine([server.url], timeout=0.2)
    server.push(ScriptedReply(TOKENS, delay_s=1.0))
    with pytest.raises(EngineTimeout):
        await (collect(engine, request()) if streamed else engine.generate(request()))
    await engine.aclose()


FAULTS = [
    ("http_500", EngineError, "500"),
    ("http_503", EngineUnavailable, "503"),
    ("malformed_json", EngineError, "does not decode"),
    ("missing_fields", EngineError, "lacks output_ids or meta_info"),
    ("engine_error", EngineError, "scripted engine error"),
]


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
@pytest.mark.parametrize(("fault", "error", "message"), FAULTS, ids=[fault[0] for fault in FAULTS])
async def test_faults_map_to_engine_errors(server, engine, fault, error, message, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, fault=fault))
    with pytest.raises(EngineError, match=message) as caught:
        await (collect(engine, request()) if streamed else engine.generate(request()))
    assert type(caught.value) is error


async def test_truncated_stream_is_an_error(server, engine) -> None:
    server.push(ScriptedReply(TOKENS, fault="truncated_stream"))
    with pytest.raises(EngineError, match="without a finish reason"):
        await collect(engine, request())


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
@pytest.mark.parametrize("logprobs", [[-0.1, -0.2], [-0.1] * 11], ids=["fewer", "more"])
async def test_logprob_count_mismatch_is_an_error(server, engine, logprobs, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, logprobs=logprobs))
    with pytest.raises(EngineError, match="log probs"):
        await (collect(engine, request()) if streamed else engine.generate(request()))


async def test_health_follows_the_server(server, engine) -> None:
    assert await engine.health() is True
    server.healthy = False
    assert await engine.health() is False


async def test_abort_reaches_the_server(server, engine) -> None:
    await engine.abort("ab12:3")
    assert server.aborted == ["ab12:3"]


async def test_a_session_sticks_to_one_server() -> None:
    engine = SGLangEngine(["http://a:1", "http://b:2/", "http://c:3"])
    for session in ("s1", "s2", "deadbeef", "0123"):
        assert len({engine.url_for(f"{session}:{n}") for n in range(5)}) == 1
    assert {engine.url_for(f"{n:04x}:0") for n in range(64)} == {"http://a:1", "http://b:2", "http://c:3"}
    await engine.aclose()


async def test_closing_a_stream_early_is_clean(server, engine) -> None:
    server.push(ScriptedReply(TOKENS), ScriptedReply([5]))
    stream = engine.stream(request())
    first = await anext(stream)
    await stream.aclose()
    assert first == GenerateChunk(token_ids=(11, 22, 33, 44), logprobs=tuple(default_logprobs(4)))
    assert (await engine.generate(request())).token_ids == (5,)
