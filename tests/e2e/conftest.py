"""Fixtures for end-to-end tests: a scripted SGLang engine and a full stack in front of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edge.codec.tokenizer import Tokenizer, load_tokenizer
from edge.engines.scripted import ScriptedEngineServer
from rollbus.nats_server import EmbeddedNats
from rollbus.runtime import StackOptions
from schemas.log import LogConfig
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
def stack(nats_server: EmbeddedNats, log_config: LogConfig, engine: ScriptedEngineServer,
          tmp_path) -> Iterator[StackThread]:
    options = StackOptions(port=0, data_dir=tmp_path / "data", nats_url=nats_server.url, engine="sglang",
                           engine_urls=(engine.url,), admin_token=ADMIN_TOKEN, log=log_config,
                           max_trajectory_length=4096)
    running = StackThread(options).start()
    yield running
    running.stop()
