"""One session per (uid, session_index): a second ``POST /sessions`` with the pair is refused with 409
(its records would be dropped by the materializer, which keys them ``{uid}_{session_index}_...``),
unless its ``metadata.attempt`` is newer than the holder's (verl re-issuing a prompt on resume)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from nats.js import JetStreamContext

from edge.session_index import IndexHolder, KvSessionIndex, index_key
from schemas.errors import Conflict, LogUnavailable
from schemas.log import LogConfig
from tests.e2e.test_openai_session import open_session


def post(stack, **body) -> httpx.Response:
    return httpx.post(f"{stack.url}/sessions", json=body, headers=stack.admin)


def test_a_reused_uid_and_index_is_refused(stack):
    first = open_session(stack, uid="prompt7", session_index=1)
    again = post(stack, uid="prompt7", session_index=1)
    assert again.status_code == 409, again.text
    message = again.json()["error"]["message"]
    assert "'prompt7'" in message and "session_index 1" in message and first["session_id"] in message
    assert again.json()["error"]["code"] == "conflict"
    # Other indices, other uids: free.
    open_session(stack, uid="prompt7", session_index=0)
    open_session(stack, uid="prompt8", session_index=1)
    # A finalized session still holds its pair (its records are under that key).
    assert httpx.post(f"{stack.url}/sessions/{first['session_id']}/finalize", headers=stack.admin).status_code == 200
    assert post(stack, uid="prompt7", session_index=1).status_code == 409


def test_a_newer_attempt_takes_the_pair_over_and_an_older_or_equal_one_is_refused(stack):
    open_session(stack, uid="resumed", session_index=0, metadata={"attempt": 5})
    assert post(stack, uid="resumed", session_index=0, metadata={"attempt": 5}).status_code == 409
    assert post(stack, uid="resumed", session_index=0, metadata={"attempt": 4}).status_code == 409
    assert post(stack, uid="resumed", session_index=0).status_code == 409  # no attempt: attempt 0
    newer = open_session(stack, uid="resumed", session_index=0, metadata={"attempt": 6})
    refused = post(stack, uid="resumed", session_index=0, metadata={"attempt": 5})
    assert refused.status_code == 409 and newer["session_id"] in refused.json()["error"]["message"]
    open_session(stack, uid="resumed", session_index=0, metadata={"attempt": 2**62})


def test_sessions_without_a_uid_are_never_refused(stack):
    ids = {open_session(stack)["session_id"] for _ in range(3)}
    assert len(ids) == 3


def test_concurrent_opens_of_one_pair_open_one_session(stack):
    async def race() -> list[int]:
        async with httpx.AsyncClient() as client:
            responses = await asyncio.gather(*(
                client.post(f"{stack.url}/sessions", json={"uid": "race", "session_index": 3}, headers=stack.admin)
                for _ in range(8)))
        return sorted(r.status_code for r in responses)
    assert asyncio.run(race()) == [201] + [409] * 7


async def test_a_released_claim_frees_the_pair_and_a_released_takeover_restores_the_holder(
        js: JetStreamContext, log_config: LogConfig):
    index = KvSessionIndex.on(js, log_config)
    claim = await index.claim("u", 0, 0, "a" * 32)  # its session's open then failed
    await claim.release()
    held = await index.claim("u", 0, 0, "b" * 32)
    with pytest.raises(Conflict):
        await index.claim("u", 0, 0, "c" * 32)
    takeover = await index.claim("u", 0, 1, "d" * 32)
    await takeover.release()
    kv = await js.key_value(log_config.session_index_bucket)
    entry = await kv.get(index_key("u", 0))
    assert entry.value == b'{"session_id":"' + b"b" * 32 + b'","attempt":0}'
    assert held is not None and IndexHolder(session_id="b" * 32) == IndexHolder(session_id="b" * 32, attempt=0)


def test_a_failed_append_releases_the_pair(stack, monkeypatch: pytest.MonkeyPatch):
    service = stack.stack._service  # the running edge's EdgeService
    real = service._log.append
    calls = 0

    async def failing(session_id: str, events: Any, expected_last: int) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise LogUnavailable("the log is down for this one append")
        return await real(session_id, events, expected_last)
    monkeypatch.setattr(service._log, "append", failing)
    failed = post(stack, uid="flaky", session_index=0)
    assert failed.status_code == 503, failed.text
    assert post(stack, uid="flaky", session_index=0).status_code == 201
    assert post(stack, uid="flaky", session_index=0).status_code == 409
