"""The two apps the edge benchmark compares, each run as a process of its own on an HTTP server.

``edge``: the real rollbus edge (JetStream log, tokenizer, chains) with an in-process
*instant* engine that returns a fixed reply without any HTTP hop.
``floor``: a bare FastAPI app that reads the body and returns a fixed completion: the cost of
HTTP itself, on the same server.
``floor-asgi``: the same replies from a plain ASGI callable, no framework: the HTTP server's own share of the
floor (``edge_instructions.py --floors``).
``edge-memlog``: the same edge on the in-memory log (:class:`rollbus.testing.memory_log.InMemoryLog`,
envelopes fitted and encoded as for JetStream, but stored in a list): the edge less the log's round trip.
The edges run with malloc set up and the heap keeper running as in a rollbus stack (:mod:`stack.heap`).
``stack``: a rollbus stack (:class:`stack.runtime.Stack`, as ``rollbus up`` and its parts run it) of the
``--components`` given (``edge,projector,materializer`` by default; ``edge`` alone, ``projector``, ``materializer``),
on ``--nats``, the edge's engine the instant one, its data in ``--data-dir`` (``edge_cores.py``).

``--server``: ``granian`` (the edge's, :class:`stack.runtime.EdgeServer`, as ``rollbus edge`` runs it)
or ``uvicorn`` (uvicorn's httptools protocol, on uvloop), configured alike otherwise.

Usage: python ops/bench/_servers.py {edge,edge-memlog,floor,floor-asgi,stack} --port P [--server granian|uvicorn]
       [--nats URL] [--cpu N]
       [--max-trajectory-length N] [--components edge,projector,materializer] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import uvicorn
from fastapi import FastAPI, Request, Response

from edge.engines.base import GenerateChunk, GenerateRequest, GenerateResult

REPLY_TEXT = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app/main.py", "start": 1, '
              '"end": 80}}\n</tool_call>')
FLOOR_BODY = (b'{"id":"chatcmpl-x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
              b'"message":{"role":"assistant","tool_calls":[{"id":"call_1_0","type":"function","function":'
              b'{"name":"read_file",'
              b'"arguments":"{\\"path\\": \\"src/app/main.py\\", \\"start\\": 1, \\"end\\": 80}"}}]},'
              b'"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":560,"completion_tokens":31,"total_tokens":591}}')
OPEN_BODY = b'{"session_id":"0123456789abcdef0123456789abcdef","api_key":"k"}'


class InstantEngine:
    """Returns the same sampled reply at once: measures the edge, not a model."""

    name = "instant"

    @classmethod
    def replying(cls, tokenizer: Any) -> InstantEngine:
        """The engine that samples :data:`REPLY_TEXT` (and EOS) in ``tokenizer``'s ids."""
        return cls([*tokenizer.encode(REPLY_TEXT), tokenizer.eos_token_id])

    def __init__(self, token_ids: list[int]) -> None:
        self._ids = tuple(token_ids)
        self._logprobs = tuple(-0.01 * (i + 1) for i in range(len(token_ids)))

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return GenerateResult(token_ids=self._ids, logprobs=self._logprobs, finish_reason="stop",
                              weight_version="bench")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        yield await self.generate(request)

    async def aclose(self) -> None:
        return None


def floor_app() -> FastAPI:
    app = FastAPI()

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def complete(session_id: str, request: Request) -> Response:
        await request.body()
        return Response(content=FLOOR_BODY, media_type="application/json")

    @app.post("/sessions")
    async def open_session(request: Request) -> Response:
        return Response(content=OPEN_BODY, status_code=201, media_type="application/json")

    return app


async def bare_floor(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The floor's replies from a plain ASGI callable: the body read, the fixed reply sent."""
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    status, body = (201, OPEN_BODY) if scope["path"] == "/sessions" else (200, FLOOR_BODY)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def edge_app(nats_url: str, max_trajectory_length: int = 32768) -> FastAPI:
    from edge.app import create_app
    from edge.settings import EdgeSettings
    from edge.tokens.tokenizer import load_tokenizer
    from schemas.log import LogConfig
    from stack.heap import settle_heap
    from stack.provision import connect, provision
    from stack.runtime import build_edge_service

    cfg = LogConfig()
    nc = await connect(nats_url, name="bench-edge")
    await provision(nc.jetstream(), cfg)
    engine = InstantEngine.replying(load_tokenizer("builtin:qwen2.5"))
    settings = EdgeSettings(admin_token="bench", log=cfg, public_url="http://bench",
                            max_trajectory_length=max_trajectory_length)
    app = create_app(build_edge_service(settings, nc, engine))
    settle_heap()  # as `rollbus edge` does once started
    return app


async def memlog_edge_app(max_trajectory_length: int = 32768) -> Any:
    """The edge on the in-memory log: no leases and no session index either, which only opening a
    session touches (the benchmark opens its sessions before it counts)."""
    from edge.app import create_app
    from edge.settings import EdgeSettings
    from edge.tokens.fidelity import load_codec
    from rollbus.testing.memory_log import in_memory_service
    from stack.heap import settle_heap

    codec = load_codec("builtin:qwen2.5", "hermes")
    engine = InstantEngine.replying(codec[0].tokenizer)
    settings = EdgeSettings(admin_token="bench", public_url="http://bench", max_trajectory_length=max_trajectory_length)
    app = create_app(in_memory_service(engine, settings=settings, codec=codec))
    settle_heap()
    return app


SERVERS = ("granian", "uvicorn")
KINDS = ("edge", "edge-memlog", "floor", "floor-asgi")  # the apps on either server (``stack`` is granian's only)


async def serve_stack(components: tuple[str, ...], port: int, nats_url: str, data_dir: Path,
                      max_trajectory_length: int = 32768) -> None:
    """A rollbus stack of ``components`` until SIGTERM, as ``rollbus up`` (or ``rollbus edge``, ``projector``,
    ``materializer``) runs it, the edge's engine the instant one."""
    import signal

    from edge.tokens.tokenizer import load_tokenizer
    from stack.heap import settle_heap
    from stack.options import StackOptions
    from stack.runtime import Stack

    options = StackOptions(port=port, nats_url=nats_url, data_dir=data_dir, admin_token="bench",
                           components=components, max_trajectory_length=max_trajectory_length,
                           edge_id=f"bench-{port}")
    engine = InstantEngine.replying(load_tokenizer(options.tokenizer)) if "edge" in components else None
    stack = Stack(options, engine=engine)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stack.stop_event.set)
    try:
        await stack.start()
        settle_heap()
        await stack.run_until_stopped()
    finally:
        await stack.stop()


async def serve(kind: str, server: str, port: int, nats_url: str | None, max_trajectory_length: int = 32768) -> None:
    from stack.heap import HeapKeeper
    from stack.runtime import bind

    app: Any
    if kind == "floor":
        app = floor_app()
    elif kind == "floor-asgi":
        app = bare_floor
    elif kind == "edge-memlog":
        app = await memlog_edge_app(max_trajectory_length)
    else:
        app = await edge_app(nats_url or "", max_trajectory_length)
    sock = bind("127.0.0.1", port)
    keeper = HeapKeeper.for_process() if not kind.startswith("floor") else None  # malloc as a rollbus stack sets it up
    keeping = asyncio.ensure_future(keeper.run(asyncio.Event())) if keeper is not None else None
    try:
        await _serve_on(app, server, sock)
    finally:
        if keeping is not None:
            keeping.cancel()


async def _serve_on(app: Any, server: str, sock: Any) -> None:
    from stack.runtime import EdgeServer

    if server == "granian":
        await EdgeServer(app, sock).serve()
        return
    # No proxy-headers middleware (a layer on every request: nothing reads the client address), no
    # ``server`` header, no access log.
    config = uvicorn.Config(app, log_level="warning", access_log=False, loop="none", http="httptools",
                            lifespan="off", proxy_headers=False, server_header=False)
    await uvicorn.Server(config).serve(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=[*KINDS, "stack"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--server", choices=SERVERS, default="granian")
    parser.add_argument("--nats")
    parser.add_argument("--cpu", type=int, default=None)
    parser.add_argument("--max-trajectory-length", type=int, default=32768)
    parser.add_argument("--components", default="edge,projector,materializer")
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import uvloop

    if args.kind == "stack":
        uvloop.run(serve_stack(tuple(args.components.split(",")), args.port, args.nats, args.data_dir,
                               args.max_trajectory_length))
        return
    uvloop.run(serve(args.kind, args.server, args.port, args.nats, args.max_trajectory_length))


if __name__ == "__main__":
    main()
