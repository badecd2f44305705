"""Retries through the real OpenAI SDK: a timed-out request's retry waits for the original and
gets its completion (the engine runs once); an Idempotency-Key replays a recorded completion
and refuses a different body."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
from anthropic import Anthropic
from openai import OpenAI

from rollbus.testing.scripted import ScriptedReply
from tests.e2e.test_openai_session import open_session, reply


def test_the_sdk_retry_of_a_timed_out_request_gets_the_original_completion(stack, engine, tokenizer):
    session = open_session(stack)
    slow = reply(tokenizer, "slow but sure")
    engine.push(ScriptedReply(token_ids=slow.token_ids, logprobs=slow.logprobs, delay_s=2.5))
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=3, timeout=1.0)
    completion = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "slow but sure"
    assert len(engine.requests) == 1  # the retries were answered from the original, not sampled again
    served = [line for line in httpx.get(f"{stack.url}/metrics").text.splitlines()
              if line.startswith("rollbus_http_requests_total") and "chat/completions" in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in served) >= 2  # the 1 s timeout made the SDK retry
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["turns"] == 1 and summary["requests"] == 1


def test_an_idempotency_key_replays_the_recorded_completion(stack, engine, tokenizer):
    session = open_session(stack)
    url = f"{session['base_url']}/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    headers = {"Authorization": f"Bearer {session['api_key']}", "Idempotency-Key": "attempt-1"}
    engine.push(reply(tokenizer, "once"))
    first = httpx.post(url, json=body, headers=headers)
    again = httpx.post(url, json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    one, two = first.json(), again.json()
    assert one["id"] == two["id"] and one["choices"][0]["message"] == two["choices"][0]["message"]
    assert one["usage"] == two["usage"] and len(engine.requests) == 1
    tokens = [t["token"] for t in one["choices"][0]["logprobs"]["content"]]
    assert tokens == [t["token"] for t in two["choices"][0]["logprobs"]["content"]]

    changed = httpx.post(url, json={**body, "temperature": 0.5}, headers=headers)
    assert changed.status_code == 400
    assert changed.json()["error"]["code"] == "idempotency_key_reused"
    assert changed.json()["error"]["param"] == "Idempotency-Key"

    engine.push(reply(tokenizer, "twice"))
    fresh = httpx.post(url, json=body, headers={**headers, "Idempotency-Key": "attempt-2"})
    assert fresh.json()["choices"][0]["message"]["content"] == "twice" and len(engine.requests) == 2


def test_a_streamed_repeat_streams_the_recorded_completion(stack, engine, tokenizer):
    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(reply(tokenizer, "streamed once"))
    kwargs = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
              "extra_headers": {"Idempotency-Key": "stream-1"}}
    first = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**kwargs)
                    if chunk.choices)
    again = list(client.chat.completions.create(**kwargs))
    assert first == "streamed once"
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == first
    assert [c.choices[0].finish_reason for c in again if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert len(engine.requests) == 1  # the repeat was answered from the log


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers 500 to the first POST and ``reply`` after; records headers and bodies."""

    seen: list[tuple[dict[str, str], bytes]]
    reply: bytes

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
        status, payload = (500, b'{"error": {"message": "try again"}}') if len(self.seen) == 1 else (200, self.reply)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def _retried(reply: dict, call) -> list[tuple[dict[str, str], bytes]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "reply": json.dumps(reply).encode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        call(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    return handler.seen


def test_what_the_official_sdks_send_on_a_retry():
    """The contract edge.idempotency relies on: a retry count header, a byte-identical body, no key."""
    completion = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
    message = {"id": "x", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
               "stop_sequence": None, "content": [{"type": "text", "text": "ok"}],
               "usage": {"input_tokens": 1, "output_tokens": 1}}
    openai_seen = _retried(completion, lambda url: OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=1)
                           .chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]))
    anthropic_seen = _retried(message, lambda url: Anthropic(base_url=url, api_key="k", max_retries=1)
                              .messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]))
    for seen in (openai_seen, anthropic_seen):
        assert [headers["x-stainless-retry-count"] for headers, _ in seen] == ["0", "1"]
        assert all("idempotency-key" not in headers for headers, _ in seen)
        assert seen[0][1] == seen[1][1]
