"""Hostile bytes where a key or a message belongs: a clear 4xx in the route's wire shape, never a 500."""

from __future__ import annotations

import httpx


def _opened(stack) -> dict:
    response = httpx.post(f"{stack.url}/sessions", json={}, headers=stack.admin)
    assert response.status_code == 201, response.text
    return response.json()


def test_a_non_ascii_key_is_refused_as_unauthorized_on_every_route(stack):
    session = _opened(stack)
    url = f"{session['base_url']}/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    good = {"Authorization": f"Bearer {session['api_key']}"}
    httpx.post(url, json=body, headers=good, timeout=30)  # the session now remembers its verified key
    for headers in ({"Authorization": "Bearer ключ".encode()}, {"x-api-key": "clé".encode()},
                    {"Authorization": b"Bearer \xff\xfe"}):
        answer = httpx.post(url, json=body, headers=headers, timeout=30)
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["type"] == "authentication_error"
    admin = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers={"Authorization": "Bearer ñ".encode()})
    assert admin.status_code == 401 and admin.json()["error"]["type"] == "authentication_error"


def test_invalid_utf8_inside_an_openai_message_is_a_400_naming_the_byte(stack):
    session = _opened(stack)
    raw = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "ok"}, ' \
          b'{"role": "user", "content": "\xff\xfe bad"}]}'
    answer = httpx.post(f"{session['base_url']}/chat/completions", content=raw, timeout=30,
                        headers={"Authorization": f"Bearer {session['api_key']}", "Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error", error
    where = raw.index(b"\xff")
    assert error["message"] == f"request body is not valid UTF-8: invalid start byte at byte {where}", error
