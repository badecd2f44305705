"""Fixtures of the agent compatibility suite: the pinned agents, installed on first use (those of every
selected test at once, in parallel: ``pytest.mark.agent(NAME)`` names a test's agent); one
``rollbus up`` (a real process) in front of one scripted SGLang engine whose model is a
:class:`~rollbus.testing.tool_user.ToolUser`, shared by the suite's tests (which run one at a time);
``start_up`` starts another in front of the same engine, with options of its own (another chat template).

An agent that cannot be installed skips its tests with the reason, unless ``ROLLBUS_REQUIRE_AGENTS=1``
(``.ci/run`` sets it), when they fail.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer
from rollbus.testing.tool_user import Call, Encoding, Policy, ToolUser
from tests.agents import exact
from tests.agents.install import INSTALL_TIMEOUT_S, InstallFailed, cache_root, install
from tests.agents.pins import PINS
from tests.agents.run import AGENT_TIMEOUT_S
from tests.e2e.test_cli import Up

# Claude Code's first prompt is some 19k tokens (its tools' schemas).
MAX_TRAJECTORY_LENGTH = 40960


class Installs:
    """Each pinned agent installed at most once a pytest run, on threads (pip and npm mostly wait on the
    network); a failure kept as its reason."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=len(PINS), thread_name_prefix="agent-install")
        self._futures: dict[str, Future[tuple[Path, float | None]]] = {}

    def start(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._futures:
                self._futures[name] = self._pool.submit(install, PINS[name], cache_root())

    def get(self, name: str) -> Path:
        """The agent's executable; the test skips (fails, with ``ROLLBUS_REQUIRE_AGENTS=1``) when it cannot be
        installed."""
        self.start([name])
        try:
            return self._futures[name].result()[0]
        except InstallFailed as exc:
            if os.environ.get("ROLLBUS_REQUIRE_AGENTS") == "1":
                pytest.fail(f"ROLLBUS_REQUIRE_AGENTS=1 but {exc}")
            pytest.skip(str(exc))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def agent_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("agent")
    return marker.args[0] if marker is not None else None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "agent(name): the pinned agent program (tests/agents/pins.py) a test runs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """An agent's test may wait for its install (minutes, cold) before it runs the agent."""
    for item in items:
        if agent_of(item) is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(INSTALL_TIMEOUT_S + 2 * AGENT_TIMEOUT_S))


@pytest.fixture(scope="session")
def installs(request: pytest.FixtureRequest) -> Iterator[Installs]:
    """Starts installing the agents of every selected test."""
    pending = Installs()
    pending.start(dict.fromkeys(name for item in request.session.items if (name := agent_of(item))))
    yield pending
    pending.close()


@pytest.fixture
def agent(installs: Installs, request: pytest.FixtureRequest) -> Path:
    """The executable of the test's agent (``pytest.mark.agent``): its virtualenv's Python, or its binary."""
    name = agent_of(request.node)
    assert name in PINS, f"{request.node.nodeid}: pytest.mark.agent names none of {sorted(PINS)}"
    return installs.get(name)


class RunningUp(Up):
    """``rollbus up`` with its data directory and the admin header at hand."""

    def __init__(self, data_dir: Path, engine_url: str, *args: str) -> None:
        self.data_dir = data_dir
        super().__init__(data_dir, engine_url, *args)
        self.admin = {"Authorization": "Bearer tok"}


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture(scope="session")
def model(tokenizer: Tokenizer) -> ToolUser:
    return ToolUser(Encoding(encode=tokenizer.encode, decode=tokenizer.decode, end_id=tokenizer.eos_token_id))


@pytest.fixture(scope="session")
def engine(model: ToolUser) -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(responder=model) as server:
        yield server


@pytest.fixture(scope="session")
def start_up(engine: ScriptedEngineServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RunningUp]]:
    """Start a ``rollbus up`` in front of the suite's engine, with these options besides the suite's; each
    is stopped (and must exit 0) when the suite ends."""
    started: list[RunningUp] = []

    def start(*options: str) -> RunningUp:
        started.append(RunningUp(tmp_path_factory.mktemp("agents") / "data", engine.url, "--log-level", "WARNING",
                                 "--max-trajectory-length", str(MAX_TRAJECTORY_LENGTH), "--batch-delay", "0.05",
                                 *options))
        return started[-1]

    yield start
    for running in started:
        assert running.stop() == 0, "".join(running.lines[-50:])


@pytest.fixture(scope="session")
def up(start_up: Callable[..., RunningUp]) -> RunningUp:
    """The suite's ``rollbus up``."""
    return start_up()


@dataclass
class AgentSession:
    """One agent's session on the shared stack: the engine requests it causes are those made after
    :attr:`first` (tests run one at a time)."""

    up: RunningUp
    engine: ScriptedEngineServer
    model: ToolUser
    session: dict[str, str]
    first: int
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def turns(self) -> list[Any]:
        return self.model.turns[self.first:]

    @property
    def called(self) -> list[str]:
        return [turn.tool for turn in self.turns if turn.tool is not None]

    def check(self, chains: int = 1) -> list[dict[str, Any]]:
        """Finalize the session and assert its records are token-exact (:mod:`tests.agents.exact`)."""
        session_id = self.session["session_id"]
        assert exact.finalize(self.up.url, self.up.admin, session_id) == chains
        rows = exact.wait_rows(self.up.data_dir / "trajectories", session_id, chains)
        inputs = [list(request["input_ids"]) for request in list(self.engine.requests)[self.first:]]
        exact.check_records(rows, inputs, self.model.replies[self.first:])
        exact.replay_verify(self.up.data_dir, session_id)
        return rows


@pytest.fixture
def agent_session(up: RunningUp, engine: ScriptedEngineServer, model: ToolUser,
                  tmp_path: Path) -> Callable[..., AgentSession]:
    """Open a session for an agent (on the suite's ``rollbus up``, or ``on`` another of :func:`start_up`),
    the model reset (:meth:`ToolUser.reset`); a work directory and an environment with nothing but
    ``PATH`` and ``HOME`` (of its own), which the test adds the session's URL and key to."""

    def start(uid: str, answer: str, prefer: Sequence[str] = (), finish: Call | None = None,
              policy: Policy | None = None, on: RunningUp | None = None) -> AgentSession:
        stack = on or up
        created = httpx.post(f"{stack.url}/sessions", json={"uid": uid, "metadata": {"agent_name": uid}},
                             headers=stack.admin, timeout=30)
        assert created.status_code == 201, created.text
        model.reset(answer, prefer, finish, policy)
        home, work = tmp_path / uid / "home", tmp_path / uid / "work"
        home.mkdir(parents=True)
        work.mkdir()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home)}
        return AgentSession(stack, engine, model, created.json(), len(model.replies), work, env)

    return start
