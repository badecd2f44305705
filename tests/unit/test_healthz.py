"""``/healthz``'s answer: 200 only when every part is up; a 503 says whether the stack is starting or which
parts are down, in the shape ``rollbus demo`` and load balancers read (``status`` always there)."""

from __future__ import annotations

import json

from edge.app import health


def test_every_part_up_is_200_ok() -> None:
    body, status = health(True, [])
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_a_stack_still_starting_is_503_starting() -> None:
    body, status = health(False, ["nats"])
    assert status == 503 and json.loads(body) == {"status": "starting"}


def test_parts_that_are_down_are_named() -> None:
    body, status = health(True, ["nats", "materializer"])
    assert status == 503 and json.loads(body) == {"status": "unavailable", "failing": ["nats", "materializer"]}


def test_a_stack_that_is_stopping_says_so_before_anything_else() -> None:
    body, status = health(False, ["nats"], stopping=True)
    assert status == 503 and json.loads(body) == {"status": "stopping"}
    body, status = health(True, [], stopping=True)
    assert status == 503 and json.loads(body) == {"status": "stopping"}
