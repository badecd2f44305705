"""Authentication first, over HTTP (the real edge on granian, real JetStream, a scripted SGLang engine):
a model or reward request without its session's key gets one 401, whatever its session and body, before
any of the body is read (no ``100 Continue``); a body must arrive at a minimum rate; compressed bodies
are decoded, with a bound on what they inflate to."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Callable

import brotli
import httpx
import pytest
import zstandard
from nats.aio.client import Client

from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from tests.integration.edge_http import ServedEdge, chat_body, served_edge

MAX_BODY = 1 << 20
BASE_S, MIN_RATE = 1.0, 2000.0  # a body of N bytes has 1 + N / 2000 seconds to arrive here
ROUTES = ("v1/chat/completions", "v1/messages", "reward_info")


@pytest.fixture
async def edge(nc: Client, log_config: LogConfig, engine: ScriptedEngineServer) -> AsyncIterator[ServedEdge]:
    async with served_edge(nc, log_config, engine.url, max_request_bytes=MAX_BODY, body_base_s=BASE_S,
                           body_min_rate=MIN_RATE) as served:
        yield served


def good_body(route: str) -> bytes:
    if route == "reward_info":
        return b'{"reward_info": {"reward": 1.0}}'
    if route == "v1/messages":
        return b'{"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}'
    return chat_body()


async def test_every_request_without_the_key_is_the_same_401_whatever_its_session_or_body(edge: ServedEdge) -> None:
    live, finalized, aborted, other = [await edge.open_session() for _ in range(4)]
    await edge.finalize(finalized["session_id"])
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
        done = await client.post(f"/sessions/{aborted['session_id']}/abort",
                                 headers={"Authorization": "Bearer edge-http-admin"})
        assert done.status_code == 200
        sessions = [live["session_id"], finalized["session_id"], aborted["session_id"], "f" * 32, "not-an-id!",
                    "x" * 300]
        keys: list[dict[str, str]] = [{}, {"Authorization": "Bearer rb-wrong"}, {"x-api-key": "rb-wrong"},
                                      {"Authorization": f"Basic {live['api_key']}"},
                                      {"Authorization": f"Bearer {other['api_key']}"}]  # another session's
        bodies = [b"{not json", b"", b"\x00" * 5000]
        for route in ROUTES:
            answers = set()
            for session in sessions:
                for key in keys:
                    for body in (good_body(route), *bodies):
                        reply = await client.post(f"/sessions/{session}/{route}", content=body,
                                                  headers={"Content-Type": "application/json", "Content-Encoding":
                                                           "bogus" if body == b"" else "identity", **key})
                        answers.add((reply.status_code, reply.content))
            assert len(answers) == 1, (route, answers)
            ((status, content),) = answers
            assert status == 401 and b"authentication_error" in content, content
        # with the key: a closed session is 409, a bad body 400, as before
        for route in ROUTES:
            reply = await client.post(f"/sessions/{finalized['session_id']}/{route}", content=good_body(route),
                                      headers={"Authorization": f"Bearer {finalized['api_key']}"})
            assert reply.status_code == 409, reply.text
            reply = await client.post(f"/sessions/{live['session_id']}/{route}", content=b"{not json",
                                      headers={"x-api-key": live["api_key"]})
            assert reply.status_code == 400, reply.text


def head(path: str, key: str | None, length: int, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: edge", "Content-Type: application/json", f"Content-Length: {length}",
             *([f"Authorization: Bearer {key}"] if key else []), *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_expect_100_continue_gets_no_continue_without_the_key(edge: ServedEdge) -> None:
    session = await edge.open_session()
    path = f"/sessions/{session['session_id']}/v1/chat/completions"
    for key in (None, "rb-wrong"):
        out = await edge.raw(head(path, key, 1_000_000, "Expect: 100-continue"), timeout=5)  # and no body, ever
        assert out.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in out, out[:200]  # then closed
    body = chat_body()
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        writer.write(head(path, session["api_key"], len(body), "Expect: 100-continue", "Connection: close"))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        out = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    assert out.startswith(b"HTTP/1.1 200 ") and b'"assistant"' in out, out[:300]


async def test_a_body_that_trickles_is_refused_at_its_deadline(edge: ServedEdge) -> None:
    session = await edge.open_session()
    path = f"/sessions/{session['session_id']}/v1/chat/completions"
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def trickle() -> None:
        writer.write(head(path, session["api_key"], 2000))  # 2 s allowed; a byte every 0.1 s needs 200 s
        for _ in range(200):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)

    sending = asyncio.ensure_future(trickle())
    try:
        out = await asyncio.wait_for(reader.read(-1), 15)
    finally:
        sending.cancel()
        writer.close()
    assert out.startswith(b"HTTP/1.1 400 ") and b"too slowly" in out, out[:300]
    assert 1.5 < loop.time() - started < 8


COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
    "br": brotli.compress,
}


async def test_compressed_bodies_are_decoded_on_the_model_and_reward_routes(edge: ServedEdge) -> None:
    session = await edge.open_session()
    base, key = session["base_url"], {"Authorization": f"Bearer {session['api_key']}"}
    messages = [{"role": "user", "content": "a long question " * 200}]
    async with httpx.AsyncClient(timeout=20) as client:
        for coding, compress in COMPRESS.items():
            body = chat_body(messages=messages)
            reply = await client.post(f"{base}/chat/completions", content=compress(body),
                                      headers={**key, "Content-Encoding": coding, "Content-Type": "application/json"})
            assert reply.status_code == 200, (coding, reply.text)
            messages = [*messages, reply.json()["choices"][0]["message"], {"role": "user", "content": coding}]
        anthropic = b'{"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}'
        reply = await client.post(f"{session['anthropic_base_url']}/v1/messages", content=brotli.compress(anthropic),
                                  headers={"x-api-key": session["api_key"], "Content-Encoding": "br"})
        assert reply.status_code == 200 and reply.json()["type"] == "message", reply.text
        reply = await client.post(session["reward_url"], content=gzip.compress(b'{"reward_info": {"reward": 0.5}}'),
                                  headers={**key, "Content-Encoding": "gzip"})
        assert reply.status_code == 200, reply.text
        summary = await client.get(f"{edge.url}/sessions/{session['session_id']}",
                                   headers={"Authorization": "Bearer edge-http-admin"})
    got = summary.json()
    assert (got["turns"], got["chains"][0]["turns"], got["reward"]) == (4, 3, 0.5)  # the chat turns: one chain


async def test_a_bomb_is_413_and_an_unknown_or_corrupt_coding_400(edge: ServedEdge) -> None:
    session = await edge.open_session()
    url, key = f"{session['base_url']}/chat/completions", {"Authorization": f"Bearer {session['api_key']}"}
    bombs = {"gzip": gzip.compress(b"\0" * (16 * MAX_BODY), 1), "br": brotli.compress(b"\0" * (16 * MAX_BODY), 1),
             "zstd": zstandard.ZstdCompressor().compress(b"\0" * (16 * MAX_BODY))}
    async with httpx.AsyncClient(timeout=20) as client:
        for coding, bomb in bombs.items():
            assert len(bomb) < MAX_BODY
            reply = await client.post(url, content=bomb, headers={**key, "Content-Encoding": coding})
            assert reply.status_code == 413 and "inflates past" in reply.text, (coding, reply.text)
        for coding, body in (("deflate", chat_body()), ("gzip", chat_body()), ("zstd", gzip.compress(chat_body()))):
            reply = await client.post(url, content=body, headers={**key, "Content-Encoding": coding})
            assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", reply.text
        reply = await client.post(url, content=chat_body(), headers=key)
    assert reply.status_code == 200  # the session is served as before
