"""The bounds a request's values must keep, pure: nesting, integer widths, sampling ranges, the
session opener's fields, reward info, OpenAI's response_format, and the edge's answer to routes,
methods and validation it does not serve (in the wire's error shape, never a redirect)."""

from __future__ import annotations

import json
from typing import Any, cast

import msgspec
import pytest
from fastapi.testclient import TestClient

from edge.app import create_app
from edge.service import EdgeService, OpenSession, _check_open_request
from edge.wires import anthropic as anthropic_wire
from edge.wires import openai as openai_wire
from edge.wires.strict import MAX_STOP, MAX_STOP_CHARS, check_json_text, check_sampling, decode_strict
from reward.intake import parse_reward_info
from schemas.errors import MalformedRequest
from schemas.events import SamplingDefaults
from schemas.values import INT32_MAX, INT64_MAX, INT64_MIN, MAX_DEPTH, check_free_form


def nested(levels: int, leaf: Any = 1) -> Any:
    """``leaf`` inside ``levels`` lists (``levels`` levels of nesting)."""
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def refused(call: Any, *args: Any, **kwargs: Any) -> MalformedRequest:
    with pytest.raises(MalformedRequest) as caught:
        call(*args, **kwargs)
    return caught.value


# --- nesting -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [1000, 5000, 200_000])
def test_a_body_nested_past_the_decoders_recursion_is_a_400(levels: int) -> None:
    deep = b"[" * levels + b"]" * levels
    kinds = (OpenSession, openai_wire.LazyRequest, anthropic_wire.w.MessagesRequest,
             anthropic_wire.w.LazyMessagesRequest, dict[str, Any], Any)
    for kind in kinds:  # an unknown field is skipped, and skipping recurses too
        assert refused(decode_strict, b'{"x": ' + deep + b"}", kind).message == "request body is nested too deeply"
        refused(decode_strict, deep, kind)  # a wrong type, or too deep
        refused(decode_strict, b'{"messages": [{"role": "user", "content": ' + deep + b"}]}", kind)


def test_both_wires_refuse_deep_bodies_and_deep_messages_with_a_400() -> None:
    deep = b"[" * 2000 + b"]" * 2000
    message = b'{"role": "user", "content": "hi", "x": ' + deep + b"}"
    for body in (b'{"model": "m", "max_tokens": 4, "messages": [' + message + b"]}",
                 b'{"model": "m", "max_tokens": 4, "x": ' + deep + b', "messages": [{"role": "user", "content": ""}]}'):
        refused(openai_wire.decode_request, body)
        refused(anthropic_wire.decode_request, body)


def test_free_form_values_nest_at_most_max_depth_levels() -> None:
    check_free_form(nested(MAX_DEPTH), "metadata.x")
    check_free_form({"a": nested(MAX_DEPTH - 1), "b": [{"c": nested(MAX_DEPTH - 3)}]}, "metadata.x")
    for value in (nested(MAX_DEPTH + 1), {"a": nested(MAX_DEPTH)}, [1, {"b": [{"c": nested(MAX_DEPTH - 3)}]}],
                  nested(100_000)):
        error = refused(check_free_form, value, "metadata.x")
        assert error.param == "metadata.x" and str(MAX_DEPTH) in error.message


def test_free_form_integers_fit_in_64_bits_and_the_refusal_names_their_path() -> None:
    check_free_form({"a": [INT64_MIN, INT64_MAX, 1.5e308, True, None, "9" * 400]}, "metadata.x")
    for value, path in ((INT64_MAX + 1, "metadata.x"), (INT64_MIN - 1, "metadata.x"),
                        ({"a": [1, {"b": 10**400}]}, "metadata.x.a[1].b"), ([[0], [1, 2**64]], "metadata.x[1][1]")):
        error = refused(check_free_form, value, "metadata.x")
        assert error.param == path and "64 bits" in error.message
    check_free_form({"a": 10**400}, "tools[0].function.parameters", ints=False)  # JSON text only: any integer


def test_json_text_is_parsed_only_when_it_could_nest_too_deeply() -> None:
    check_json_text('{"a": [1, 2, {"b": 3}]}', "arguments")
    check_json_text("not JSON at all " + "[" * 1000, "arguments")  # text as written, whatever its brackets
    check_json_text(json.dumps({"k": [[i] for i in range(1000)]}), "arguments")  # many brackets, shallow
    check_json_text(json.dumps(nested(MAX_DEPTH)), "arguments")
    check_json_text(json.dumps({"a": nested(MAX_DEPTH - 1), "b": list(range(100))}) + " " + "{" * 100, "arguments")
    for text in (json.dumps(nested(MAX_DEPTH + 1)), "[" * 5000 + "]" * 5000):
        assert refused(check_json_text, text, "arguments").param == "arguments"


# --- sampling ------------------------------------------------------------------------------------------------


def _sampling(**values: Any) -> None:
    fields = {"temperature": None, "top_p": None, "top_k": None, "max_tokens": None, "stop": None}
    check_sampling(**{**fields, **values})  # type: ignore[arg-type]


@pytest.mark.parametrize("values", [
    {}, {"max_tokens": 1}, {"max_tokens": INT32_MAX}, {"temperature": 0.0}, {"temperature": 100.0},
    {"top_p": 1e-9}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 1}, {"top_k": INT32_MAX}, {"stop": "x"},
    {"stop": []}, {"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP},
])
def test_sampling_in_range_is_accepted(values: dict[str, Any]) -> None:
    _sampling(**values)


@pytest.mark.parametrize(("values", "param"), [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": INT32_MAX + 1}, "max_tokens"), ({"max_tokens": 10**300}, "max_tokens"),
    ({"temperature": -1e-9}, "temperature"),
    ({"temperature": 100.5}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.0001}, "top_p"),
    ({"top_p": float("nan")}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"top_k": 2**64}, "top_k"), ({"stop": ""}, "stop"), ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"stop": ["x"] * (MAX_STOP + 1)}, "stop"), ({"stop": ["a", ""]}, "stop[1]"),
])
def test_sampling_out_of_range_is_refused_naming_the_field(values: dict[str, Any], param: str) -> None:
    assert refused(_sampling, **values).param == param


# --- the OpenAI wire -----------------------------------------------------------------------------------------


def _openai(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_openai_max_tokens_zero_is_refused_not_read_as_unset() -> None:
    assert refused(openai_wire.decode_request, _openai(max_tokens=0)).param == "max_tokens"
    assert refused(openai_wire.decode_request, _openai(max_completion_tokens=0, max_tokens=9)).param == \
        "max_completion_tokens"
    assert openai_wire.decode_request(_openai(max_completion_tokens=5, max_tokens=9)).sampling.max_tokens == 5
    assert openai_wire.decode_request(_openai(max_tokens=9)).sampling.max_tokens == 9
    assert openai_wire.decode_request(_openai()).sampling.max_tokens is None
    assert openai_wire.decode_request(_openai(stop="x", top_k=-1)).sampling.stop == ("x",)


def test_openai_response_format_is_text_or_json_and_anything_else_is_refused() -> None:
    assert openai_wire.decode_request(_openai(response_format={"type": "text"})).output_format is None
    assert openai_wire.decode_request(_openai(response_format=None)).output_format is None
    assert openai_wire.decode_request(_openai(response_format={"type": "json_object"})).output_format.type == \
        "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    decoded = openai_wire.decode_request(_openai(response_format={"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": True}})).output_format
    assert (decoded.type, decoded.schema, decoded.name, decoded.strict) == ("json_schema", schema, "out", True)
    for bad, param in (({"type": "json_schema", "json_schema": {}}, "response_format.json_schema"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "xml"}, "response_format.type"), ("text", "response_format"),
                       ([], "response_format"), ({}, "response_format")):
        assert refused(openai_wire.decode_request, _openai(response_format=bad)).param == param
    deep = {"type": "json_schema", "json_schema": {"name": "d", "schema": {"x": nested(MAX_DEPTH + 1)}}}
    assert refused(openai_wire.decode_request, _openai(response_format=deep)).param == \
        "response_format.json_schema.schema"


def test_openai_deep_tool_parameters_and_arguments_are_refused_naming_them() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": nested(MAX_DEPTH + 1)}}}]
    assert refused(openai_wire.decode_request, _openai(tools=tools)).param == "tools[0].function.parameters"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "r"}]
    assert refused(openai_wire.decode_request, _openai(messages=messages)).param == \
        "messages[1].tool_calls[0].function.arguments"


# --- the Anthropic wire (both of its decodings: see tests/unit/test_anthropic_incremental.py) ---------------


@pytest.mark.parametrize(("block", "field"), [
    ({"type": "tool_use", "name": "f", "input": {}}, "messages[1].content[0].id"),
    ({"type": "tool_use", "id": "", "name": "f", "input": {}}, "messages[1].content[0].id"),
    ({"type": "tool_use", "id": "t", "input": {}}, "messages[1].content[0].name"),
    ({"type": "tool_use", "id": "t", "name": "f", "input": {"x": nested(MAX_DEPTH + 1)}},
     "messages[1].content[0].input"),
])
def test_anthropic_tool_use_blocks_need_their_id_and_name(block: dict[str, Any], field: str) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": [block]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]
    raw = json.dumps({"max_tokens": 8, "messages": messages}).encode()
    assert refused(anthropic_wire.decode_request, raw).param == refused(anthropic_wire._decode_by_value, raw).param \
        == field


@pytest.mark.parametrize("result", [{"type": "tool_result", "content": "r"},
                                    {"type": "tool_result", "tool_use_id": "", "content": "r"}])
def test_anthropic_tool_results_need_their_tool_use_id(result: dict[str, Any]) -> None:
    raw = json.dumps({"max_tokens": 8, "messages": [{"role": "user", "content": [result]}]}).encode()
    error = refused(anthropic_wire.decode_request, raw)
    assert error.param == "messages[0].content[0].tool_use_id" and "tool_use_id" in error.message


# --- POST /sessions ------------------------------------------------------------------------------------------


def _open(**spec: Any) -> str:
    return _check_open_request(msgspec.convert(spec, OpenSession))


def test_a_session_spec_within_what_the_records_hold_is_accepted() -> None:
    assert _open(uid="u", session_index=INT32_MAX, metadata={
        "rollout_n": 1, "global_steps": INT64_MIN, "attempt": INT64_MAX, "tq_partition": "val",
        "prompt_status_rule": "any_success", "trajectory_selection": "all", "mask_unfinished_episode": False,
        "agent_name": 3, "extra_info": {"deep": nested(MAX_DEPTH - 1), "n": INT64_MAX}},
        sampling={"max_tokens": 1, "temperature": 0, "top_p": 1, "top_k": -1, "stop": ["a"]}) == "u"
    assert len(_open()) == 32  # a uid drawn when none is given


@pytest.mark.parametrize(("spec", "param"), [
    ({"session_index": INT32_MAX + 1}, "session_index"),
    ({"session_index": -1}, "session_index"),
    ({"metadata": {"rollout_n": 0}}, "metadata.rollout_n"),
    ({"metadata": {"rollout_n": 1.0}}, "metadata.rollout_n"),
    ({"metadata": {"global_steps": INT64_MAX + 1}}, "metadata.global_steps"),
    ({"metadata": {"global_steps": False}}, "metadata.global_steps"),
    ({"metadata": {"attempt": None}}, "metadata.attempt"),
    ({"metadata": {"tq_partition": ["train"]}}, "metadata.tq_partition"),
    ({"metadata": {"prompt_status_rule": "any"}}, "metadata.prompt_status_rule"),
    ({"metadata": {"trajectory_selection": ["all"]}}, "metadata.trajectory_selection"),
    ({"metadata": {"mask_unfinished_episode": 0}}, "metadata.mask_unfinished_episode"),
    ({"metadata": {"reward_model": {"ground_truth": [2**64]}}}, "metadata.reward_model.ground_truth[0]"),
    ({"metadata": {"raw_prompt": nested(MAX_DEPTH + 1)}}, "metadata.raw_prompt"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
    ({"sampling": {"top_k": 2**64}}, "sampling.top_k"),
    ({"sampling": {"temperature": 101}}, "sampling.temperature"),
    ({"sampling": {"stop": [""]}}, "sampling.stop[0]"),
])
def test_a_session_spec_the_records_cannot_hold_is_refused_naming_the_field(spec: dict[str, Any],
                                                                           param: str) -> None:
    assert refused(_open, **spec).param == param


def test_session_sampling_defaults_are_checked_as_a_requests_are() -> None:
    defaults = msgspec.convert({"max_tokens": -5}, SamplingDefaults)
    assert refused(_check_open_request, OpenSession(sampling=defaults)).param == "sampling.max_tokens"


# --- reward info ---------------------------------------------------------------------------------------------


def test_a_reward_past_64_bits_is_refused_not_an_overflow() -> None:
    huge = msgspec.json.decode(b'{"reward": 1' + b"0" * 400 + b"}")
    assert refused(parse_reward_info, huge).param == "reward_info.reward"
    assert refused(parse_reward_info, {"reward": -(2**63) - 1}).param == "reward_info.reward"
    assert parse_reward_info({"reward": INT64_MAX}).reward == float(INT64_MAX)
    assert refused(parse_reward_info, {"acc": [1, 2**64]}).param == "reward_info.acc[1]"
    assert refused(parse_reward_info, {"trace": nested(MAX_DEPTH + 1)}).param == "reward_info.trace"
    assert parse_reward_info({"reward": 0.5, "acc": nested(MAX_DEPTH)}).extra["acc"] == nested(MAX_DEPTH)


# --- routes the edge does not serve --------------------------------------------------------------------------


@pytest.fixture
def client() -> TestClient:
    routes = create_app(cast(EdgeService, None))

    @routes.app.get("/typed/{n}")
    async def typed(n: int) -> dict[str, int]:
        return {"n": n}

    @routes.app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    return TestClient(cast(Any, routes), base_url="http://edge.local", raise_server_exceptions=False)


def _openai_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return cast(dict[str, Any], body["error"])


def _anthropic_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return cast(dict[str, Any], body["error"])


def test_unknown_paths_and_methods_answer_in_the_wire_shape(client: TestClient) -> None:
    sid = "0" * 32
    for path in ("/nope", "/sessions/", f"/sessions/{sid}/v1/models", f"/sessions/{sid}/v1/chat/completions/x"):
        answer = client.get(path)
        assert answer.status_code == 404 and _openai_shape(answer.json())["code"] == "not_found_error", path
    for path in (f"/sessions/{sid}/v1/messages/batches", f"/sessions/{sid}/v1/messages/"):
        answer = client.post(path)
        assert answer.status_code == 404 and _anthropic_shape(answer.json())["type"] == "not_found_error", path
    answer = client.get("/sessions")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert _openai_shape(answer.json())["code"] == "method_not_allowed"
    for path, shape in ((f"/sessions/{sid}/v1/chat/completions", _openai_shape),
                        (f"/sessions/{sid}/v1/messages", _anthropic_shape)):
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            answer = client.request(method, path)
            assert answer.status_code == 405 and answer.headers["allow"] == "POST", (method, path)
            assert "POST" in shape(answer.json())["message"]


def test_a_request_failing_validation_is_a_400_in_the_wire_shape(client: TestClient) -> None:
    answer = client.get("/typed/x")
    assert answer.status_code == 400
    error = _openai_shape(answer.json())
    assert error["type"] == "invalid_request_error" and "n" in error["message"]


def test_an_unexpected_failure_is_a_500_in_the_wire_shape(client: TestClient) -> None:
    answer = client.get("/bug")
    assert answer.status_code == 500 and _openai_shape(answer.json())["code"] == "internal_error"


def test_no_redirect_is_built_from_the_requests_host(client: TestClient) -> None:
    for path in ("/sessions/", "/healthz/", "/metrics/", "/sessions/x/finalize/"):
        for method in ("GET", "POST"):
            answer = client.request(method, path, headers={"Host": "evil.example"}, follow_redirects=False)
            assert answer.status_code in (404, 405) and "location" not in answer.headers, (method, path)
            _openai_shape(answer.json())
