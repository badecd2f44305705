"""``GET /openapi.json`` holds true: every route the app serves is in it with its methods and nothing
else is; it is valid OpenAPI 3.1 (schemathesis' meta-schema check, and every operation loads); and
a request body validates against its schema exactly when the route's msgspec structs decode it: the
requests the e2e tests send, and the fuzz tests' nearly valid bodies drawn by their own strategies
(those the edge refuses by type must fail the schema too)."""

from __future__ import annotations

import json
from typing import Any, cast

import jsonschema
import msgspec
import pytest
import schemathesis
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.app import create_app
from edge.openapi import EXAMPLES_BY_PATH, OPENAPI_VERSION
from edge.routes.admin import AbortBody
from edge.routes.model import ModelRoutes
from edge.routes.reward import RewardBody
from edge.service import EdgeService, OpenSession
from schemas import wire_anthropic as anthropic
from schemas import wire_openai as openai
from schemas import wire_responses as responses
from tests.e2e import fuzz_payloads as fp
from tests.e2e import fuzz_responses as fr

METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
EXAMPLES = settings(max_examples=150, database=None, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def routes() -> ModelRoutes:
    return create_app(cast(EdgeService, None))


@pytest.fixture(scope="module")
def document(routes: ModelRoutes) -> dict[str, Any]:
    client = TestClient(cast(Any, routes), base_url="http://edge.local")
    answer = client.get("/openapi.json")  # no key: the document holds no secret
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json", answer.text
    assert client.get("/openapi.json").content == answer.content
    return cast(dict[str, Any], answer.json())


def served(routes: ModelRoutes) -> set[tuple[str, str]]:
    """(method, path) of every route: FastAPI's, then the model routes' front (POST only)."""
    pairs = set()
    for route in iter_route_contexts(routes.app.routes):  # included routers' routes too
        assert isinstance(route.original_route, APIRoute), f"a route that is not an APIRoute: {route}"
        assert route.path is not None and route.methods, route
        pairs |= {(method.lower(), route.path) for method in route.methods}
    return pairs | {("post", path) for path in routes.paths}


def documented(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method, path) for path, item in document["paths"].items() for method in item if method in METHODS}


def test_every_route_served_is_documented_and_every_documented_one_is_served(routes: ModelRoutes,
                                                                             document: dict[str, Any]) -> None:
    served_pairs, documented_pairs = served(routes), documented(document)
    assert served_pairs - documented_pairs == set(), "served but not in /openapi.json"
    assert documented_pairs - served_pairs == set(), "in /openapi.json but not served"
    # the wires, the admin API, rewards, health and metrics: all there
    for pair in [("post", "/sessions/{session_id}/v1/chat/completions"), ("post", "/sessions/{session_id}/v1/messages"),
                 ("post", "/sessions/{session_id}/v1/messages/count_tokens"),
                 ("post", "/sessions/{session_id}/v1/responses"),
                 ("get", "/sessions/{session_id}/v1/responses/{response_id}"), ("head", "/sessions/{session_id}"),
                 ("get", "/sessions/{session_id}"), ("post", "/sessions"), ("post", "/sessions/{session_id}/finalize"),
                 ("post", "/sessions/{session_id}/abort"), ("post", "/sessions/{session_id}/reward_info"),
                 ("get", "/healthz"), ("get", "/metrics"), ("get", "/openapi.json")]:
        assert pair in documented_pairs, pair


def test_the_document_is_valid_openapi_and_every_operation_loads(document: dict[str, Any]) -> None:
    assert document["openapi"] == OPENAPI_VERSION
    schema = schemathesis.openapi.from_dict(json.loads(json.dumps(document)))
    schema.validate()  # the OpenAPI 3.1 meta-schema
    operations = list(schema.get_all_operations())
    assert all(op.ok() for op in operations)
    assert len(operations) == len(documented(document))
    jsonschema.Draft202012Validator.check_schema({"$defs": document["components"]["schemas"]})


def test_every_request_body_has_its_example_in_the_document(document: dict[str, Any]) -> None:
    for path, item in document["paths"].items():
        for op in item.values():
            if "requestBody" in op:
                assert op["requestBody"]["content"]["application/json"]["example"] == EXAMPLES_BY_PATH[path], path


def test_each_route_names_how_it_authenticates(document: dict[str, Any]) -> None:
    schemes = document["components"]["securitySchemes"]
    assert {(s.get("scheme"), s.get("name")) for s in schemes.values()} == {("bearer", None), (None, "x-api-key")}
    for path, item in document["paths"].items():
        for method, op in item.items():
            names = {name for requirement in op["security"] for name in requirement}
            if path.startswith("/sessions/{session_id}/v1") or path.endswith("/reward_info"):
                assert names == {"sessionBearer", "sessionApiKey"}, (method, path)
                assert "401" in op["responses"], (method, path)
            elif path.startswith("/sessions") and method != "head":
                assert names == {"adminBearer", "adminApiKey"}, (method, path)
                assert "401" in op["responses"], (method, path)
            else:
                assert names == set(), (method, path)


def body_validator(document: dict[str, Any], path: str) -> jsonschema.Draft202012Validator:
    """A validator of ``path``'s POST body, its references resolved within the document."""
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**document, **body})


def decodes(path: str, body: Any) -> bool:
    """Whether the route's msgspec structs take ``body`` (by type: the adapters' later checks aside)."""
    raw = json.dumps(body).encode()
    try:
        if path.endswith("/v1/responses"):  # input items and tools are decoded later, item by item
            request = msgspec.json.decode(raw, type=responses.ResponsesRequest)
            if isinstance(request.input, list):
                [msgspec.json.decode(item, type=responses.InputItem) for item in request.input]
            if request.tools:
                msgspec.json.decode(request.tools, type=list[responses.ToolParam] | None)
        else:
            msgspec.json.decode(raw, type=DECODED[path])
    except msgspec.ValidationError:
        return False
    return True


DECODED: dict[str, Any] = {
    "/sessions/{session_id}/v1/chat/completions": openai.ChatCompletionRequest[openai.MessageIn,
                                                                               list[openai.ToolDef] | None],
    "/sessions/{session_id}/v1/messages": anthropic.MessagesRequest,
    "/sessions/{session_id}/v1/messages/count_tokens": anthropic.CountTokensRequest,
    "/sessions": OpenSession, "/sessions/{session_id}/reward_info": RewardBody,
    "/sessions/{session_id}/abort": AbortBody,
}


def check_agrees(document: dict[str, Any], path: str, body: Any) -> None:
    """The body validates against the document exactly when the route's structs decode it."""
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in body_validator(document, path).iter_errors(body)]
    decoded = decodes(path, body)
    assert (not errors) == decoded, f"{path}: schema errors {errors[:3]}, decoded: {decoded}\n{json.dumps(body)[:2000]}"


@settings(EXAMPLES)
@given(body=fp.openai_request())
def test_chat_completion_requests_validate_as_they_decode(document: dict[str, Any], body: dict[str, Any]) -> None:
    check_agrees(document, "/sessions/{session_id}/v1/chat/completions", body)


@settings(EXAMPLES)
@given(body=fp.anthropic_request())
def test_messages_and_count_tokens_requests_validate_as_they_decode(document: dict[str, Any],
                                                                   body: dict[str, Any]) -> None:
    check_agrees(document, "/sessions/{session_id}/v1/messages", body)
    check_agrees(document, "/sessions/{session_id}/v1/messages/count_tokens",
                 {k: v for k, v in body.items() if k not in ("max_tokens", "stream")})


@settings(EXAMPLES)
@given(body=fr.responses_request())
def test_responses_requests_validate_as_they_decode(document: dict[str, Any], body: dict[str, Any]) -> None:
    check_agrees(document, "/sessions/{session_id}/v1/responses", body)


@settings(EXAMPLES)
@given(body=fp.session_request(), reward=st.floats(-1, 1), reason=fp.text)
def test_session_opens_rewards_and_aborts_validate_as_they_decode(document: dict[str, Any], body: dict[str, Any],
                                                                  reward: float, reason: str) -> None:
    check_agrees(document, "/sessions", body)
    check_agrees(document, "/sessions/{session_id}/reward_info", {"reward_info": {"reward": reward}})
    check_agrees(document, "/sessions/{session_id}/abort", {"reason": reason})


@pytest.mark.parametrize("path", sorted(EXAMPLES_BY_PATH))
def test_valid_requests_of_the_tests_validate(document: dict[str, Any], path: str) -> None:
    """The document's example bodies (requests the e2e tests send, answered 200): they validate and decode."""
    check_agrees(document, path, EXAMPLES_BY_PATH[path])
    assert decodes(path, EXAMPLES_BY_PATH[path])


@pytest.mark.parametrize(("path", "body"), [
    ("/sessions/{session_id}/v1/chat/completions", {"messages": "hi"}),
    ("/sessions/{session_id}/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("/sessions/{session_id}/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),  # no max_tokens
    ("/sessions/{session_id}/v1/responses", {"input": [{"type": "message", "role": "user", "content": 3}]}),
    ("/sessions/{session_id}/v1/responses", {"input": "hi", "tools": {"type": "function"}}),
    ("/sessions", {"session_index": "0"}),
    ("/sessions/{session_id}/reward_info", {"reward": 1.0}),
    ("/sessions/{session_id}/abort", {"reason": None}),
])
def test_bodies_the_edge_refuses_by_type_do_not_validate(document: dict[str, Any], path: str, body: Any) -> None:
    assert not body_validator(document, path).is_valid(body)
