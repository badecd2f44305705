"""An engine refusing the input (its HTTP 400, or SGLang's first SSE error event) is
:class:`EngineRefused` (400, the engine's message, bounded); other failures keep their errors.
Every HTTP engine client against its scripted server, over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from edge.engines.http import REFUSAL_CHARS, HttpEngine
from edge.http_errors import HttpError, http_error
from rollbus.testing.scripted import ScriptedReply, ScriptedServer
from schemas.errors import EngineError, EngineRefused, EngineUnavailable
from tests.integration.test_engines_http import BACKENDS, STREAMED, TOKENS, Backend, request, run

TOO_LONG = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."


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


@STREAMED
async def test_a_refused_input_is_engine_refused_with_the_engines_message(server, engine, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, fault="refused", error_message=TOO_LONG))
    with pytest.raises(EngineRefused) as caught:
        await run(engine, request(), streamed)
    refused = caught.value
    assert http_error(refused) == HttpError(400, "invalid_request_error", "invalid_request_error",
                                            "invalid_request_error")
    assert TOO_LONG in refused.message
    assert server.url not in refused.message  # the agent is not told where the engine runs
    assert server.served == 1  # not retried
    assert not server.aborted  # nothing was started, so nothing is aborted
    server.push(ScriptedReply(TOKENS[:2]))
    assert (await run(engine, request(), streamed)).token_ids == tuple(TOKENS[:2])


async def test_a_refusal_message_is_bounded(server, engine) -> None:
    server.push(ScriptedReply(TOKENS, fault="refused", error_message="too long " * 1000))
    with pytest.raises(EngineRefused) as caught:
        await engine.generate(request())
    assert len(caught.value.message) <= REFUSAL_CHARS + 40 and caught.value.message.endswith("...")


@STREAMED
@pytest.mark.parametrize(("fault", "error"), [("http_500", EngineError), ("http_503", EngineUnavailable),
                                              ("engine_error", EngineError)])
async def test_other_failures_are_not_refusals(server, engine, fault, error, streamed: bool) -> None:
    server.push(ScriptedReply(TOKENS, fault=fault))
    with pytest.raises(EngineError) as caught:
        await run(engine, request(), streamed)
    assert type(caught.value) is error and http_error(caught.value).status >= 500
