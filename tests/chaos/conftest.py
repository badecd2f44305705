"""The chaos suite's engine: a scripted SGLang engine answering as a step's model does
(:func:`rollbus.testing.burst.tool_responder`: a call of ``add``, then the answer), so a retried or
replayed turn, and the same session in another run, gets the same tokens; and ``private``, a
nats-server of the test's own that it may pause (``tests/integration/test_log_outage.py``'s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.burst import tool_responder
from rollbus.testing.scripted import ScriptedEngineServer
from tests.integration.test_log_outage import private  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def tool_engine() -> Iterator[ScriptedEngineServer]:
    tokenizer = load_tokenizer("builtin:qwen2.5")
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    with ScriptedEngineServer(responder=responder, keep_requests=4) as engine:
        yield engine
