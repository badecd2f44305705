"""A streamed turn's frames reach the client as the engine produces them: the edge's sockets have
TCP_NODELAY, so a small SSE frame written while the previous one is unacknowledged is not held back
for the client's delayed ACK (Nagle's algorithm). Real edge on granian, real JetStream, a scripted
SGLang engine that streams one token at a time, the official openai SDK."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client
from openai import AsyncOpenAI

from edge.tokens.tokenizer import Tokenizer
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from schemas.log import LogConfig
from stack.runtime import bind
from tests.integration.edge_http import ServedEdge, served_edge
from tests.integration.edges import IM_END

CHUNKS = 8
TURNS = 5
GAP_S = 0.02  # between the engine's chunks: the frames should arrive spread over ~(CHUNKS - 1) * GAP_S


@pytest.fixture
def streaming_engine() -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(chunk_size=1) as server:
        yield server


@pytest.fixture
async def edge(nc: Client, log_config: LogConfig, streaming_engine: ScriptedEngineServer) -> AsyncIterator[ServedEdge]:
    async with served_edge(nc, log_config, streaming_engine.url) as served:
        yield served


def test_the_edge_socket_has_tcp_nodelay_and_its_connections_inherit_it() -> None:
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        client = socket.create_connection(sock.getsockname()[:2])
        sock.setblocking(True)
        accepted, _ = sock.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # what granian serves on
        accepted.close()
        client.close()
    finally:
        sock.close()


async def test_frames_of_a_streamed_turn_arrive_as_the_engine_produces_them(
        edge: ServedEdge, streaming_engine: ScriptedEngineServer, tokenizer: Tokenizer) -> None:
    session = await edge.open_session()
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    words = [tokenizer.encode(f" w{i}")[0] for i in range(CHUNKS)]
    bunched = []
    for turn in range(TURNS):
        streaming_engine.push(ScriptedReply(token_ids=[*words, IM_END], chunk_delay_s=GAP_S))
        arrivals: list[float] = []
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"count {turn}"}], stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
        assert len(arrivals) == CHUNKS
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        assert arrivals[-1] - arrivals[0] > 0.6 * (CHUNKS - 1) * GAP_S, gaps  # spread over ~140 ms
        bunched += [gap for gap in gaps if gap < GAP_S / 4]
    # held back by Nagle, each turn's first frames come together after the client's delayed ACK (gaps
    # of ~0.2 ms: 2-3 a turn measured); as produced, a gap that short is only a stall of the loaded machine
    assert len(bunched) <= 3, bunched
    await client.close()
