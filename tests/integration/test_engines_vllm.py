"""vLLM specifics (the shared contract is in ``test_engines_http.py``): the two APIs' requests,
the fallback from ``/inference/v1/generate`` to ``/v1/completions``, and reply checks."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from edge.engines import GenerateRequest, SamplingParams
from edge.engines.base import Constraint
from edge.engines.vllm import VLLMEngine
from rollbus.testing.scripted import ScriptedReply
from rollbus.testing.scripted_vllm import ScriptedVLLMServer
from schemas.errors import EngineError


def request(return_logprob: bool = True, **sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id="ab12:0", input_ids=[1, 2, 3], return_logprob=return_logprob,
                           sampling=SamplingParams(max_new_tokens=64, **sampling))  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[ScriptedVLLMServer]:
    with ScriptedVLLMServer(chunk_size=4) as running:
        yield running


SAMPLING = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["</x>"],
            "stop_token_ids": [7], "skip_special_tokens": False, "include_stop_str_in_output": True, "logprobs": 0}


async def test_the_generate_request_is_tokens_in(server) -> None:
    engine = VLLMEngine([server.url], api="generate")
    server.push(ScriptedReply([4]), ScriptedReply([5]))
    await engine.generate(request(temperature=0.7, top_p=0.9, top_k=20, stop=("</x>",), stop_token_ids=(7,)))
    _ = [item async for item in engine.stream(request())]
    await engine.aclose()
    plain, streamed = server.requests
    assert plain == {"request_id": "ab12:0", "token_ids": [1, 2, 3], "sampling_params": SAMPLING, "stream": False}
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


async def test_the_completions_request_carries_a_token_prompt(server) -> None:
    engine = VLLMEngine([server.url], api="completions", model="served")
    server.push(ScriptedReply([4]))
    await engine.generate(request(temperature=0.7, top_p=0.9, top_k=20, stop=("</x>",), stop_token_ids=(7,)))
    await engine.aclose()
    assert server.requests[-1] == {"prompt": [1, 2, 3], "return_token_ids": True, "stream": False,
                                   "request_id": "ab12:0", "model": "served", **SAMPLING}


async def test_disabled_top_k_and_unwanted_logprobs_are_left_out(server) -> None:
    engine = VLLMEngine([server.url], api="generate")
    server.push(ScriptedReply([4]))
    result = await engine.generate(request(return_logprob=False, top_k=-1))
    await engine.aclose()
    assert result.logprobs is None
    assert {"top_k", "logprobs"}.isdisjoint(server.requests[-1]["sampling_params"])


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
async def test_a_server_without_the_generate_route_falls_back_to_completions(streamed: bool) -> None:
    with ScriptedVLLMServer(generate_route=False) as server:
        engine = VLLMEngine([server.url])
        server.push(ScriptedReply([4, 5]), ScriptedReply([6]))
        first = [i async for i in engine.stream(request())][-1] if streamed else await engine.generate(request())
        second = await engine.generate(request())
        await engine.aclose()
    assert first.token_ids == (4, 5) and second.token_ids == (6,)  # type: ignore[union-attr]
    assert engine.api[server.url] == "completions"
    assert [("prompt" in body) for body in server.requests] == [True, True]  # the 404 is not a request it logs
    assert server.aborted == []


async def test_a_missing_generate_route_is_an_error_when_pinned(server) -> None:
    server.generate_route = False
    engine = VLLMEngine([server.url], api="generate")
    with pytest.raises(EngineError, match="404"):
        await engine.generate(request())
    await engine.aclose()


class _LyingUsage(ScriptedVLLMServer):
    """Reports one completion token more than it streamed."""

    def _stream_end(self, body: dict, plan) -> bytes:  # type: ignore[no-untyped-def, override]
        return b'data: {"choices": [], "usage": {"completion_tokens": 99}}\n\ndata: [DONE]\n\n'


async def test_a_usage_count_that_disagrees_with_the_tokens_is_an_error() -> None:
    with _LyingUsage() as server:
        engine = VLLMEngine([server.url], api="generate")
        server.push(ScriptedReply([4, 5]))
        with pytest.raises(EngineError, match="99 completion tokens"):
            _ = [item async for item in engine.stream(request())]
        await engine.aclose()


class _OldErrors(ScriptedVLLMServer):
    """Older vLLM: errors as ``{"object": "error", "message": ...}``."""

    def _routes(self) -> list[Route]:
        async def fail(request: Request) -> Response:
            return Response(b'{"object": "error", "message": "old-style failure", "type": "x", "code": 400}',
                            status_code=200, media_type="application/json")

        return [Route("/inference/v1/generate", fail, methods=["POST"])]


async def test_an_old_style_error_object_is_an_error() -> None:
    with _OldErrors() as server:
        engine = VLLMEngine([server.url], api="generate")
        with pytest.raises(EngineError, match="old-style failure"):
            await engine.generate(request())
        await engine.aclose()


async def test_an_unknown_finish_reason_is_an_error() -> None:
    class _Weird(ScriptedVLLMServer):
        def _event(self, *args: object, **kwargs: object) -> dict:  # type: ignore[override]
            event = super()._event(*args, **kwargs)  # type: ignore[arg-type]
            event["choices"][0]["finish_reason"] = "error"
            return event

    with _Weird() as weird:
        engine = VLLMEngine([weird.url], api="generate")
        weird.push(ScriptedReply([4]))
        with pytest.raises(EngineError, match="finished with 'error'"):
            await engine.generate(request())
        await engine.aclose()


GRAMMAR = Constraint(label="tool:f", grammar='start: "<tool_call>" %json {"type": "object"}')
JSON_ONLY = Constraint(label="json_schema:answer", grammar="start: %json {}", json_schema={"type": "integer"})


@pytest.mark.parametrize("api", ["generate", "completions"])
async def test_a_constraint_reaches_vllm_as_structured_outputs(server, api: str) -> None:
    engine = VLLMEngine([server.url], api=api)  # type: ignore[arg-type]
    server.push(ScriptedReply([4]), ScriptedReply([5]), ScriptedReply([6]))
    await engine.generate(msgspec.structs.replace(request(), constraint=GRAMMAR))
    _ = [item async for item in engine.stream(msgspec.structs.replace(request(), constraint=JSON_ONLY))]
    await engine.generate(request())
    await engine.aclose()
    assert server.constraints == [{"grammar": GRAMMAR.grammar}, {"json": {"type": "integer"}}, None]
    sampling = server.requests[0]["sampling_params"] if api == "generate" else server.requests[0]
    assert sampling["structured_outputs"] == {"grammar": GRAMMAR.grammar}


@pytest.mark.parametrize("api", ["generate", "completions"])
async def test_a_turn_with_images_is_refused_before_anything_is_sent(server, api) -> None:
    from edge.engines.vllm import NO_IMAGES
    from edge.http_errors import http_error
    from schemas.errors import EngineRefused

    engine = VLLMEngine([server.url], api=api)  # type: ignore[arg-type]
    with pytest.raises(EngineRefused) as refused:
        await engine.generate(msgspec.structs.replace(request(), images=(b"\x89PNG...",)))
    await engine.aclose()
    assert refused.value.message == NO_IMAGES and http_error(refused.value).status == 400
    assert server.requests == []
