"""A three-node NATS cluster loses a node (SIGKILL) mid-run; nothing acknowledged is lost.

Three ``nats-server`` processes on loopback form a cluster (the shape of ``ops/nats/``, written
by :mod:`stack.cluster` on free ports), the log replicated on all three (``--replicas 3``). Two
``rollbus edge`` processes, a projector and a materializer run as subprocesses, each given all
three URLs. Agents (the official OpenAI SDK, with its retries) talk to both edges; when a third
of their turns are done, the node leading the log stream is SIGKILLed. Then:

- every reply an agent got (a 200) is in the log: the turn its id names, with the same text;
- no agent saw an error: at most its SDK retried a request (counted from ``x-stainless-retry-count``);
- every session is materialized exactly once (one marker each, every trajectory key one Parquet row).

The engine is the scripted SGLang server of this process: it answers from its input, fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from edge.tokens.tokenizer import load_tokenizer
from eventlog.kv import KvStore
from eventlog.reader import read_session
from materializer.ledger import Markers
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from schemas.events import TurnCompleted
from schemas.log import LogConfig
from stack import cluster
from stack.nats_server import find_nats_server
from stack.provision import connect, provision
from tests.tq.readers import parquet_rows

TOKEN = "cluster-admin"
IM_END = 151645
AGENTS_PER_EDGE, TURNS = 3, 6
MAX_RETRIES = 8


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class Cluster:
    """Three nats-server processes started from :func:`stack.cluster.write`'s configurations."""

    def __init__(self, directory: Path) -> None:
        ports = _free_ports(9)
        self.nodes = [cluster.Node(f"n{i + 1}", ports[i], ports[3 + i], ports[6 + i]) for i in range(3)]
        self.directory = directory
        cluster.write(directory, self.nodes)
        binary = str(find_nats_server())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for node in self.nodes:
            with (directory / f"{node.name}.log").open("w") as out:
                self.procs[node.name] = subprocess.Popen([binary, "-c", f"{node.name}.conf"], cwd=directory,
                                                         stdout=out, stderr=subprocess.STDOUT)
        pending = cluster.wait(self.nodes, timeout_s=60)
        assert not pending, f"not healthy: {pending}"

    @property
    def urls(self) -> str:
        return cluster.urls(self.nodes)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


class Component:
    """``rollbus edge|projector|materializer`` as a subprocess."""

    def __init__(self, command: str, urls: str, directory: Path, *extra: str) -> None:
        self.name = f"{command}-{len(list(directory.glob(f'{command}-*.log')))}"
        self.output = directory / f"{self.name}.log"
        cmd = [sys.executable, "-m", "rollbus.cli", command, "--nats", urls, "--replicas", "3",
               "--data-dir", str(directory / "data"), "--log-level", "INFO", *extra]
        with self.output.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = ""

    async def ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while "running" not in self.output.read_text() or "Ctrl-C" not in self.output.read_text():
            assert self.proc.poll() is None, self.output.read_text()
            assert time.monotonic() < deadline, self.output.read_text()
            await asyncio.sleep(0.1)
        for line in self.output.read_text().splitlines():
            if line.strip().startswith("edge:"):
                self.url = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def engine() -> Iterator[ScriptedEngineServer]:
    tokenizer = load_tokenizer("builtin:qwen2.5")

    def reply(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:  # text that names its input
        return ScriptedReply(token_ids=[*tokenizer.encode(f"reply to {len(input_ids)} tokens"), IM_END])

    with ScriptedEngineServer(responder=reply) as server:
        yield server


class Agent:
    """One session: ``TURNS`` chat completions through the OpenAI SDK, each reply kept with its id."""

    def __init__(self, edge_url: str, index: int) -> None:
        self.edge_url = edge_url
        self.index = index
        self.replies: list[tuple[str, str]] = []  # (completion id, content) of every 200
        self.retries: Counter[int] = Counter()  # x-stainless-retry-count values seen (0: first attempts)
        self.session_id = ""

    async def _count(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.retries[int(request.headers.get("x-stainless-retry-count", "0"))] += 1

    async def run(self, admin: httpx.AsyncClient, progress: asyncio.Event, turns_done: list[int]) -> None:
        created = (await admin.post(f"{self.edge_url}/sessions", json={"uid": f"cluster{self.index}"})).json()
        self.session_id = created["session_id"]
        http = httpx.AsyncClient(event_hooks={"request": [self._count]}, timeout=60)
        client = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], http_client=http,
                             max_retries=MAX_RETRIES)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"agent {self.index}: count the tokens"}]
        async with http:
            for turn in range(TURNS):
                completion = await client.chat.completions.create(model="m", messages=messages, max_tokens=16)
                content = completion.choices[0].message.content or ""
                self.replies.append((completion.id, content))
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"again {turn}"}]
                turns_done[0] += 1
                if turns_done[0] >= AGENTS_PER_EDGE * 2 * TURNS // 3:
                    progress.set()
                await asyncio.sleep(0.2)
        finalized = await _retrying(lambda: admin.post(f"{self.edge_url}/sessions/{self.session_id}/finalize"))
        assert finalized.json()["status"] == "finalized", finalized.text


async def _retrying(call: Any, attempts: int = 20) -> httpx.Response:
    """An admin call, retried on 5xx as the SDK retries model calls (the log may be electing a leader)."""
    for _ in range(attempts - 1):
        response = await call()
        if response.status_code < 500:
            return response
        await asyncio.sleep(0.5)
    return await call()


async def _wait_materialized(js, cfg: LogConfig, session_ids: list[str], components: list[Component],
                             timeout: float = 90.0) -> dict:
    markers = await Markers(KvStore(js, cfg.markers_bucket, timeout=5.0)).bind()
    deadline = time.monotonic() + timeout
    found: dict = {}
    while True:
        with contextlib.suppress(Exception):  # a bucket leader being elected
            found = await markers.get_many(session_ids)
            if len(found) == len(session_ids):
                return found
        if time.monotonic() > deadline:
            print(_tails(components))  # the components' own account, beside pytest's
            raise AssertionError(f"{len(found)} of {len(session_ids)} sessions materialized")
        await asyncio.sleep(0.3)


def _tails(components: list[Component]) -> str:
    return "\n".join(f"--- {c.name}\n" + "\n".join(c.output.read_text().splitlines()[-25:]) for c in components)


async def test_a_node_killed_mid_run_loses_no_acknowledged_turn(engine, tmp_path):
    net = Cluster(tmp_path / "cluster")
    components: list[Component] = []
    nc = None
    try:
        nc = await connect(net.urls, name="cluster-test")
        js, cfg = nc.jetstream(), LogConfig()
        await provision(js, cfg, replicas=3)
        info = await js.stream_info(cfg.stream)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
        # Each edge lists the nodes from a different one (nats-py shuffles them anyway).
        urls = [net.urls, ",".join(n.url for n in (*net.nodes[1:], net.nodes[0]))]
        edges = [Component("edge", urls[i], tmp_path, "--port", "0", "--edge-id", f"edge{i}", "--engine", "sglang",
                           "--engine-url", engine.url, "--admin-token", TOKEN, "--lease-ttl", "5") for i in range(2)]
        consumers = [Component("projector", net.urls, tmp_path, "--metrics-port", "0"),
                     Component("materializer", net.urls, tmp_path, "--metrics-port", "0", "--batch-delay", "0.1",
                               "--ack-wait", "5")]
        components = [*edges, *consumers]
        await asyncio.gather(*(c.ready() for c in components))

        agents = [Agent(edges[i % 2].url, i) for i in range(2 * AGENTS_PER_EDGE)]
        progress, turns_done = asyncio.Event(), [0]
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as admin:
            running = asyncio.gather(*(a.run(admin, progress, turns_done) for a in agents))
            await asyncio.wait_for(progress.wait(), 60)
            leader = (await js.stream_info(cfg.stream)).cluster.leader
            assert leader in net.procs
            net.kill(leader)  # mid-run: the log stream's leader goes, the other two elect a new one
            killed_at = turns_done[0]
            await asyncio.wait_for(running, 120)  # an agent that saw an error raises here

        session_ids = [a.session_id for a in agents]
        markers = await _wait_materialized(js, cfg, session_ids, components)
        sessions = {sid: await read_session(js, cfg, sid) for sid in session_ids}
    finally:
        for component in components:
            component.stop()
        if nc is not None:
            await nc.close()
        net.stop()

    assert 0 < killed_at < len(agents) * TURNS  # the node died mid-run
    retried = sum(n for a in agents for count, n in a.retries.items() if count > 0)
    print(f"killed {leader} after {killed_at} of {len(agents) * TURNS} turns; SDK retries: {retried}")
    for agent in agents:
        assert len(agent.replies) == TURNS  # every call succeeded, whatever the SDK retried
        assert agent.retries[0] == TURNS and max(agent.retries) < MAX_RETRIES
        completed = {e.request_no: e.text for e in sessions[agent.session_id].events if isinstance(e, TurnCompleted)}
        for completion_id, content in agent.replies:  # what the agent saw is in the log
            request_no = int(completion_id.rsplit("-", 1)[1])
            assert completed.get(request_no) == content, (agent.session_id, completion_id, completed)
        assert len(completed) == TURNS  # and nothing else: a retry was recognized, not run twice
    rows = parquet_rows(tmp_path / "data" / "trajectories")
    keys = Counter(row["key"] for row in rows)
    assert keys == Counter(key for m in markers.values() for key in m.digests)  # every record exactly once
    assert set(Counter(row["session_id"] for row in rows)) == set(session_ids)
