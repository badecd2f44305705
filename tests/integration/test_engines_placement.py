"""Several engine servers behind one client: placement, stickiness, health probing, bounded retries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from edge.engines import GenerateRequest, SamplingParams
from edge.engines.http import HttpEngine
from edge.engines.sglang import SGLangEngine
from edge.engines.vllm import VLLMEngine
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, ScriptedServer
from rollbus.testing.scripted_vllm import ScriptedVLLMServer
from schemas.errors import EngineError, EngineUnavailable

KINDS = {"sglang": (ScriptedEngineServer, SGLangEngine), "vllm": (ScriptedVLLMServer, VLLMEngine)}


def request(session: str, n: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=f"{session}:{n}", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=8))


def answered(server: ScriptedServer) -> list[str]:
    """The request ids a server received, whatever its protocol."""
    return [body.get("rid") or body.get("request_id") for body in server.requests]


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def servers(kind: str) -> Iterator[tuple[ScriptedServer, ScriptedServer]]:
    make = KINDS[kind][0]
    responder = lambda ids, body: ScriptedReply([7, 8])  # noqa: E731
    with make(responder=responder) as a, make(responder=responder) as b:
        yield a, b


@pytest.fixture
async def engine(kind: str, servers: tuple[ScriptedServer, ScriptedServer]) -> AsyncIterator[HttpEngine]:
    client = KINDS[kind][1]([s.url for s in servers], timeout=5.0, connect_timeout=1.0, health_interval=0.05)
    yield client
    await client.aclose()


async def test_new_sessions_spread_and_each_sticks_to_its_server(servers, engine) -> None:
    a, b = servers
    for n in range(3):
        for session in ("s1", "s2"):
            await engine.generate(request(session, n))
    assert answered(a) == ["s1:0", "s1:1", "s1:2"]
    assert answered(b) == ["s2:0", "s2:1", "s2:2"]


async def test_a_refused_connection_is_retried_once_on_another_server(servers, engine) -> None:
    a, b = servers
    a.down()
    result = await engine.generate(request("s1"))
    assert result.token_ids == (7, 8)
    assert answered(b) == ["s1:0"]
    assert engine.pool.server_of("s1") == b.url and not engine.pool.is_healthy(a.url)
    chunks = [item async for item in engine.stream(request("s2"))]  # a new session avoids the refusing server
    assert chunks[-1].token_ids == (7, 8) and answered(b) == ["s1:0", "s2:0"]


async def test_with_every_server_refusing_the_error_is_unavailable(servers, engine) -> None:
    for server in servers:
        server.down()
    with pytest.raises(EngineUnavailable):
        await engine.generate(request("s1"))


@pytest.mark.parametrize("fault", ["http_500", "truncated_stream"])
async def test_a_failure_after_the_request_was_sent_is_never_retried(servers, engine, fault: str) -> None:
    a, b = servers
    a.push(ScriptedReply([1, 2, 3, 4, 5, 6], fault=fault))  # type: ignore[arg-type]
    with pytest.raises(EngineError):
        _ = [item async for item in engine.stream(request("s1"))]
    assert answered(a) == ["s1:0"] and b.requests == []
    assert engine.pool.is_healthy(a.url)


async def test_an_unhealthy_server_gets_no_new_sessions_until_it_recovers(servers, engine) -> None:
    a, b = servers
    await engine.generate(request("s1"))  # placed on a; starts the background prober
    a.healthy = False
    await eventually(lambda: not engine.pool.is_healthy(a.url))
    await engine.generate(request("s2"))
    await engine.generate(request("s1", 1))  # its server is unhealthy: re-placed
    assert answered(b) == ["s2:0", "s1:1"]
    a.healthy = True
    await eventually(lambda: engine.pool.is_healthy(a.url))
    await engine.generate(request("s3"))
    assert answered(a) == ["s1:0", "s3:0"]


async def test_a_server_that_comes_back_is_probed_healthy_again(servers, engine) -> None:
    a, b = servers
    a.down()
    await engine.generate(request("s1"))  # refused on a, answered by b
    a.up()
    await eventually(lambda: engine.pool.is_healthy(a.url))
    await engine.generate(request("s2"))
    assert answered(a) == ["s2:0"] and answered(b) == ["s1:0"]
