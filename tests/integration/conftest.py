"""Fixtures of the edge recovery and idle tests (modules that mean another engine or tokenizer
define their own, which take precedence)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer
from tests.integration.edges import responder


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture
def engine(tokenizer: Tokenizer) -> Iterator[ScriptedEngineServer]:
    """A scripted SGLang server whose replies depend only on their input."""
    with ScriptedEngineServer(responder=responder(tokenizer)) as server:
        yield server
