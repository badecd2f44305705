"""Chaos: agent sessions against a stack of separate processes while its parts are killed and paused.

A stack (:class:`ProcessStack`) is nats-server, ``rollbus edge`` (on a scripted SGLang engine),
``rollbus projector`` and ``rollbus materializer`` (Parquet), each a process of its own. A run
(:func:`run`) drives the same seeded sessions (:func:`plans`) through it twice:

- ``base``: nothing is done to the stack; its records are the reference;
- ``chaos``: the sessions start spread over a window while a seeded schedule of faults
  (:func:`schedule`) is carried out one after the other: ``SIGKILL`` a part (then start it again, the
  edge on its port, nats-server on its store and port) or ``SIGSTOP`` it for a few seconds (then
  ``SIGCONT``).

A session is a short tool-using conversation (the model calls ``add``, the agent answers with the
result, the model answers) over the OpenAI chat wire, Anthropic's messages or the Responses API
(official SDKs, streaming or not); some send their first request twice (a sibling chain from the same
prompt); then the task posts its reward and the session is finalized, or aborted. The agents retry as
the SDKs do (:class:`rollbus.testing.burst.Driver`), longer, and with an ``Idempotency-Key`` per
request, so a retried turn is answered from the log. A session's label is its ``(uid,
session_index)`` less the phase: ``{phase}-{i // 4}``, ``i % 4``.

Then (:class:`Report`): every turn an agent got a 2xx for is in the log with the text it got; no
request completed twice; every finalized session is marked and its records are in Parquet once,
equal to the same label's in ``base`` (all columns but ``session_id``, and ``metadata.attempt``,
which a re-sent open bumps); aborted sessions have none; nothing is quarantined; ``rollbus replay
--verify --all`` is clean; no request was answered 500. Every answer that was not a 2xx is counted by
status and error type, beside the faults by part and kind.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anthropic
import httpx
import httpx2
import msgspec
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

from eventlog.reader import read_session
from materializer.dataset import read_dataset
from rollbus.testing.burst import RETRIED, TOOLS, Component, Driver, error_type, wait_marked
from schemas.events import RequestReceived, TurnCompleted
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import connect

T = TypeVar("T")

PARTS = ("edge", "projector", "materializer", "nats")
KINDS = ("SIGKILL", "SIGSTOP")
WIRES = ("openai", "anthropic", "responses")
N = 4  # sessions per uid
DELAYS = (0.5, 1.0, 2.0, *(4.0,) * 25)  # an agent's retries: about 100 s before it gives up a request
SDK_RETRIED = (408, 409, *RETRIED, 500)  # what the official SDKs retry (409: session_owned_elsewhere)
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"], "strict": False} for t in TOOLS]
IGNORED = ("session_id",)  # record columns that differ between runs by design


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # seconds from the start of the faulted phase
    component: str  # one of PARTS
    kind: str  # SIGKILL (then started again) | SIGSTOP (for pause_s, then SIGCONT)
    pause_s: float = 0.0


def schedule(seed: int, window_s: float, faults: int, *, pause_s: tuple[float, float] = (2.0, 6.0)) -> list[Fault]:
    """``faults`` faults at seeded moments of ``window_s``: every (part, kind) once before any twice."""
    rng = random.Random(f"faults-{seed}")
    pairs = [(c, k) for c in PARTS for k in KINDS]
    rng.shuffle(pairs)
    chosen = pairs[:faults] + [(rng.choice(PARTS), rng.choice(KINDS)) for _ in range(faults - len(pairs))]
    times = sorted(rng.uniform(0.05 * window_s, 0.85 * window_s) for _ in chosen)
    return [Fault(at=round(t, 2), component=c, kind=k, pause_s=round(rng.uniform(*pause_s), 1) if k == "SIGSTOP"
                  else 0.0) for t, (c, k) in zip(times, chosen, strict=True)]


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    wire: str  # one of WIRES
    stream: bool
    sibling: bool  # its first request is sent twice (two keys): a second chain from the prompt
    end: str  # "finalize" | "abort"
    start_s: float  # from the phase's start (0 in base)

    @property
    def uid(self) -> str:
        return str(self.index // N)

    @property
    def session_index(self) -> int:
        return self.index % N


def plans(seed: int, sessions: int, window_s: float = 0.0) -> list[Plan]:
    """The seeded sessions: wires, streaming, siblings, a sixth aborted; started over ``window_s``."""
    rng = random.Random(f"sessions-{seed}")
    return [Plan(index=i, wire=rng.choice(WIRES), stream=rng.random() < 0.5, sibling=rng.random() < 0.2,
                 end="abort" if rng.random() < 1 / 6 else "finalize", start_s=window_s * i / max(sessions, 1))
            for i in range(sessions)]


class Ack(msgspec.Struct, frozen=True, kw_only=True):
    """A turn an agent was answered with a 2xx: its session, request number (from the answer's id), text
    and tool calls' names."""

    session_id: str
    request_no: int
    text: str
    tools: tuple[str, ...]


class Ran(msgspec.Struct, kw_only=True):
    """A phase's sessions as its agents saw them: plan index -> session id, and how each ended."""

    phase: str
    session_ids: dict[int, str] = {}
    ended: dict[int, str] = {}  # "finalized" | "aborted"
    gave_up: dict[int, str] = {}  # what the agent gave up on: the last error
    acks: list[Ack] = []


_ID_NUMBER = re.compile(r"[-_]([0-9]+)$")


class ChaosDriver(Driver):
    """:class:`Driver`'s retries (``DELAYS``), with the SDKs for model turns (retried the same way, with the
    request's ``Idempotency-Key``); every answer that is not a 2xx is counted in :attr:`refused`."""

    def __init__(self, url: str, admin_token: str, *, concurrency: int = 32) -> None:
        super().__init__(url, admin_token, concurrency=concurrency, n=N, delays=DELAYS)
        self._http2: httpx2.AsyncClient | None = None

    async def run(self, sessions: list[Plan], phase: str) -> Ran:
        ran = Ran(phase=phase)
        limits = httpx.Limits(max_connections=self._concurrency * 2, max_keepalive_connections=self._concurrency)
        gate = asyncio.Semaphore(self._concurrency)
        started = time.monotonic()
        hooks = {"response": [self._count]}
        async with httpx.AsyncClient(base_url=self._url, limits=limits, timeout=120) as admin, \
                httpx.AsyncClient(limits=limits, timeout=120, event_hooks=hooks) as model, \
                httpx2.AsyncClient(limits=httpx2.Limits(max_connections=self._concurrency * 2), timeout=120,
                                   event_hooks=hooks) as model2:  # the anthropic SDK's own httpx
            self._http2 = model2

            async def one(plan: Plan) -> None:
                await asyncio.sleep(max(0.0, started + plan.start_s - time.monotonic()))
                async with gate:
                    try:
                        await self._session_of(admin, model, plan, ran)
                    except Exception as exc:  # given up: reported
                        ran.gave_up[plan.index] = f"{type(exc).__name__}: {str(exc)[:200]}"

            await asyncio.gather(*(one(p) for p in sessions))
        return ran

    async def _count(self, response: httpx.Response | httpx2.Response) -> None:
        if response.status_code >= 300:
            await response.aread()
            self.refused[error_type(response.status_code, response.content)] += 1

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        for delay in (*self._delays, None):
            try:
                return await call()
            except (openai.APIStatusError, anthropic.APIStatusError) as exc:
                if exc.status_code not in SDK_RETRIED or delay is None:
                    raise
                self.retried[str(exc.status_code)] += 1
            except (openai.APIConnectionError, anthropic.APIConnectionError, httpx.TransportError,
                    httpx2.TransportError) as exc:
                if delay is None:
                    raise
                self.retried[type(exc.__cause__ or exc).__name__] += 1
            except (openai.APIError, anthropic.APIError) as exc:  # an error event in a stream that began 200
                if delay is None:
                    raise
                self.refused[f"stream {_kind(exc)}"] += 1
                self.retried[f"stream {_kind(exc)}"] += 1
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _open(self, admin: httpx.AsyncClient, plan: Plan, phase: str) -> dict[str, Any]:
        """Open the session; a re-sent open is a newer ``attempt`` (the first may have opened a session whose
        answer was lost: it holds the label, and stays open, unused)."""
        for attempt, delay in enumerate((*self._delays, None)):
            spec = {"uid": f"{phase}-{plan.uid}", "session_index": plan.session_index,
                    "metadata": {"rollout_n": N, "attempt": attempt, "wire": plan.wire}}
            try:
                response = await admin.post("/sessions", json=spec, headers=self._admin)
            except httpx.TransportError as exc:
                if delay is None:
                    raise
                self.retried[type(exc).__name__] += 1
            else:
                if response.status_code == 201:
                    return dict(response.json())
                self.refused[error_type(response.status_code, response.content)] += 1
                if response.status_code not in (409, *RETRIED) or delay is None:
                    raise RuntimeError(f"POST /sessions: {response.status_code} {response.text[:300]}")
                self.retried[str(response.status_code)] += 1
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _session_of(self, admin: httpx.AsyncClient, model: httpx.AsyncClient, plan: Plan, ran: Ran) -> None:
        opened = await self._open(admin, plan, ran.phase)
        sid, key = str(opened["session_id"]), str(opened["api_key"])
        ran.session_ids[plan.index] = sid
        turn = {"openai": self._openai, "anthropic": self._anthropic, "responses": self._responses}[plan.wire]
        await turn(opened, model, plan, ran)
        auth = {"Authorization": f"Bearer {key}"}
        await self._post(admin, f"/sessions/{sid}/reward_info", auth, {"reward_info": {"reward": 1.0}})
        if plan.end == "abort":
            await self._post(admin, f"/sessions/{sid}/abort", self._admin, {"reason": "chaos"})
            ran.ended[plan.index] = "aborted"
        else:
            await self._post(admin, f"/sessions/{sid}/finalize", self._admin)
            ran.ended[plan.index] = "finalized"

    def _ack(self, ran: Ran, session_id: str, answer_id: str, text: str, tools: list[str]) -> None:
        found = _ID_NUMBER.search(answer_id)
        ran.acks.append(Ack(session_id=session_id, request_no=int(found.group(1)) if found else -1, text=text,
                            tools=tuple(tools)))

    def _keys(self, plan: Plan, ran: Ran) -> Callable[[], dict[str, str]]:
        numbers = iter(range(1_000))
        return lambda: {"Idempotency-Key": f"{ran.phase}-{plan.index}-{next(numbers)}"}

    async def _openai(self, opened: dict[str, Any], http: httpx.AsyncClient, plan: Plan, ran: Ran) -> None:
        client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key=opened["api_key"], http_client=http,
                                    max_retries=0)
        keys, sid = self._keys(plan, ran), str(opened["session_id"])

        async def ask(messages: list[dict[str, Any]]) -> Any:
            headers = keys()

            async def once() -> Any:
                request: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS,
                                           "extra_headers": headers}
                if not plan.stream:
                    completion = await client.chat.completions.create(**request)
                else:
                    state = ChatCompletionStreamState()
                    async for chunk in await client.chat.completions.create(**request, stream=True):
                        state.handle_chunk(chunk)
                    completion = state.get_final_completion()
                return completion.id, completion.choices[0].message

            answer_id, message = await self._retry(once)
            self._ack(ran, sid, answer_id, message.content or "",
                      [c.function.name for c in message.tool_calls or []])
            return message

        messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is 19 + 23? (task {plan.index})"}]
        for _ in range(2 if plan.sibling else 1):
            first = await ask(list(messages))
        call = first.tool_calls[0]
        messages += [first.model_dump(exclude_none=True, exclude={"parsed"}),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        await ask(messages)

    async def _anthropic(self, opened: dict[str, Any], http: httpx.AsyncClient, plan: Plan, ran: Ran) -> None:
        client = anthropic.AsyncAnthropic(base_url=opened["anthropic_base_url"], api_key=opened["api_key"],
                                          http_client=self._http2, max_retries=0)
        keys, sid = self._keys(plan, ran), str(opened["session_id"])

        async def ask(messages: list[dict[str, Any]]) -> Any:
            headers = keys()

            async def once() -> Any:
                request: dict[str, Any] = {"model": "m", "max_tokens": 256, "messages": messages,
                                           "tools": ANTHROPIC_TOOLS, "extra_headers": headers}
                if not plan.stream:
                    return await client.messages.create(**request)
                async with client.messages.stream(**request) as events:
                    return await events.get_final_message()

            message = await self._retry(once)
            self._ack(ran, sid, message.id, "".join(b.text for b in message.content if b.type == "text"),
                      [b.name for b in message.content if b.type == "tool_use"])
            return message

        messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is 19 + 23? (task {plan.index})"}]
        for _ in range(2 if plan.sibling else 1):
            first = await ask(list(messages))
        use = next(b for b in first.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
        await ask(messages)

    async def _responses(self, opened: dict[str, Any], http: httpx.AsyncClient, plan: Plan, ran: Ran) -> None:
        client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key=opened["api_key"], http_client=http,
                                    max_retries=0)
        keys, sid = self._keys(plan, ran), str(opened["session_id"])

        async def ask(items: list[dict[str, Any]]) -> Any:
            headers = keys()

            async def once() -> Any:
                request: dict[str, Any] = {"model": "m", "input": items, "tools": RESPONSES_TOOLS,
                                           "extra_headers": headers}
                if not plan.stream:
                    return await client.responses.create(**request)
                async with client.responses.stream(**request) as events:
                    async for _ in events:
                        pass
                    return await events.get_final_response()

            response = await self._retry(once)
            self._ack(ran, sid, response.id, response.output_text,
                      [item.name for item in response.output if item.type == "function_call"])
            return response

        items: list[dict[str, Any]] = [{"role": "user", "content": f"What is 19 + 23? (task {plan.index})"}]
        for _ in range(2 if plan.sibling else 1):
            first = await ask(list(items))
        output = [item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in first.output]
        items += output + [{"type": "function_call_output", "call_id": item["call_id"], "output": "42"}
                           for item in output if item["type"] == "function_call"]
        await ask(items)


def _kind(exc: Exception) -> str:
    kind = getattr(exc, "type", None)
    body = getattr(exc, "body", None)
    if kind is None and isinstance(body, dict):
        error = body.get("error", body)
        kind = error.get("type") if isinstance(error, dict) else None
    return str(kind or type(exc).__name__)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ProcessStack:
    """nats-server (its store in ``root/nats``), ``rollbus edge`` on a fixed port, ``rollbus projector`` and
    ``rollbus materializer`` (Parquet in ``root/data/trajectories``), each a process of its own."""

    def __init__(self, root: Path, engine_url: str, *, admin_token: str = "tok", ack_wait: float = 5.0,
                 edge_args: Sequence[str] = ()) -> None:
        self.root = root
        self.admin_token = admin_token
        self.nats = EmbeddedNats(root / "nats", name="chaos").start()
        self.nats.port = urlsplit(self.nats.url).port or self.nats.port  # a restart binds the same port
        self.data = root / "data"
        url = self.nats.url
        self.parts: dict[str, Component] = {}
        try:
            self.parts["edge"] = Component("edge", "--nats", url, "--port", str(free_port()), "--data-dir",
                                           str(root / "edge"), "--admin-token", admin_token, "--engine", "sglang",
                                           "--engine-url", engine_url, *edge_args)
            self.parts["projector"] = Component("projector", "--nats", url, "--data-dir", str(self.data),
                                                "--metrics-port", "off")
            self.parts["materializer"] = Component("materializer", "--nats", url, "--data-dir", str(self.data),
                                                   "--metrics-port", "off", "--ack-wait", str(ack_wait),
                                                   "--batch-delay", "0.2")
        except BaseException:
            self.close()
            raise
        self.url = self.parts["edge"].url

    @property
    def nats_url(self) -> str:
        return self.nats.url

    def pids(self) -> dict[str, int]:
        return {**{name: part.proc.pid for name, part in self.parts.items()}, "nats": self.nats.pid}

    def exited(self) -> list[str]:
        """The parts whose process has ended (none should, but by a fault, which starts it again)."""
        return [name for name, part in self.parts.items() if part.proc.poll() is not None] + \
            ["nats"] * (self.nats.poll() is not None)

    def apply(self, fault: Fault) -> None:
        """Carry out ``fault``; return once the part runs again (started anew, or continued)."""
        pid = self.pids()[fault.component]
        if fault.kind == "SIGSTOP":
            os.kill(pid, signal.SIGSTOP)
            time.sleep(fault.pause_s)
            os.kill(pid, signal.SIGCONT)
            return
        os.kill(pid, signal.SIGKILL)
        if fault.component == "nats":
            while self.nats.poll() is None:
                time.sleep(0.01)
            self.nats.stop(keep_store=True)
            self.nats.start()
        else:
            self.parts[fault.component].restart()

    def close(self) -> None:
        for part in reversed(list(self.parts.values())):
            part.stop()
        self.nats.stop()


class FaultRunner:
    """Carries out a schedule from a thread of its own, one fault after the other (a fault whose moment
    passed while the one before it ran follows at once)."""

    def __init__(self, stack: ProcessStack, faults: list[Fault]) -> None:
        self._stack = stack
        self._faults = faults
        self.done: list[tuple[Fault, float]] = []  # (fault, seconds until the part ran again)
        self.exited: set[str] = set()  # parts found ended on their own before a fault
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)
        self._began = 0.0

    def start(self) -> FaultRunner:
        self._began = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for fault in self._faults:
                time.sleep(max(0.0, self._began + fault.at - time.monotonic()))
                self.exited.update(self._stack.exited())
                started = time.monotonic()
                self._stack.apply(fault)
                self.done.append((fault, time.monotonic() - started))
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


class Report(msgspec.Struct, kw_only=True):
    seed: int
    sessions: int  # per phase
    finalized: int
    aborted: int
    gave_up: dict[str, str]  # label -> the agent's last error
    faults: dict[str, int]  # "part kind" -> count
    recovery_s: dict[str, float]  # "part kind" -> the longest time until the part ran again
    turns_acknowledged: int
    turns_lost: int  # acknowledged but not in the log with what the agent got
    turns_duplicated: int  # one request (its Idempotency-Key) completed more than once
    records: int  # the chaos phase's rows of finalized sessions
    records_missing: list[str]  # finalized labels with fewer rows than in base (or none)
    records_duplicated: int  # rows past one per key
    records_different: list[str]  # finalized labels whose rows differ from base's
    aborted_with_records: list[str]
    exited: list[str]  # parts whose process ended on its own (a component that gave up)
    unmarked: int  # ended sessions without a marker
    quarantined: int
    refused: dict[str, int]  # every non-2xx answer, "status error-type" -> count
    retried: dict[str, int]
    verify_exit: int  # rollbus replay --verify --all
    verify_said: str
    ran_s: float

    @property
    def failures(self) -> list[str]:
        said = [f"{name}: {value}" for name, value in (
            ("sessions given up", len(self.gave_up)), ("turns lost", self.turns_lost),
            ("turns duplicated", self.turns_duplicated), ("records missing", len(self.records_missing)),
            ("records duplicated", self.records_duplicated), ("records different", len(self.records_different)),
            ("aborted with records", len(self.aborted_with_records)), ("unmarked", self.unmarked),
            ("parts that exited on their own", len(self.exited)),
            ("quarantined", self.quarantined)) if value]
        said += [f"{cause}: {count}" for cause, count in self.refused.items() if cause.startswith("500")]
        if self.verify_exit != 0:
            said.append(f"replay --verify --all exited {self.verify_exit}: {self.verify_said}")
        return said

    def render(self) -> str:
        faults = ", ".join(f"{k} {v} (slowest back in {self.recovery_s[k]:.1f}s)" for k, v in
                           sorted(self.faults.items())) or "none"
        lines = [
            f"chaos seed {self.seed}: {self.sessions} sessions ({self.finalized} finalized, {self.aborted} aborted, "
            f"{len(self.gave_up)} given up) in {self.ran_s:.0f}s",
            f"faults: {faults}",
            f"turns: {self.turns_acknowledged} acknowledged, {self.turns_lost} lost, {self.turns_duplicated} "
            "duplicated",
            f"records: {self.records} rows; {len(self.records_missing)} sessions missing rows, "
            f"{self.records_duplicated} duplicated rows, {len(self.records_different)} sessions differing from the "
            f"fault-free run, {len(self.aborted_with_records)} aborted sessions with rows; {self.unmarked} unmarked, "
            f"{self.quarantined} quarantined; parts that exited on their own: {', '.join(self.exited) or 'none'}",
            "non-2xx: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.refused.items())) or "none"),
            "retried: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.retried.items())) or "none"),
            f"replay --verify --all: exit {self.verify_exit} ({self.verify_said})",
        ]
        lines += [f"  given up {label}: {why}" for label, why in list(self.gave_up.items())[:10]]
        lines += [f"  differing: {', '.join(self.records_different[:10])}"] * bool(self.records_different)
        lines += [f"  missing: {', '.join(self.records_missing[:10])}"] * bool(self.records_missing)
        lines.append("FAILED: " + "; ".join(self.failures) if self.failures else "OK: nothing lost or duplicated")
        return "\n".join(lines)


def _label(uid: str, session_index: int) -> str:
    return f"{uid.split('-', 1)[-1]}/{session_index}"


def _normalized(row: dict[str, Any]) -> dict[str, Any]:
    row = {k: v for k, v in row.items() if k not in IGNORED}
    row["uid"] = row["uid"].split("-", 1)[-1]
    row["key"] = row["key"].split("-", 1)[-1]
    if row.get("parent_key"):  # a forked chain's parent names its uid, the phase's prefix with it
        row["parent_key"] = row["parent_key"].split("-", 1)[-1]
    metadata = msgspec.json.decode(row["metadata"]) if isinstance(row.get("metadata"), str) else row.get("metadata")
    row["metadata"] = {k: v for k, v in (metadata or {}).items() if k != "attempt"}
    return row


class Compared(msgspec.Struct, kw_only=True):
    records: int  # the chaos phase's rows of finalized sessions
    missing: list[str]  # finalized labels with fewer keys than in base, or none
    different: list[str]  # finalized labels whose rows are not base's
    aborted_with_records: list[str]
    duplicated: int  # rows past one per key, both phases


def compare_records(rows: list[dict[str, Any]], ended: dict[int, str]) -> Compared:
    """The chaos phase's rows (``uid`` ``chaos-...``) against base's, label by label, for the sessions that
    ``ended`` (plan index -> ``finalized`` or ``aborted``): equal but for :data:`IGNORED` and
    ``metadata.attempt``."""
    by_label: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    keys = Counter(r["key"] for r in rows)
    for row in rows:
        phase = row["uid"].split("-", 1)[0]
        by_label.setdefault((phase, _label(row["uid"], row["session_index"])), {})[row["key"].split("-", 1)[-1]] = \
            _normalized(row)
    compared = Compared(records=0, missing=[], different=[], aborted_with_records=[],
                        duplicated=sum(c - 1 for c in keys.values()))
    for i, status in sorted(ended.items()):
        label = f"{i // N}/{i % N}"
        got = by_label.get(("chaos", label), {})
        if status == "aborted":
            if got:
                compared.aborted_with_records.append(label)
            continue
        compared.records += len(got)
        want = by_label.get(("base", label), {})
        if not got or not got.keys() >= want.keys():
            compared.missing.append(label)
        elif got != want:
            compared.different.append(label)
    return compared


async def _log_check(nats_url: str, ran: Ran) -> tuple[int, int]:
    """(acknowledged turns not in the log as answered, requests completed more than once) of ``ran``."""
    client = await connect(nats_url, name="chaos-check")
    js, cfg = client.jetstream(), LogConfig()
    gate = asyncio.Semaphore(16)

    async def events(sid: str) -> list[Any]:
        async with gate:
            return list((await read_session(js, cfg, sid)).events)

    try:
        sids = sorted({a.session_id for a in ran.acks} | set(ran.session_ids.values()))
        logs = dict(zip(sids, await asyncio.gather(*(events(s) for s in sids)), strict=True))
    finally:
        await client.close()
    lost = 0
    for ack in ran.acks:
        turns = [e for e in logs[ack.session_id] if isinstance(e, TurnCompleted) and e.request_no == ack.request_no]
        if not turns or not any((not ack.tools and t.text == ack.text) or
                                (ack.tools and tuple(c.name for c in t.tool_calls) == ack.tools) for t in turns):
            lost += 1
    duplicated = 0
    for log in logs.values():
        key_of = {e.request_no: e.idempotency_key for e in log if isinstance(e, RequestReceived)}
        done = Counter(key_of.get(e.request_no) for e in log if isinstance(e, TurnCompleted))
        duplicated += sum(count - 1 for key, count in done.items() if key is not None and count > 1)
    return lost, duplicated


def verify_all(nats_url: str) -> tuple[int, str]:
    """``rollbus replay --verify --all``: its exit status and its last line."""
    done = subprocess.run([sys.executable, "-m", "rollbus.cli", "replay", "--verify", "--all", "--nats", nats_url],
                          capture_output=True, text=True, timeout=300)
    said = [line.strip() for line in (done.stdout or done.stderr).splitlines() if line.strip()]
    return done.returncode, (said or [""])[-1]


def check(stack: ProcessStack, seed: int, base: Ran, chaos: Ran, runner: FaultRunner, ran_s: float,
          driver: ChaosDriver, mark_timeout: float = 300.0) -> Report:
    ended = [sid for ran in (base, chaos) for i, sid in ran.session_ids.items() if i in ran.ended]
    statuses, _ = asyncio.run(wait_marked(stack.nats_url, ended, mark_timeout))
    lost, duplicated = asyncio.run(_log_check(stack.nats_url, chaos))
    compared = compare_records(read_dataset(stack.data / "trajectories").to_pylist(), chaos.ended)
    faults = Counter(f"{f.component} {f.kind}" for f, _ in runner.done)
    recovery: dict[str, float] = {}
    for fault, took in runner.done:
        name = f"{fault.component} {fault.kind}"
        recovery[name] = max(recovery.get(name, 0.0), took)
    kinds = Counter(statuses.values())
    verify_exit, verify_said = verify_all(stack.nats_url)
    return Report(
        seed=seed, sessions=len(chaos.session_ids) + len(chaos.gave_up.keys() - chaos.session_ids.keys()),
        finalized=sum(s == "finalized" for s in chaos.ended.values()),
        aborted=sum(s == "aborted" for s in chaos.ended.values()),
        gave_up={f"{i // N}/{i % N}": why for i, why in {**base.gave_up, **chaos.gave_up}.items()},
        faults=dict(faults), recovery_s=recovery, turns_acknowledged=len(chaos.acks), turns_lost=lost,
        turns_duplicated=duplicated, records=compared.records, records_missing=compared.missing,
        records_duplicated=compared.duplicated, records_different=compared.different,
        aborted_with_records=compared.aborted_with_records, unmarked=len(ended) - len(statuses),
        exited=sorted(runner.exited | set(stack.exited())),
        quarantined=kinds["quarantined"],
        refused=dict(driver.refused), retried=dict(driver.retried), verify_exit=verify_exit,
        verify_said=verify_said, ran_s=ran_s)


def run(root: Path, engine_url: str, *, seed: int, sessions: int, window_s: float, faults: int,
        concurrency: int = 32, pause_s: tuple[float, float] = (2.0, 6.0), log: Callable[[str], None] = print
        ) -> Report:
    """The fault-free phase, then the faulted one over ``window_s``, through one :class:`ProcessStack` in
    ``root``; then the checks."""
    stack = ProcessStack(root, engine_url)
    try:
        log(f"stack up: edge {stack.url}, nats {stack.nats_url}, pids {stack.pids()}")
        base = asyncio.run(ChaosDriver(stack.url, stack.admin_token, concurrency=concurrency).run(
            plans(seed, sessions), "base"))
        ended = [sid for i, sid in base.session_ids.items() if i in base.ended]
        asyncio.run(wait_marked(stack.nats_url, ended, 300.0))
        log(f"base: {len(base.ended)} sessions ended, {len(base.acks)} turns, {len(base.gave_up)} given up "
            f"{list(base.gave_up.values())[:3]}; chaos over {window_s:.0f}s")
        driver = ChaosDriver(stack.url, stack.admin_token, concurrency=concurrency)
        runner = FaultRunner(stack, schedule(seed, window_s, faults, pause_s=pause_s)).start()
        started = time.monotonic()
        chaos = asyncio.run(driver.run(plans(seed, sessions, window_s), "chaos"))
        runner.join()
        ran_s = time.monotonic() - started
        log(f"chaos: {len(chaos.ended)} sessions ended, {len(runner.done)} faults in {ran_s:.0f}s; checking")
        return check(stack, seed, base, chaos, runner, ran_s, driver)
    finally:
        stack.close()

