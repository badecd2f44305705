"""Fixtures for end-to-end tests: a scripted SGLang engine and a full stack in front of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.runtime import StackOptions
from tests.stack import StackThread

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture
def engine() -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer() as server:
        yield server


@pytest.fixture
def make_stack(nats_server: EmbeddedNats, log_config: LogConfig, engine: ScriptedEngineServer,
               tmp_path) -> Iterator[Callable[..., StackThread]]:
    """Start a stack in front of the scripted engine, with ``StackOptions`` overrides."""
    started: list[StackThread] = []

    def start(**overrides: Any) -> StackThread:
        options = StackOptions(port=0, data_dir=tmp_path / f"data{len(started)}", nats_url=nats_server.url,
                               engine="sglang", engine_urls=(engine.url,), admin_token=ADMIN_TOKEN, log=log_config,
                               **{"max_trajectory_length": 4096, **overrides})
        started.append(StackThread(options).start())
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def stack(make_stack: Callable[..., StackThread]) -> StackThread:
    return make_stack()
