"""``POST /sessions`` while a node of the three-node cluster is down answers 503, never 500.

The cluster, as ``tests/cluster/test_nats_cluster.py`` runs it (its :class:`Cluster` and
:class:`Component`): one ``rollbus edge`` on all three URLs, the log and its buckets replicated
on every node. The node leading the leases bucket (what a new session writes first: its lease)
is SIGKILLed, and sessions are opened without pause until they open again. Each answer is a 201,
or a 503 in the admin API's wire shape (``log_unavailable``) with ``Retry-After``: retryable,
as the SDKs and the agent framework read it. (Before the NATS errors of a KV write were mapped at
the lease's boundary, ``nats.js.errors.NoStreamResponseError`` came through as a 500 for a few
seconds after the kill.)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx

from schemas.log import LogConfig
from stack.provision import connect, provision
from tests.cluster.test_nats_cluster import TOKEN, Cluster, Component, engine  # noqa: F401 - engine: a fixture

WINDOW_S = 30.0  # opens are tried this long after the kill, at most
SETTLED = 10  # ... or until this many opened in a row after the node went
IN_FLIGHT = 4


async def _open(admin: httpx.AsyncClient, url: str, n: int) -> httpx.Response:
    """Every other open names its uid: it claims (uid, session_index) before its lease."""
    return await admin.post(f"{url}/sessions", json={"uid": f"kill{n}", "session_index": 0} if n % 2 else {})


async def _opens_after_the_kill(admin: httpx.AsyncClient, url: str) -> list[httpx.Response]:
    """Opens, ``IN_FLIGHT`` at a time, until ``SETTLED`` in a row succeed or ``WINDOW_S`` passes."""
    answers: list[httpx.Response] = []
    deadline, streak, n = time.monotonic() + WINDOW_S, 0, 1000
    while time.monotonic() < deadline and streak < SETTLED:
        batch = await asyncio.gather(*(_open(admin, url, n + i) for i in range(IN_FLIGHT)))
        n += IN_FLIGHT
        answers += batch
        for answer in batch:
            streak = streak + 1 if answer.status_code == 201 else 0
        await asyncio.sleep(0.05)
    return answers


def _retryable_503(answer: httpx.Response) -> bool:
    error = answer.json().get("error", {})
    return (answer.status_code == 503 and int(answer.headers.get("retry-after", "0")) >= 1
            and error.get("code") == "log_unavailable" and error.get("type") == "api_error"
            and isinstance(error.get("message"), str))


async def test_opening_sessions_while_a_node_is_down_is_a_retryable_503(engine, tmp_path: Path):  # noqa: F811
    net = Cluster(tmp_path / "cluster")
    edge: Component | None = None
    nc = None
    try:
        nc = await connect(net.urls, name="cluster-test")
        js, cfg = nc.jetstream(), LogConfig()
        await provision(js, cfg, replicas=3)
        edge = Component("edge", net.urls, tmp_path, "--port", "0", "--edge-id", "edge0", "--engine", "sglang",
                         "--engine-url", engine.url, "--admin-token", TOKEN)
        await edge.ready()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as admin:
            before = await asyncio.gather(*(_open(admin, edge.url, n) for n in range(IN_FLIGHT)))
            assert [a.status_code for a in before] == [201] * IN_FLIGHT, [a.text for a in before]
            leader = (await js.stream_info(f"KV_{cfg.leases_bucket}")).cluster.leader
            assert leader in net.procs
            net.kill(leader)
            killed = time.monotonic()
            answers = await _opens_after_the_kill(admin, edge.url)
            took = time.monotonic() - killed
    finally:
        if edge is not None:
            edge.stop()
        if nc is not None:
            await nc.close()
        net.stop()

    statuses = Counter((a.status_code, a.json().get("error", {}).get("message", "")[:60]) for a in answers)
    print(f"killed {leader}; {len(answers)} opens in {took:.1f}s: {dict(statuses)}")
    wrong = [(a.status_code, a.headers.get("retry-after"), a.text[:300]) for a in answers
             if a.status_code != 201 and not _retryable_503(a)]
    assert wrong == [], wrong  # every refusal a retryable 503 in the wire shape, never a 500
    assert [a.status_code for a in answers[-SETTLED:]] == [201] * SETTLED, "opens did not recover"
