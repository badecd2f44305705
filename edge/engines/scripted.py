"""A stand-in SGLang server that replays scripted token sequences, for tests and demos.

It speaks the subset of SGLang's native API that :mod:`edge.engines.sglang` uses:
``POST /generate`` (plain and SSE streaming, cumulative or incremental like SGLang's
``--incremental-streaming-output``), ``GET /health`` and ``POST /abort_request``. Each
``/generate`` takes the next queued :class:`ScriptedReply` (or asks the ``responder``),
then honours ``stop_token_ids`` (cut after the first one, finish ``"stop"``) and
``max_new_tokens`` (truncate, finish ``"length"``). A reply's ``fault`` injects one
failure; with nothing queued and no responder the server answers 500, so a test that
asks for more replies than it scripted fails loudly.

Manual use: ``python -m edge.engines.scripted --port 30000 --replies replies.json``
(a JSON list of replies, e.g. ``[{"token_ids": [1, 2, 3]}]``).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

Fault = Literal[
    "http_500",  # plain-text 500
    "http_503",  # plain-text 503, as SGLang answers while starting or draining
    "malformed_json",  # a body (or SSE event) that is not JSON
    "missing_fields",  # no output_ids (plain) or no meta_info (stream)
    "engine_error",  # SGLang's error shape: 400 {"error": ...} or an SSE error event
    "truncated_stream",  # the stream ends after one event, with no finish reason and no [DONE]
]


class ScriptedReply(msgspec.Struct, frozen=True):
    """What the server answers to one ``/generate``.

    ``logprobs`` default to ``-0.01 * (i + 1)`` at position ``i``; a list whose length
    differs from ``token_ids`` is sent as is (to test the client's count check).
    ``delay_s`` sleeps before answering (to test timeouts); ``chunk_delay_s`` sleeps
    between streamed events (to test clients that leave mid-stream).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    weight_version: str = "scripted"
    delay_s: float = 0.0
    fault: Fault | None = None
    chunk_delay_s: float = 0.0


Responder = Callable[[list[int], dict[str, Any]], ScriptedReply]


class _Plan(msgspec.Struct, frozen=True):
    """A reply fitted to one request: the tokens to send, their log-prob entries, the finish."""

    ids: list[int]
    entries: list[list[Any]]  # [logprob, token_id, null], as SGLang sends them
    finish: dict[str, Any]


def default_logprobs(count: int) -> list[float]:
    return [-0.01 * (i + 1) for i in range(count)]


def _plan(reply: ScriptedReply, sampling: dict[str, Any]) -> _Plan:
    ids, finish = list(reply.token_ids), reply.finish_reason
    stops = set(sampling.get("stop_token_ids") or ())
    cut = next((i + 1 for i, token in enumerate(ids) if token in stops), None)
    if cut is not None:
        ids, finish = ids[:cut], "stop"
    limit = sampling.get("max_new_tokens")
    if limit is not None and len(ids) > limit:
        ids, finish = ids[:limit], "length"
    logprobs = default_logprobs(len(reply.token_ids)) if reply.logprobs is None else reply.logprobs
    keep = max(0, len(ids) + len(logprobs) - len(reply.token_ids))  # a scripted mismatch survives truncation
    entries = [[lp, ids[i] if i < len(ids) else -1, None] for i, lp in enumerate(logprobs[:keep])]
    return _Plan(ids=ids, entries=entries, finish=_finish_json(finish, ids))


def _finish_json(finish: str, ids: list[int]) -> dict[str, Any]:
    if finish == "stop":
        return {"type": "stop", "matched": ids[-1] if ids else None}
    if finish == "length":
        return {"type": "length", "length": len(ids)}
    return {"type": "abort", "message": "aborted by the script"}


def _event(
    body: dict[str, Any], plan: _Plan, reply: ScriptedReply, span: tuple[int, int], final: bool
) -> dict[str, Any]:
    """One SGLang output object for tokens ``[start, end)`` (``start`` = 0: cumulative)."""
    start, end = span
    meta: dict[str, Any] = {
        "id": body.get("rid"),
        "finish_reason": plan.finish if final else None,
        "prompt_tokens": len(body.get("input_ids") or ()),
        "completion_tokens": end,
        "cached_tokens": 0,
        "weight_version": reply.weight_version,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = plan.entries[start:] if final else plan.entries[start:end]
    return {"output_ids": plan.ids[start:end], "meta_info": meta}


class ScriptedEngineServer:
    """Serves scripted replies over real HTTP on 127.0.0.1; usable as a context manager."""

    def __init__(
        self,
        replies: Iterable[ScriptedReply] | None = None,
        responder: Responder | None = None,
        chunk_size: int = 4,
        *,
        incremental_streaming_output: bool = False,
    ) -> None:
        self._replies: deque[ScriptedReply] = deque(replies or ())
        self._responder = responder
        self._chunk_size = max(1, chunk_size)
        self._incremental = incremental_streaming_output
        self.requests: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []  # rids whose stream the client closed before its end
        self.healthy = True
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(
            routes=[
                Route("/generate", self._generate, methods=["POST", "PUT"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/abort_request", self._abort, methods=["POST"]),
            ]
        )

    def push(self, *replies: ScriptedReply) -> None:
        self._replies.extend(replies)

    def _next_reply(self, body: dict[str, Any]) -> ScriptedReply | None:
        if self._replies:
            return self._replies.popleft()
        if self._responder is not None:
            return self._responder(list(body.get("input_ids") or ()), body)
        return None

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        reply = self._next_reply(body)
        if reply is None:
            message = f"scripted engine: no reply queued for rid={body.get('rid')!r} and no responder"
            return PlainTextResponse(message, 500)
        await asyncio.sleep(reply.delay_s)
        if reply.fault in _STATUS_FAULTS:
            status, message = _STATUS_FAULTS[reply.fault]
            return PlainTextResponse(message, status)
        plan = _plan(reply, body.get("sampling_params") or {})
        if body.get("stream"):
            events = self._paced(body, reply, self._sse(body, plan, reply))
            return StreamingResponse(events, media_type="text/event-stream")
        return _plain(_event(body, plan, reply, (0, len(plan.ids)), final=True), reply.fault)

    async def _sse(self, body: dict[str, Any], plan: _Plan, reply: ScriptedReply) -> AsyncIterator[bytes]:
        """SSE events of ``chunk_size`` tokens; a fault strikes after the first event."""
        ends = [*range(self._chunk_size, len(plan.ids), self._chunk_size), len(plan.ids)]
        start = 0
        for end in ends:
            final = end == ends[-1] and reply.fault != "truncated_stream"
            event = _event(body, plan, reply, (start if self._incremental else 0, end), final)
            if reply.fault == "missing_fields":
                del event["meta_info"]
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"
            if reply.fault is not None:
                break
            start = end
        yield _STREAM_TAILS.get(reply.fault, b"data: [DONE]\n\n")

    async def _paced(self, body: dict[str, Any], reply: ScriptedReply,
                     events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``events`` with ``chunk_delay_s`` between them; a stream closed early is noted in ``cancelled``."""
        done = False
        try:
            async for index, event in _enumerate(events):
                if index and reply.chunk_delay_s:
                    await asyncio.sleep(reply.chunk_delay_s)
                yield event
            done = True
        finally:
            if not done:
                self.cancelled.append(str(body.get("rid")))

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _abort(self, request: Request) -> Response:
        body = await request.json()
        self.aborted.append(str(body.get("rid")))
        return Response(status_code=200)

    def start(self) -> str:
        """Serve on a free port in a daemon thread; returns the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted engine server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> ScriptedEngineServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


_STATUS_FAULTS: dict[str | None, tuple[int, str]] = {
    "http_500": (500, "scripted internal error"),
    "http_503": (503, "scripted: server unavailable"),
}
_MALFORMED = b'{"output_ids": [1, 2'
_STREAM_TAILS: dict[str | None, bytes] = {
    "malformed_json": b"data: " + _MALFORMED + b"\n\n",
    "engine_error": b'data: {"error": {"message": "scripted engine error"}}\n\ndata: [DONE]\n\n',
    "truncated_stream": b"",
}


async def _enumerate(items: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    index = 0
    async for item in items:
        yield index, item
        index += 1


def _plain(event: dict[str, Any], fault: Fault | None) -> Response:
    """A non-streamed answer, with the reply's fault (if any) applied."""
    if fault == "engine_error":  # SGLang answers a ValueError this way
        return JSONResponse({"error": {"message": "scripted engine error"}}, 400)
    if fault == "malformed_json":
        return Response(_MALFORMED, media_type="application/json")
    if fault == "missing_fields":
        del event["output_ids"]
    return Response(msgspec.json.encode(event), media_type="application/json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--replies", type=Path, required=True, help="JSON list of ScriptedReply objects")
    parser.add_argument("--chunk-size", type=int, default=4)
    args = parser.parse_args(argv)
    replies = msgspec.json.decode(args.replies.read_bytes(), type=list[ScriptedReply])
    server = ScriptedEngineServer(replies, chunk_size=args.chunk_size)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
