"""The edge's one error table: every domain error resolves to a status and a type on both wires, the
domain classes carry no HTTP, and what the wires answer is read from the table alone."""

from __future__ import annotations

import inspect
import json
import re

import pytest

import schemas.errors as domain
from edge.http_errors import ERRORS, HttpError, http_error, retry_after_headers
from edge.routes.handling import error_response
from edge.wires import anthropic as anthropic_wire
from edge.wires import openai as openai_wire
from schemas.errors import (
    CapacityExceeded,
    EngineUnavailable,
    LogUnavailable,
    OwnershipLost,
    Refused,
    RevisionConflict,
    RollbusError,
    SessionOwned,
    TemplateNotIncremental,
)

DOMAIN = [cls for _, cls in inspect.getmembers(domain, inspect.isclass)
          if issubclass(cls, RollbusError) and cls.__module__ == domain.__name__]
# Errors a request meets that answer as their nearest ancestor with a row, on purpose. The tree's other classes
# without a row are the parts' own (the codec's probes, the log's NATS replies, the stack, the CLI, the verl side):
# no request meets them, and one that did would answer as RollbusError, a 500.
AS_PARENT = {domain.Unconstrainable, Refused, domain.Dropped, domain.RouteMissing, domain.NotEnded}
OPENAI_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "conflict_error",
                "rate_limit_error", "api_error"}
ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                   "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}
HTTP_WORDS = ("status", "code", "http", "type")


class _ApiError:  # JetStream's API error, as PublishRejected takes it
    code, err_code, description = 400, 10071, "wrong last sequence"


def make(cls: type[RollbusError]) -> RollbusError:
    if cls is SessionOwned:
        return cls("m", retry_after=1.0)
    if cls is domain.EdgeError:
        return domain.EdgeError("m", retriable=False)
    if cls is domain.PublishRejected:
        return domain.PublishRejected(_ApiError())
    return cls("m")


def test_the_table_has_a_row_for_each_error_a_request_meets() -> None:
    assert len(ERRORS) == 28 and set(ERRORS) <= set(DOMAIN)
    for cls in AS_PARENT:
        assert cls not in ERRORS and http_error(make(cls)) is ERRORS[cls.__mro__[1]]


@pytest.mark.parametrize("cls", DOMAIN, ids=lambda cls: cls.__name__)
def test_a_domain_error_carries_no_http(cls: type[RollbusError]) -> None:
    for klass in cls.__mro__[:cls.__mro__.index(RollbusError) + 1]:
        for word in HTTP_WORDS:
            assert word not in vars(klass), f"{klass.__name__}.{word} is the edge's to decide"
    error = make(cls)
    assert not {"status", "code"} & set(vars(error))


@pytest.mark.parametrize("cls", DOMAIN, ids=lambda cls: cls.__name__)
def test_every_error_answers_an_error_status_with_a_type_on_both_wires(cls: type[RollbusError]) -> None:
    error = make(cls)
    row = http_error(error)
    assert 400 <= row.status <= 599 and row.code
    assert row.openai_type in OPENAI_TYPES and row.anthropic_type in ANTHROPIC_TYPES
    openai = json.loads(openai_wire.encode_error(error))["error"]
    assert (openai["type"], openai["code"], openai["message"]) == (row.openai_type, row.code, error.message)
    assert json.loads(anthropic_wire.encode_error(error)) == {
        "type": "error", "error": {"type": row.anthropic_type, "message": error.message}}
    response = error_response(error, "POST /x", openai_wire.encode_error)
    assert response.status_code == row.status and json.loads(bytes(response.body))["error"] == openai


def test_an_error_without_a_row_answers_as_its_nearest_ancestor() -> None:
    assert http_error(Refused("no connection")) is ERRORS[EngineUnavailable]
    assert http_error(RevisionConflict("raced")).code == "conflict"  # a row of its own, with Conflict's code
    assert http_error(TemplateNotIncremental("x")).code == "template_not_incremental"  # a row of its own

    class Unforeseen(OwnershipLost):
        pass

    assert http_error(Unforeseen("x")) is ERRORS[OwnershipLost]
    assert http_error(RollbusError("x")) == HttpError(500, "internal_error", "api_error", "api_error")


def test_the_statuses_the_design_promises() -> None:
    assert [http_error(make(cls)).status for cls in (domain.MalformedRequest, domain.Unauthorized,
            domain.SessionNotFound, domain.SessionClosed, domain.PayloadTooLarge, CapacityExceeded,
            LogUnavailable)] == [400, 401, 404, 409, 413, 429, 503]
    assert http_error(domain.EngineRefused("too long")).status == 400  # not a 5xx the SDKs would retry
    assert http_error(OwnershipLost("x")).status == 409 and http_error(LogUnavailable("x")).status == 503


def test_retry_after_is_answered_only_where_the_table_says_and_the_error_knows() -> None:
    owned = SessionOwned("elsewhere", retry_after=2.2)
    assert retry_after_headers(owned, http_error(owned)) == {"Retry-After": "3", "retry-after-ms": "2200"}
    full = CapacityExceeded("full", retry_after=0.5)
    assert retry_after_headers(full, http_error(full)) == {"Retry-After": "1", "retry-after-ms": "500"}
    assert retry_after_headers(CapacityExceeded("full"), ERRORS[CapacityExceeded]) == {}
    hinted = domain.EngineUnavailable("down")
    hinted.retry_after = 5.0  # a hint the table does not answer for this class
    assert retry_after_headers(hinted, http_error(hinted)) == {}
    down = LogUnavailable("no stream leader")  # the log comes back by itself: a retry in 2 s
    assert retry_after_headers(down, http_error(down)) == {"Retry-After": "2", "retry-after-ms": "2000"}
    assert error_response(full, "POST /x", anthropic_wire.encode_error).headers["retry-after"] == "1"


def test_the_table_drawn_in_the_docstring_is_the_table() -> None:
    import edge.http_errors as module

    drawn = {}
    for line in (module.__doc__ or "").splitlines():
        found = re.match(r"\s+(\w+)\s+(\d{3})\s+(\w+) / (\w+)\s+(\w+)(\s+\+R)?$", line)
        if found:
            name, status, openai_type, code, anthropic_type, retry = found.groups()
            drawn[name] = HttpError(int(status), code, openai_type, anthropic_type, retry is not None)
    assert drawn == {cls.__name__: row for cls, row in ERRORS.items()}
