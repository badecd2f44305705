"""The verl adapter against an in-test fake that follows ``LLMServerClient.generate``'s signature
and returns ``TokenOutput``'s fields (verl itself is not installed here)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from edge.engines import Engine, GenerateChunk, GenerateRequest, GenerateResult, SamplingParams
from edge.engines.base import Constraint
from edge.engines.verl import VerlEngine
from edge.http_errors import http_error
from schemas.errors import EngineError, EngineRefused, EngineTimeout, EngineUnavailable

IM_END = 151645


@dataclass
class TokenOutput:
    """verl's ``TokenOutput`` fields (``verl/workers/rollout/replica.py``)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


class FakeLLMServerClient:
    """Follows ``LLMServerClient.generate(request_id, *, prompt_ids, sampling_params, image_data=None, ...)``."""

    def __init__(self, output: TokenOutput | None = None, error: BaseException | None = None) -> None:
        self.output, self.error = output, error
        self.calls: list[dict[str, Any]] = []
        self.hang = asyncio.Event()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: list[Any] | None = None, video_data: list[Any] | None = None,
                       **kwargs: Any) -> TokenOutput:
        self.calls.append({"request_id": request_id, "prompt_ids": prompt_ids, "sampling_params": sampling_params,
                           "image_data": image_data, **kwargs})
        if self.error is not None:
            raise self.error
        if self.output is None:
            await self.hang.wait()
        assert self.output is not None
        return self.output


class RayActorError(Exception):
    """Named like Ray's: the adapter recognizes the family by class name."""


class ActorDiedError(RayActorError):
    pass


def request(max_new_tokens: int = 4, return_logprob: bool = True, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(request_id="5e55:3", input_ids=[1, 2, 3], return_logprob=return_logprob,
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(IM_END,),
                                                   **sampling))


async def test_satisfies_the_engine_protocol_and_sends_the_session_as_request_id() -> None:
    client = FakeLLMServerClient(TokenOutput([5, 6, IM_END], [-0.1, -0.2, -0.3], stop_reason="completed"))
    engine = VerlEngine(client)
    assert isinstance(engine, Engine)
    result = await engine.generate(request(temperature=0.6, top_p=0.9, top_k=0, stop=("</x>",)))
    assert result == GenerateResult(token_ids=(5, 6, IM_END), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop")
    assert client.calls == [{
        "request_id": "5e55", "prompt_ids": [1, 2, 3], "image_data": None,
        "sampling_params": {"max_tokens": 4, "temperature": 0.6, "top_p": 0.9, "top_k": -1, "logprobs": True,
                            "stop": ["</x>"], "stop_token_ids": [IM_END]},
    }]


@pytest.mark.parametrize(("stop_reason", "tokens", "finish"), [
    ("completed", [5, 6, 7, 8], "length"),  # used every token it was allowed, no stop token: truncated
    ("completed", [5, 6, 7, IM_END], "stop"),  # the last allowed token was the stop token
    ("completed", [5, IM_END], "stop"),
    ("completed", [5, 6], "stop"),  # a stop string ended it early
    (None, [5, 6, 7, 8], "length"),
    ("aborted", [5], "abort"),
    ("length", [5], "length"),
    ("stop", [5, 6, 7, 8], "stop"),
])
async def test_stop_and_length_stay_distinct(stop_reason, tokens, finish) -> None:
    output = TokenOutput(tokens, [-0.5] * len(tokens), stop_reason=stop_reason)
    assert (await VerlEngine(FakeLLMServerClient(output)).generate(request())).finish_reason == finish


async def test_global_steps_become_the_weight_version() -> None:
    output = TokenOutput([5], [-0.5], stop_reason="completed", extra_fields={"global_steps": 12})
    assert (await VerlEngine(FakeLLMServerClient(output)).generate(request())).weight_version == "12"


@pytest.mark.parametrize(("extra", "version"), [
    ({"global_steps": 3, "min_global_steps": 3, "max_global_steps": 3}, "3"),
    ({"global_steps": 4, "min_global_steps": 3, "max_global_steps": 4}, "3..4"),  # resumed across an update
    ({"min_global_steps": 3, "max_global_steps": 5}, "3..5"),
    ({"global_steps": 4, "min_global_steps": None, "max_global_steps": None}, "4"),
    ({"global_steps": 4, "min_global_steps": 2}, "2..4"),
    ({"global_steps": "step-4"}, "step-4"),  # not a number: kept as it is (and ignored by the materializer)
    ({"global_steps": True}, "True"),
    ({}, None),
])
async def test_a_partial_rollout_spanning_weight_versions_keeps_the_span(extra, version) -> None:
    output = TokenOutput([5], [-0.5], stop_reason="completed", extra_fields=extra)
    assert (await VerlEngine(FakeLLMServerClient(output)).generate(request())).weight_version == version


async def test_the_span_reaches_the_trajectory_tags() -> None:
    import msgspec

    from materializer.records import derive_records
    from session.fold import fold
    from tests.helpers import SessionScript

    script = SessionScript(metadata={"global_steps": 9})
    for turn, extra in enumerate(({"global_steps": 3}, {"global_steps": 4, "min_global_steps": 3,
                                                         "max_global_steps": 4}, {"global_steps": 5})):
        output = TokenOutput([5], [-0.5], stop_reason="completed", extra_fields=extra)
        result = await VerlEngine(FakeLLMServerClient(output)).generate(request())
        script.turn(0, [turn], list(result.token_ids), new_chain=turn == 0, n_messages=2 + 2 * turn, tip=f"t{turn}")
        script.events[-1] = msgspec.structs.replace(script.events[-1], weight_version=result.weight_version)
    script.finalize()
    (record,) = derive_records(fold(script.events))
    assert (record.tags()["min_global_steps"], record.tags()["max_global_steps"]) == (3, 5)


async def test_no_logprobs_when_not_asked() -> None:
    output = TokenOutput([5, 6], None, stop_reason="completed")
    result = await VerlEngine(FakeLLMServerClient(output)).generate(request(return_logprob=False))
    assert result.logprobs is None and result.token_ids == (5, 6)


@pytest.mark.parametrize(("output", "message"), [
    (TokenOutput([5, 6], [-0.1], stop_reason="completed"), "1 log probs for 2 tokens"),
    (TokenOutput([5, 6], None, stop_reason="completed"), "no log probs for 2 tokens"),
    (TokenOutput([5], [-0.1], stop_reason="error"), "unknown stop reason 'error'"),
    (object(), "no token ids"),
])
async def test_bad_outputs_are_engine_errors(output, message) -> None:
    with pytest.raises(EngineError, match=message) as caught:
        await VerlEngine(FakeLLMServerClient(output)).generate(request())  # type: ignore[arg-type]
    assert type(caught.value) is EngineError


@pytest.mark.parametrize(("error", "expected"), [
    (ActorDiedError("replica gone"), EngineUnavailable),
    (RuntimeError("No available servers in load balancer"), EngineUnavailable),
    (ConnectionResetError("reset"), EngineUnavailable),
    (ValueError("Prompt length (9000) exceeds the model's maximum context length (8192)."), EngineRefused),
    (ValueError("Prompt length (8192) leaves no room to generate within the model's maximum context length "
                "(8192); need at least 1 token of headroom."), EngineRefused),
    (ValueError("bad sampling params"), EngineError),
    (TimeoutError("ray get timed out"), EngineTimeout),
])
async def test_client_errors_are_converted_once(error: Exception, expected: type[EngineError]) -> None:
    with pytest.raises(EngineError) as caught:
        await VerlEngine(FakeLLMServerClient(error=error)).generate(request())
    assert type(caught.value) is expected and caught.value.__cause__ is error


async def test_a_prompt_too_long_for_verls_server_is_refused_with_its_words() -> None:
    """verl's SGLang server raises this ValueError (through Ray, as a subclass of it)."""
    error = ValueError("Prompt length (40000) exceeds the model's maximum context length (32768).")
    with pytest.raises(EngineRefused) as caught:
        await VerlEngine(FakeLLMServerClient(error=error)).generate(request())
    assert http_error(caught.value).status == 400
    assert str(caught.value) == ("verl rollout server refused the request: Prompt length (40000) exceeds the "
                                 "model's maximum context length (32768).")


async def test_no_answer_in_time_is_a_timeout() -> None:
    client = FakeLLMServerClient()  # never answers
    with pytest.raises(EngineTimeout, match="did not answer"):
        await VerlEngine(client, timeout=0.05).generate(request())


async def test_stream_yields_the_whole_generation_once() -> None:
    output = TokenOutput([5, 6], [-0.1, -0.2], stop_reason="completed")
    engine = VerlEngine(FakeLLMServerClient(output))
    items = [item async for item in engine.stream(request())]
    assert items == [GenerateChunk(token_ids=(5, 6), logprobs=(-0.1, -0.2)),
                     GenerateResult(token_ids=(5, 6), logprobs=(-0.1, -0.2), finish_reason="stop")]
    await engine.aclose()


async def test_a_constrained_request_is_refused_not_sampled_free() -> None:
    client = FakeLLMServerClient(TokenOutput([5], [-0.1], stop_reason="completed"))
    constrained = msgspec.structs.replace(request(), constraint=Constraint(label="tool:required", grammar="start: x"))
    with pytest.raises(EngineRefused, match=r"cannot sample under a constraint \(tool:required\)"):
        await VerlEngine(client).generate(constrained)
    assert client.calls == []


async def test_a_turns_images_reach_verl_as_rgb_pil_images() -> None:
    from PIL import Image

    from tests.images import png

    client = FakeLLMServerClient(TokenOutput(token_ids=[5, IM_END], log_probs=[-0.1, -0.2], stop_reason="completed"))
    engine = VerlEngine(client)
    red = png(6, 4, (255, 0, 0))
    await engine.generate(msgspec.structs.replace(request(), images=(red, png(3, 3, (0, 0, 255)))))
    await engine.generate(request())
    with_images, without = client.calls
    first, second = with_images["image_data"]
    assert isinstance(first, Image.Image) and first.mode == "RGB" and first.size == (6, 4)
    assert first.getpixel((0, 0)) == (255, 0, 0) and second.getpixel((1, 1)) == (0, 0, 255)
    assert without["image_data"] is None  # no images: verl's default, not an empty list


async def test_an_image_that_does_not_decode_is_refused() -> None:
    engine = VerlEngine(FakeLLMServerClient(TokenOutput(token_ids=[IM_END], log_probs=[-0.1])))
    with pytest.raises(EngineRefused, match="image 0 of the turn does not decode"):
        await engine.generate(msgspec.structs.replace(request(), images=(b"\x89PNG\r\n\x1a\nbroken",)))
