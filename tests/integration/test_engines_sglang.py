"""SGLang specifics (the shared contract is in ``test_engines_http.py``): the request it sends,
the weight version it keeps, its streaming modes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import msgspec
import numpy as np
import pytest

from edge.engines import GenerateRequest, SamplingParams
from edge.engines.base import Constraint
from edge.engines.sglang import SGLangEngine
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply


def request(**sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id="ab12:0", input_ids=[1, 2, 3],
                           sampling=SamplingParams(max_new_tokens=64, **sampling))  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(chunk_size=4) as running:
        yield running


@pytest.fixture
async def engine(server: ScriptedEngineServer) -> AsyncIterator[SGLangEngine]:
    client = SGLangEngine([server.url], timeout=5.0)
    yield client
    await client.aclose()


async def test_the_request_body_is_sglangs_generate_input(server, engine) -> None:
    server.push(ScriptedReply([4]))
    await engine.generate(request(temperature=0.7, top_p=0.9, top_k=20, stop=("</x>",), stop_token_ids=(7,)))
    body = server.requests[-1]
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["</x>"],
                            "stop_token_ids": [7], "skip_special_tokens": False, "no_stop_trim": True},
        "return_logprob": True,
        "stream": False,
        "rid": "ab12:0",
    }


async def test_top_k_zero_means_disabled(server, engine) -> None:
    server.push(ScriptedReply([4]))
    await engine.generate(request(top_k=0))
    assert server.requests[-1]["sampling_params"]["top_k"] == -1


async def test_numpy_token_ids_are_sent_as_plain_ints(server, engine) -> None:
    server.push(ScriptedReply([4]))
    req = GenerateRequest(request_id="ab12:1", input_ids=np.array([7, 8], dtype=np.uint32),
                          sampling=SamplingParams(max_new_tokens=2))
    assert (await engine.generate(req)).token_ids == (4,)
    assert server.requests[-1]["input_ids"] == [7, 8]


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
async def test_the_weight_version_is_kept(server, engine, streamed: bool) -> None:
    server.push(ScriptedReply([1, 2, 3, 4, 5], weight_version="step-42"))
    if streamed:
        result = [item async for item in engine.stream(request())][-1]
    else:
        result = await engine.generate(request())
    assert result.weight_version == "step-42"  # type: ignore[union-attr]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_both_streaming_modes_are_understood_without_a_setting(incremental: bool) -> None:
    with ScriptedEngineServer(chunk_size=3, incremental_streaming_output=incremental) as server:
        engine = SGLangEngine([server.url])
        server.push(ScriptedReply([1, 2, 3, 4, 5, 6, 7]))
        items = [item async for item in engine.stream(request())]
        await engine.aclose()
    assert [item.token_ids for item in items] == [(1, 2, 3), (4, 5, 6), (7,), (1, 2, 3, 4, 5, 6, 7)]


async def test_the_responder_answers_when_the_queue_is_empty() -> None:
    with ScriptedEngineServer(responder=lambda ids, body: ScriptedReply([*reversed(ids)])) as server:
        client = SGLangEngine([server.url])
        result = await client.generate(request())
        await client.aclose()
    assert result.token_ids == (3, 2, 1)


async def test_url_for_names_the_sessions_server_once_placed(server, engine) -> None:
    assert engine.url_for("ab12:0") is None
    server.push(ScriptedReply([4]))
    await engine.generate(request())
    assert engine.url_for("ab12:7") == server.url


GRAMMAR = Constraint(label="tool:required", grammar='start: "<tool_call>" %json {"type": "object"}')
JSON_ONLY = Constraint(label="json_object", grammar='start: %json {"type": "object"}', json_schema={"type": "object"})


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_constraint_reaches_sglang_as_ebnf_or_json_schema(server, engine, streamed: bool) -> None:
    for constraint in (GRAMMAR, JSON_ONLY):
        server.push(ScriptedReply([4]))
        req = msgspec.structs.replace(request(), constraint=constraint)
        if streamed:
            _ = [item async for item in engine.stream(req)]
        else:
            await engine.generate(req)
    grammar, schema = server.constraints[-2:]
    assert grammar == {"ebnf": GRAMMAR.grammar}
    assert schema == {"json_schema": '{"type":"object"}'}  # SGLang takes the schema as JSON text
    assert "ebnf" not in server.requests[-1]["sampling_params"]


async def test_an_unconstrained_request_carries_no_constraint(server, engine) -> None:
    server.push(ScriptedReply([4]))
    await engine.generate(request())
    assert server.constraints == [None]


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_turns_images_reach_sglang_as_image_data_in_order(server, engine, streamed: bool) -> None:
    from tests.images import data_url, png

    red, gif = png(8, 8, (255, 0, 0)), b"GIF89a" + png(4, 4)[6:]
    server.push(ScriptedReply([4]))
    sent = msgspec.structs.replace(request(), images=(red, gif))
    if streamed:
        _ = [item async for item in engine.stream(sent)]
    else:
        await engine.generate(sent)
    body = server.requests[-1]
    assert body["image_data"] == [data_url(red), data_url(gif, "image/gif")]
    assert body["input_ids"] == [1, 2, 3]


async def test_a_turn_without_images_sends_no_image_data(server, engine) -> None:
    server.push(ScriptedReply([4]))
    await engine.generate(request())
    assert "image_data" not in server.requests[-1]
