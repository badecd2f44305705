"""In-process edges for recovery tests: real JetStream, real leases, a scripted SGLang server,
and a clock the test moves (so lease expiry and idle timeouts need no sleeping)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from edge.engines.sglang import SGLangEngine
from edge.service import EdgeService, OpenSession
from edge.settings import EdgeSettings
from edge.tokens.tokenizer import Tokenizer
from edge.turns import TurnOutcome, TurnRequest
from edge.wires.openai import decode_request
from rollbus.testing.scripted import ScriptedReply
from schemas.log import LogConfig
from stack.runtime import build_edge_service

IM_END = 151645


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def responder(tokenizer: Tokenizer):
    """Deterministic replies: the reply depends only on the engine's input."""

    def reply(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        text = f"reply to {len(input_ids)} tokens ending {input_ids[-1]}"
        return ScriptedReply(token_ids=[*tokenizer.encode(text), IM_END])

    return reply


def make_edge(nc, cfg: LogConfig, engine_url: str, *, edge_id: str, clock: Callable[[], float], ttl: float = 10.0,
              idle: float = 3600.0) -> EdgeService:
    settings = EdgeSettings(edge_id=edge_id, lease_ttl_s=ttl, idle_timeout_s=idle, log=cfg, max_trajectory_length=4096)
    return build_edge_service(settings, nc, SGLangEngine([engine_url]), clock=clock)


@contextlib.asynccontextmanager
async def edges(nc, cfg: LogConfig, engine_url: str, clock: Callable[[], float], *ids: str,
                **opts: Any) -> AsyncIterator[list[EdgeService]]:
    """Edge services with the given ids (one each), their engine clients closed at the end."""
    made = [make_edge(nc, cfg, engine_url, edge_id=edge_id, clock=clock, **opts) for edge_id in ids]
    try:
        yield made
    finally:
        for edge in made:
            await edge._turns._engine.aclose()


class Agent:
    """One conversation, driven through an edge service the way a route would."""

    def __init__(self, session_id: str, api_key: str) -> None:
        self.session_id = session_id
        self.api_key = api_key
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]

    @classmethod
    async def open(cls, edge: EdgeService, uid: str | None = None) -> Agent:
        """``uid`` None: a fresh one (one session per (uid, session_index): several agents may open)."""
        opened = await edge.open_session(OpenSession(uid=uid))
        return cls(opened.session_id, opened.api_key)

    def request(self, user: str | None, *, key: str | None = None, retries: int = 0) -> TurnRequest:
        if user is not None:
            self.messages.append({"role": "user", "content": user})
        body = json.dumps({"model": "m", "messages": self.messages}).encode()
        return TurnRequest(conversation=decode_request(body), wire="openai", body=body, idempotency_key=key,
                           retry_count=retries)

    async def send(self, edge: EdgeService, request: TurnRequest) -> TurnOutcome:
        outcome = await edge.complete(await edge.authorize(self.session_id, self.api_key), request)
        return outcome

    def heard(self, outcome: TurnOutcome) -> None:
        self.messages.append({"role": "assistant", "content": outcome.content})

    async def turn(self, edge: EdgeService, user: str, **opts: Any) -> TurnOutcome:
        outcome = await self.send(edge, self.request(user, **opts))
        self.heard(outcome)
        return outcome
