"""Stand-in engine servers that replay scripted token sequences, for tests and demos.

:class:`ScriptedServer` holds what every protocol shares: a queue of
:class:`ScriptedReply` (or a ``responder``), fault injection, the log of requests and
aborts, a health switch, real HTTP on 127.0.0.1 in a daemon thread, and
:meth:`~ScriptedServer.down` / :meth:`~ScriptedServer.up` to stop and restart it on
the same port. A subclass renders one protocol's bodies:

* :class:`ScriptedEngineServer` speaks SGLang's native API: ``POST /generate`` (plain
  and SSE, cumulative or incremental like SGLang's ``--incremental-streaming-output``),
  ``GET /health``, ``POST /abort_request``;
* :class:`rollbus.testing.scripted_vllm.ScriptedVLLMServer` speaks vLLM's
  ``/inference/v1/generate`` and ``/v1/completions``.

Each request's constraint (SGLang's ``json_schema`` / ``ebnf`` / ``regex`` sampling parameters,
vLLM's ``structured_outputs``) is recorded in :attr:`~ScriptedServer.constraints`; with a
``checker`` (:func:`rollbus.testing.constraints.grammar_checker`) a scripted reply the constraint
does not admit is refused (400), as a real engine could never have sampled it.

Each generation takes the next queued reply, then honours the request's stop token ids
(cut after the first one, finish ``"stop"``) and its token limit (truncate, finish
``"length"``). A reply's ``fault`` injects one failure; with nothing queued and no
responder the server answers 500, so a test that asks for more replies than it
scripted fails loudly.

Manual use: ``python -m rollbus.testing --protocol sglang --port 30000 --replies
replies.json`` (a JSON list of replies, e.g. ``[{"token_ids": [1, 2, 3]}]``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
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
    "http_503",  # plain-text 503, as servers answer while starting or draining
    "malformed_json",  # a body (or SSE event) that is not JSON
    "missing_fields",  # the protocol's token ids (plain) or metadata (stream) left out
    "engine_error",  # the protocol's error body: a 500 JSON error, or an SSE error event after one event
    "refused",  # the server refuses the input (e.g. too long): its 400 error body (SGLang streaming: a first
    # SSE error event, as SGLang answers a ValueError in a stream); the message is ``error_message``
    "truncated_stream",  # the stream ends after one event, with no finish reason and no [DONE]
]
Finish = Literal["stop", "length", "abort"]


class ScriptedReply(msgspec.Struct, frozen=True):
    """What the server answers to one generation request.

    ``logprobs`` default to ``-0.01 * (i + 1)`` at position ``i``; a list whose length
    differs from ``token_ids`` is sent as is (to test the client's count check).
    ``delay_s`` sleeps before answering (to test timeouts and cancellation);
    ``chunk_delay_s`` sleeps between streamed events (to test closing a stream early).
    ``trickle_s``: a plain reply's headers go out at once and its body one byte every so many
    seconds (an engine that answers and then stalls; a stream trickles with ``chunk_delay_s``).
    ``error_message``: the message of the ``engine_error`` and ``refused`` faults' error bodies.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: Finish = "stop"
    weight_version: str = "scripted"
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    trickle_s: float = 0.0
    fault: Fault | None = None
    error_message: str | None = None


Responder = Callable[[list[int], dict[str, Any]], ScriptedReply]
Checker = Callable[[dict[str, Any], list[int]], str | None]
"""(the request's constraint, the reply's token ids) -> why the constraint does not admit them, or None."""


class Plan(msgspec.Struct, frozen=True):
    """A reply fitted to one request: the tokens to send, their (log prob, token id) entries, the finish."""

    ids: list[int]
    entries: list[tuple[float, int]]
    finish: Finish


def default_logprobs(count: int) -> list[float]:
    return [-0.01 * (i + 1) for i in range(count)]


def make_plan(reply: ScriptedReply, limit: int | None, stop_token_ids: Iterable[int]) -> Plan:
    ids, finish = list(reply.token_ids), reply.finish_reason
    stops = set(stop_token_ids)
    cut = next((i + 1 for i, token in enumerate(ids) if token in stops), None)
    if cut is not None:
        ids, finish = ids[:cut], "stop"
    if limit is not None and len(ids) > limit:
        ids, finish = ids[:limit], "length"
    logprobs = default_logprobs(len(reply.token_ids)) if reply.logprobs is None else reply.logprobs
    keep = max(0, len(ids) + len(logprobs) - len(reply.token_ids))  # a scripted mismatch survives truncation
    entries = [(lp, ids[i] if i < len(ids) else -1) for i, lp in enumerate(logprobs[:keep])]
    return Plan(ids=ids, entries=entries, finish=finish)


def spans(count: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of the streamed events (at least one, even for no tokens)."""
    ends = [*range(size, count, size), count]
    return list(zip([0, *ends[:-1]], ends, strict=True))


MALFORMED = b'{"output_ids": [1, 2'
_STATUS_FAULTS: dict[str | None, tuple[int, str]] = {
    "http_500": (500, "scripted internal error"),
    "http_503": (503, "scripted: server unavailable"),
}


class ScriptedServer:
    """Serves scripted replies over real HTTP on 127.0.0.1; usable as a context manager."""

    protocol = "none"

    def __init__(
        self, replies: Iterable[ScriptedReply] | None = None, responder: Responder | None = None, chunk_size: int = 4,
        keep_requests: int | None = None, checker: Checker | None = None,
    ) -> None:
        """``keep_requests``: remember only the last so many requests in :attr:`requests` (a long
        session's requests carry its whole context each). ``checker``: refuse replies outside the
        request's constraint."""
        self._replies: deque[ScriptedReply] = deque(replies or ())
        self._responder = responder
        self._chunk_size = max(1, chunk_size)
        self.requests: list[dict[str, Any]] | deque[dict[str, Any]] = \
            [] if keep_requests is None else deque(maxlen=keep_requests)
        self.served = 0  # requests received
        self.constraints: list[dict[str, Any] | None] = []  # each request's constraint parameters (None: none)
        self._checker = checker
        self.aborted: list[str] = []
        self.cancelled: list[str] = []  # request ids whose stream the client closed before its end
        self.healthy = True
        self.url = ""
        self._port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(routes=[Route("/health", self._health, methods=["GET"]), *self._routes()])

    # --- what a protocol provides ---------------------------------------------------

    def _routes(self) -> list[Route]:
        raise NotImplementedError

    def _input_ids(self, body: dict[str, Any]) -> list[int]:
        raise NotImplementedError

    def _limits(self, body: dict[str, Any]) -> tuple[int | None, list[int]]:
        """The request's token limit and stop token ids."""
        raise NotImplementedError

    def _event(self, body: dict[str, Any], plan: Plan, reply: ScriptedReply, span: tuple[int, int],
               final: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _strip(self, event: dict[str, Any], *, streamed: bool) -> None:
        """Apply ``missing_fields`` to an event."""
        raise NotImplementedError

    def _error(self, message: str | None = None, status: int = 500) -> dict[str, Any]:
        """The protocol's error object (``engine_error``, ``refused``)."""
        raise NotImplementedError

    def _constraint(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The request's constraint parameters, as the protocol sends them (None: unconstrained)."""
        raise NotImplementedError

    def _refusal(self, body: dict[str, Any], message: str) -> Response:
        """How the protocol refuses an input (``refused``): a 400 error body."""
        return JSONResponse(self._error(message, 400), 400)

    def _stream_end(self, body: dict[str, Any], plan: Plan) -> bytes:
        return b"data: [DONE]\n\n"

    # --- shared behaviour ------------------------------------------------------------

    def push(self, *replies: ScriptedReply) -> None:
        self._replies.extend(replies)

    def _next_reply(self, body: dict[str, Any]) -> ScriptedReply | None:
        if self._replies:
            return self._replies.popleft()
        if self._responder is not None:
            return self._responder(self._input_ids(body), body)
        return None

    async def _generate(self, request: Request) -> Response:
        body = msgspec.json.decode(await request.body())
        self.requests.append(body)
        constraint = self._constraint(body)
        self.constraints.append(constraint)
        self.served += 1
        reply = self._next_reply(body)
        if reply is None:
            return PlainTextResponse(f"scripted engine: no reply queued for request {self.served}", 500)
        await asyncio.sleep(reply.delay_s)
        if reply.fault in _STATUS_FAULTS:
            status, message = _STATUS_FAULTS[reply.fault]
            return PlainTextResponse(message, status)
        if reply.fault == "refused":
            return self._refusal(body, reply.error_message or "scripted: the input is refused")
        plan = make_plan(reply, *self._limits(body))
        violation = self._checker(constraint, plan.ids) if self._checker and constraint else None
        if violation is not None:
            return self._refusal(body, f"scripted: the reply is outside the request's constraint: {violation}")
        if body.get("stream"):
            return StreamingResponse(self._sse(body, plan, reply), media_type="text/event-stream")
        return self._plain(self._event(body, plan, reply, (0, len(plan.ids)), True), reply)

    def _plain(self, event: dict[str, Any], reply: ScriptedReply) -> Response:
        fault = reply.fault
        if fault == "engine_error":
            return JSONResponse(self._error(reply.error_message), 500)
        if fault == "malformed_json":
            return Response(MALFORMED, media_type="application/json")
        if fault == "missing_fields":
            self._strip(event, streamed=False)
        if reply.trickle_s > 0:
            return StreamingResponse(_trickle(msgspec.json.encode(event), reply.trickle_s),
                                     media_type="application/json")
        return Response(msgspec.json.encode(event), media_type="application/json")

    async def _sse(self, body: dict[str, Any], plan: Plan, reply: ScriptedReply) -> AsyncIterator[bytes]:
        """SSE events of ``chunk_size`` tokens; a stream closed early is noted in ``cancelled``."""
        done = False
        try:
            async for event in self._events(body, plan, reply):
                yield event
            done = True
        finally:
            if not done:
                self.cancelled.append(str(body.get("rid", body.get("request_id"))))

    async def _events(self, body: dict[str, Any], plan: Plan, reply: ScriptedReply) -> AsyncIterator[bytes]:
        """SSE events of ``chunk_size`` tokens; a fault strikes after the first event."""
        all_spans = spans(len(plan.ids), self._chunk_size)
        for index, span in enumerate(all_spans):
            if index:
                await asyncio.sleep(reply.chunk_delay_s)
            final = index == len(all_spans) - 1 and reply.fault != "truncated_stream"
            event = self._event(body, plan, reply, span, final)
            if reply.fault == "missing_fields":
                self._strip(event, streamed=True)
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"
            if reply.fault is not None:
                break
        if reply.fault == "malformed_json":
            yield b"data: " + MALFORMED + b"\n\n"
        elif reply.fault == "engine_error":
            yield b"data: " + msgspec.json.encode(self._error(reply.error_message)) + b"\n\ndata: [DONE]\n\n"
        elif reply.fault is None:
            yield self._stream_end(body, plan)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        """Serve in a daemon thread (on the port it had before, if restarted); returns the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted engine server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self._port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def down(self) -> None:
        """Stop serving: connections to :attr:`url` are refused until :meth:`up`."""
        self.stop()

    def up(self) -> None:
        self.start()

    def __enter__(self) -> ScriptedServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ScriptedEngineServer(ScriptedServer):
    """SGLang's native API (``/generate``, ``/health``, ``/abort_request``), scripted."""

    protocol = "sglang"

    def __init__(
        self,
        replies: Iterable[ScriptedReply] | None = None,
        responder: Responder | None = None,
        chunk_size: int = 4,
        *,
        incremental_streaming_output: bool = False,
        keep_requests: int | None = None,
        checker: Checker | None = None,
    ) -> None:
        self._incremental = incremental_streaming_output
        super().__init__(replies, responder, chunk_size, keep_requests, checker)

    def _routes(self) -> list[Route]:
        return [Route("/generate", self._generate, methods=["POST", "PUT"]),
                Route("/abort_request", self._abort, methods=["POST"])]

    def _input_ids(self, body: dict[str, Any]) -> list[int]:
        return list(body.get("input_ids") or ())

    def _limits(self, body: dict[str, Any]) -> tuple[int | None, list[int]]:
        sampling = body.get("sampling_params") or {}
        return sampling.get("max_new_tokens"), list(sampling.get("stop_token_ids") or ())

    def _event(self, body: dict[str, Any], plan: Plan, reply: ScriptedReply, span: tuple[int, int],
               final: bool) -> dict[str, Any]:
        """One SGLang output object for tokens ``[start, end)`` (cumulative unless incremental)."""
        start, end = span
        start = start if self._incremental else 0
        meta: dict[str, Any] = {
            "id": body.get("rid"),
            "finish_reason": _sglang_finish(plan) if final else None,
            "prompt_tokens": len(body.get("input_ids") or ()),
            "completion_tokens": end,
            "cached_tokens": 0,
            "weight_version": reply.weight_version,
        }
        if body.get("return_logprob"):
            entries = plan.entries[start:] if final else plan.entries[start:end]
            meta["output_token_logprobs"] = [[lp, token, None] for lp, token in entries]
        return {"output_ids": plan.ids[start:end], "meta_info": meta}

    def _strip(self, event: dict[str, Any], *, streamed: bool) -> None:
        del event["meta_info" if streamed else "output_ids"]

    def _constraint(self, body: dict[str, Any]) -> dict[str, Any] | None:
        sampling = body.get("sampling_params") or {}
        found = {key: sampling[key] for key in ("json_schema", "ebnf", "regex") if key in sampling}
        return found or None

    def _error(self, message: str | None = None, status: int = 500) -> dict[str, Any]:
        return {"error": {"message": message or "scripted engine error"}}  # SGLang answers a ValueError this way

    def _refusal(self, body: dict[str, Any], message: str) -> Response:
        if not body.get("stream"):
            return super()._refusal(body, message)
        error = b"data: " + msgspec.json.encode(self._error(message, 400)) + b"\n\ndata: [DONE]\n\n"

        async def events() -> AsyncIterator[bytes]:
            yield error

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _abort(self, request: Request) -> Response:
        body = await request.json()
        self.aborted.append(str(body.get("rid")))
        return Response(status_code=200)


async def _trickle(body: bytes, every_s: float) -> AsyncIterator[bytes]:
    """``body`` one byte at a time, ``every_s`` seconds apart."""
    for index in range(len(body)):
        if index:
            await asyncio.sleep(every_s)
        yield body[index:index + 1]


def _sglang_finish(plan: Plan) -> dict[str, Any]:
    if plan.finish == "stop":
        return {"type": "stop", "matched": plan.ids[-1] if plan.ids else None}
    if plan.finish == "length":
        return {"type": "length", "length": len(plan.ids)}
    return {"type": "abort", "message": "aborted by the script"}
