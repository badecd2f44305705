"""A verl step's worth of agent sessions against a running edge: the burst test and ``ops/bench/burst.py``.

A step is ``prompts x n`` sessions (verl's 128 x 8 is 1,024). Each session is a short tool-using
conversation over the OpenAI wire: the user asks, the model calls ``add`` (a ``<tool_call>`` in the
hermes format), the agent answers with the tool's result, the model answers in text; then the task
posts its reward. Every session is left open until all have run, and then all are finalized at once,
as verl's agent loop ends a step: that is the burst the materializer has to take.

:func:`tool_responder` is the scripted engine's side (:class:`rollbus.testing.scripted.ScriptedEngineServer`):
its reply depends only on its input, so a retried or replayed turn gets the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import httpx2
import msgspec

from eventlog.kv import bucket_writes
from materializer.dataset import read_dataset
from rollbus.testing.scripted import Responder, ScriptedReply
from schemas.errors import LogUnavailable
from schemas.log import LogConfig
from schemas.records import MaterializedMarker
from stack.provision import connect

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 19, "b": 23}}\n</tool_call>'
ANSWER = "19 + 23 = 42."

_marker = msgspec.json.Decoder(MaterializedMarker)
T = TypeVar("T")


def tool_responder(encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], eos: int) -> Responder:
    """The engine of a step: a call of ``add`` to a request without a tool result, else the answer."""
    call, answer = [*encode(CALL), eos], [*encode(ANSWER), eos]

    def reply(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        return ScriptedReply(token_ids=answer if "<tool_response>" in decode(input_ids[-64:]) else call)

    return reply


class Step(msgspec.Struct, kw_only=True):
    """What a step did, as the agents saw it."""

    session_ids: list[str]
    ran_s: float  # opening and running every conversation
    finalize_s: float  # from the first finalize sent to the last one answered
    finalized_at: float  # time.monotonic() when the last finalize was answered
    trajectories: int  # as the finalize answers counted them


RETRIED = (429, 502, 503, 504)  # what the official SDKs retry (besides 408, 409 and connection errors)


def error_type(status: int, body: bytes) -> str:
    """``"<status> <error type>"`` of an error answer in any of the edge's wire shapes (OpenAI's
    ``{"error": {"type", "code"}}``, the code after a slash when it has one; Anthropic's ``{"type": "error",
    "error": {"type"}}``), else ``"<status>"``."""
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        return str(status)
    if not isinstance(error, dict) or not isinstance(error.get("type"), str):
        return str(status)
    code = error.get("code")
    return f"{status} {error['type']}" + (f"/{code}" if isinstance(code, str) and code != error["type"] else "")


class Driver:
    """Runs steps against the edge at ``url`` with ``concurrency`` sessions in flight. Like the official
    SDKs, a request answered 429/502/503/504 or cut off is retried, after each of ``delays`` in turn
    (0.5 s and 1 s: twice): the retries are counted in :attr:`retried` by cause, and every answer that
    was not a 2xx in :attr:`refused` by status and error type."""

    def __init__(self, url: str, admin_token: str, *, concurrency: int = 64, n: int = 8,
                 delays: Sequence[float] = (0.5, 1.0)) -> None:
        self._url = url
        self._admin = {"Authorization": f"Bearer {admin_token}"}
        self._concurrency = concurrency
        self._n = n
        self._delays = tuple(delays)
        self.retried: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    async def _post(self, client: httpx2.AsyncClient, path: str, headers: dict[str, str],
                    body: dict[str, Any] | None = None) -> Any:
        for delay in (*self._delays, None):
            try:
                response = await client.post(path, json=body, headers=headers)
            except httpx2.TransportError as exc:
                if delay is None:
                    raise
                self.retried[type(exc).__name__] += 1
            else:
                if response.status_code >= 300:
                    self.refused[error_type(response.status_code, response.content)] += 1
                if response.status_code not in RETRIED or delay is None:
                    return _ok(response)
                self.retried[str(response.status_code)] += 1
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def step(self, sessions: int, *, global_steps: int = 1, uid_prefix: str = "p") -> Step:
        async with self._client() as client:
            started = time.monotonic()
            ids = await self._bounded([self._session(client, i, global_steps, uid_prefix) for i in range(sessions)])
            ran = time.monotonic() - started
            started = time.monotonic()
            answers = await self._bounded([self._finalize(client, sid) for sid in ids])
            done = time.monotonic()
        return Step(session_ids=ids, ran_s=ran, finalize_s=done - started, finalized_at=done,
                    trajectories=sum(answers))

    def _client(self) -> httpx2.AsyncClient:
        """One pooled client, ``concurrency`` connections, on httpx2 like the edge's engine client: httpx's pool
        (httpcore 1.0.9) looks at every connection on every request and answer, 5 ms of CPU a request at 64,
        which made this driver, not the stack it drives, the bound of the burst test's step
        (``ops/bench/engine_pool.py``)."""
        limits = httpx2.Limits(max_connections=self._concurrency, max_keepalive_connections=self._concurrency)
        return httpx2.AsyncClient(base_url=self._url, limits=limits, timeout=120)

    async def _bounded(self, calls: Sequence[Awaitable[T]]) -> list[T]:
        gate = asyncio.Semaphore(self._concurrency)

        async def one(call: Awaitable[T]) -> T:
            async with gate:
                return await call

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def _open(self, client: httpx2.AsyncClient, i: int, global_steps: int, uid_prefix: str
                    ) -> tuple[dict[str, Any], dict[str, str], str]:
        """Open session ``i`` of the step (prompt ``i // n``): its answer, its key header, its chat path."""
        spec = {"uid": f"{uid_prefix}{i // self._n}", "session_index": i % self._n,
                "metadata": {"rollout_n": self._n, "global_steps": global_steps}}
        opened = await self._post(client, "/sessions", self._admin, spec)
        key = {"Authorization": f"Bearer {opened['api_key']}"}
        return opened, key, f"/sessions/{opened['session_id']}/v1/chat/completions"

    async def _session(self, client: httpx2.AsyncClient, i: int, global_steps: int, uid_prefix: str) -> str:
        opened, key, path = await self._open(client, i, global_steps, uid_prefix)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is 19 + 23? (task {i})"}]
        first = await self._post(client, path, key, {"model": "m", "messages": messages, "tools": TOOLS})
        message = first["choices"][0]["message"]
        call = message["tool_calls"][0]
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
        await self._post(client, path, key, {"model": "m", "messages": messages, "tools": TOOLS})
        await self._post(client, f"/sessions/{opened['session_id']}/reward_info", key,
                         {"reward_info": {"reward": 1.0}})
        return str(opened["session_id"])

    async def abandon(self, sessions: int, uid_prefix: str = "idle-") -> list[str]:
        """Open ``sessions`` sessions, a turn each, and leave them open (for the idle timeout to reclaim)."""
        async with self._client() as client:
            async def one(i: int) -> str:
                opened = await self._post(client, "/sessions", self._admin, {"uid": f"{uid_prefix}{i}"})
                await self._post(client, f"/sessions/{opened['session_id']}/v1/chat/completions",
                                 {"Authorization": f"Bearer {opened['api_key']}"},
                                 {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]})
                return str(opened["session_id"])

            return await self._bounded([one(i) for i in range(sessions)])

    async def _finalize(self, client: httpx2.AsyncClient, session_id: str) -> int:
        return int((await self._post(client, f"/sessions/{session_id}/finalize", self._admin))["trajectories"])


def _ok(response: httpx2.Response) -> Any:
    if response.status_code >= 300:
        raise RuntimeError(f"{response.request.method} {response.request.url.path}: {response.status_code} "
                           f"{response.text[:300]}")
    return response.json()


class Component:
    """``rollbus <command> ...`` as a subprocess, started and announced (its printed lines kept; a line
    with a traceback or an ERROR is echoed, prefixed with the command). :meth:`restart` starts the same
    command again (after a kill)."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.name = args[0]
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "rollbus.cli", *self.args, "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.printed = ""
        self._until(r"(Ctrl-C)")
        found = re.search(r"edge:\s+(http://\S+)", self.printed)
        self.url = found.group(1) if found else ""
        threading.Thread(target=self._drain, daemon=True).start()  # keep its pipe from filling

    def _until(self, pattern: str, timeout: float = 120.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited:\n{self.printed}")
            self.printed += line
            if re.search(pattern, line):
                return
        raise RuntimeError(f"{self.name} did not print {pattern!r}:\n{self.printed}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "Traceback" in line or "ERROR" in line:
                print(f"  {self.name}:", line.rstrip(), flush=True)

    def restart(self) -> None:
        """Start the command anew once its process has ended (SIGKILL it first)."""
        self.proc.wait(60)
        self.start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


async def sessions_open(client: httpx.AsyncClient, url: str) -> float:
    """The ``rollbus_sessions_open`` gauge of the edge at ``url`` (its ``/metrics``): the sessions it holds live."""
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("rollbus_sessions_open "):
            return float(line.split()[1])
    raise ValueError(f"{url}/metrics has no rollbus_sessions_open")


async def sessions_open_at_most(url: str, most: float, timeout: float) -> float:
    """The edge's live sessions once they are ``most`` or fewer, or ``timeout`` seconds passed (then more)."""
    async with httpx.AsyncClient(timeout=30) as client:
        deadline = time.monotonic() + timeout
        while True:
            now = await sessions_open(client, url)
            if now <= most or time.monotonic() > deadline:
                return now
            await asyncio.sleep(0.5)


def nats_url(printed: str) -> str:
    """The embedded NATS URL in what ``rollbus up`` printed."""
    found = re.search(r"nats:\s+(nats://\S+)", printed)
    if found is None:
        raise ValueError(f"rollbus up printed no NATS URL:\n{printed[-2000:]}")
    return found.group(1)


LOOKUPS = 256  # stored markers asked for at once


async def wait_marked(url: str, session_ids: list[str], timeout: float, *, cfg: LogConfig = LogConfig()
                      ) -> tuple[dict[str, str], float]:
    """(each session's marker status, time.monotonic() when the last one appeared), once every session has
    one or ``timeout`` passed (then some are missing).

    It reads the markers bucket's stream onwards from where its last look ended, each stored marker once, by
    sequence: a look while nothing was written is one request, and no consumer is held on the server (a burst
    test counts them). Asking for every unmarked session at each look (as it once did) cost the checker 11 s
    of CPU over a 28 s drain of 1,024 sessions, taken from the stack it waited for."""
    client = await connect(url, name="burst-check")
    wanted = set(session_ids)
    found: dict[str, str] = {}
    read_to = 0  # the markers bucket's stream sequence read up to
    last = time.monotonic()
    deadline = last + timeout
    try:
        while len(found) < len(wanted) and time.monotonic() < deadline:
            with contextlib.suppress(LogUnavailable):  # a server busy with the step: asked again
                writes, read_to = await bucket_writes(client.jetstream(), cfg.markers_bucket, read_to,
                                                      batch=LOOKUPS)
                for key, value in writes:
                    if key in wanted and value is not None:
                        found[key] = _marker.decode(value).status
                        last = time.monotonic()
            if len(found) < len(wanted):
                await asyncio.sleep(0.2)
        return found, last
    finally:
        await client.close()


class Outcome(msgspec.Struct, kw_only=True):
    """A step's sessions as the sinks hold them."""

    sessions: int
    lost: int  # no marker, or marked but no row
    duplicated: int  # rows past one per session
    quarantined: int
    other: dict[str, int]  # marker statuses other than finalized and quarantined
    stray: int  # rows of sessions not in the step


def outcome(trajectories: Path, session_ids: list[str], statuses: dict[str, str]) -> Outcome:
    """Every session must have a ``finalized`` marker and exactly one row (one chain each)."""
    table = read_dataset(trajectories, columns=["session_id"]) if trajectories.exists() else None
    rows = Counter(table.column("session_id").to_pylist() if table is not None else [])
    wanted = set(session_ids)
    kinds = Counter(statuses.values())
    return Outcome(sessions=len(session_ids),
                   lost=sum(1 for sid in session_ids if sid not in statuses or rows[sid] == 0),
                   duplicated=sum(max(rows[sid] - 1, 0) for sid in session_ids),
                   quarantined=kinds.pop("quarantined", 0), other={k: v for k, v in kinds.items() if k != "finalized"},
                   stray=sum(count for sid, count in rows.items() if sid not in wanted))


class ConsumerPeak:
    """The most consumers the NATS account held at once while it ran (polled), as ``async with``."""

    def __init__(self, url: str, every: float = 0.1) -> None:
        self._url = url
        self._every = every
        self.peak = 0
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None

    async def __aenter__(self) -> ConsumerPeak:
        self._client = await connect(self._url, name="burst-consumers")
        self._task = asyncio.ensure_future(self._poll(self._client.jetstream()))
        return self

    async def _poll(self, js: Any) -> None:
        while True:
            self.peak = max(self.peak, (await js.account_info()).consumers)
            await asyncio.sleep(self._every)

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Closed here, bounded, not in the cancelled poll's ``finally``: a 4,096-session bench once sat idle
        # for minutes after its step with this connection still open.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._client.close(), 5.0)
