"""The edge's own cost per model turn, per wire and mode, through the real ASGI app.

Every turn goes through the whole edge (HTTP decode, chain selection, incremental
encoding, reply parsing, drafting and envelope encoding, the wire's answer) with the
two pieces of I/O replaced by instant in-process stand-ins: an engine that replays
scripted tokens (in chunks of 4 when streaming) and a log that encodes envelopes and
acknowledges them. So the numbers are the edge's CPU per turn, not the engine's or NATS'.

Modes: ``openai`` (plain, the baseline), ``openai-stream``, ``anthropic``,
``anthropic-stream``; each session is a 3-turn tool conversation. Ratios are against
``openai`` measured in the same run. ``--baseline-tree PATH`` also runs ``openai`` with
the code at PATH (e.g. main's checkout) in a subprocess, and prints this tree's ratio
to it. Modes (and the baseline) run in interleaved rounds; each prints its best round,
the least disturbed by whatever else the machine is doing.

    python ops/bench/wire_turns.py --sessions 100 --rounds 5 --baseline-tree ../main
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from edge.app import create_app
from edge.codec.incremental import TemplateCodec
from edge.codec.parsers import make_parser
from edge.codec.tokenizer import load_tokenizer
from edge.engines.base import GenerateChunk, GenerateRequest, GenerateResult
from edge.live import Registry
from edge.service import EdgeService, OpenSession
from edge.settings import EdgeSettings
from edge.turns import TurnRunner
from eventlog.publisher import Appended
from schemas import envelope

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
REPLIES = ['Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
           '<tool_call>\n{"name": "calculator", "arguments": {"expression": "42+0"}}\n</tool_call>',
           "The answer is 42. " * 8]
MODES = ("openai", "openai-stream", "anthropic", "anthropic-stream")


class MemoryLog:
    async def append(self, session_id: str, events: Any, expected_last: int) -> Appended:
        envelope.encode(events)
        return Appended(stream="mem", stream_seq=expected_last + 1, duplicate=False, envelopes=1)


class ReplayEngine:
    """Answers each request with the reply for its turn, at once."""

    name = "replay"

    def __init__(self, replies: list[list[int]]) -> None:
        self._replies = replies
        self._turn: dict[str, int] = {}

    def _ids(self, request: GenerateRequest) -> list[int]:
        session = request.request_id.rsplit(":", 1)[0]
        turn = self._turn.get(session, 0)
        self._turn[session] = turn + 1
        return self._replies[turn % len(self._replies)]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ids = tuple(self._ids(request))
        return GenerateResult(token_ids=ids, logprobs=tuple(-0.1 for _ in ids), finish_reason="stop")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        ids = tuple(self._ids(request))
        for start in range(0, len(ids), 4):
            yield GenerateChunk(token_ids=ids[start:start + 4], logprobs=tuple(-0.1 for _ in ids[start:start + 4]))
        yield GenerateResult(token_ids=ids, logprobs=tuple(-0.1 for _ in ids), finish_reason="stop")

    async def aclose(self) -> None:
        return None


def _build() -> tuple[EdgeService, Any]:
    tokenizer = load_tokenizer("builtin:qwen2.5")
    replies = [[*tokenizer.encode(text), tokenizer.eos_token_id] for text in REPLIES]
    settings = EdgeSettings()
    codec = TemplateCodec(tokenizer)
    log = MemoryLog()

    async def missing(session_id: str) -> Any:
        raise KeyError(session_id)

    turns = TurnRunner(settings=settings, codec=codec, engine=ReplayEngine(replies), log=log,
                       parser=make_parser("hermes"))
    service = EdgeService(settings=settings, registry=Registry(missing), log=log, turns=turns)
    return service, create_app(service)


def _assistant_openai(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body["choices"][0]["message"].items() if v is not None}


async def _openai_session(client: httpx.AsyncClient, base: str, key: str, stream: bool) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
    for _ in REPLIES:
        body = {"model": "m", "messages": messages, "tools": TOOLS, "stream": stream}
        response = await client.post(f"{base}/v1/chat/completions", json=body, headers={"x-api-key": key})
        message = _accumulate_openai(response.text) if stream else _assistant_openai(response.json())
        messages.append(message)
        for call in message.get("tool_calls", ()):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})


def _accumulate_openai(text: str) -> dict[str, Any]:
    content, calls = [], {}
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls", ()):
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call["function"].get("name") or ""
                entry["function"]["arguments"] += call["function"].get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


async def _anthropic_session(client: httpx.AsyncClient, base: str, key: str, stream: bool) -> None:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
    for _ in REPLIES:
        body = {"model": "m", "max_tokens": 1024, "messages": messages, "tools": tools, "stream": stream}
        response = await client.post(f"{base}/v1/messages", json=body, headers={"x-api-key": key})
        blocks = _accumulate_anthropic(response.text) if stream else response.json()["content"]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in blocks if b["type"] == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u["id"], "content": "42"} for u in uses]})


def _accumulate_anthropic(text: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
    return blocks


async def measure(mode: str, sessions: int) -> float:
    """Seconds per turn for ``sessions`` 3-turn sessions run one after another."""
    service, app = _build()
    drive = _openai_session if mode.startswith("openai") else _anthropic_session
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        opened = [await service.open_session(OpenSession()) for _ in range(sessions + 5)]
        for warm in opened[:5]:
            await drive(client, f"/sessions/{warm.session_id}", warm.api_key, mode.endswith("stream"))
        started = time.perf_counter()
        for session in opened[5:]:
            await drive(client, f"/sessions/{session.session_id}", session.api_key, mode.endswith("stream"))
        return (time.perf_counter() - started) / (sessions * len(REPLIES))


def _baseline(tree: str, sessions: int) -> float:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, __file__, "--sessions", str(sessions), "--modes", "openai", "--raw"],
                         env=env, capture_output=True, text=True, check=True, cwd=os.path.abspath(tree))
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--baseline-tree", help="also time 'openai' with the code in this tree")
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        print(asyncio.run(measure(args.modes[0], args.sessions)))
        return
    rounds: dict[str, list[float]] = {mode: [] for mode in args.modes}
    baseline: list[float] = []
    for _ in range(args.rounds):
        for mode in args.modes:
            rounds[mode].append(asyncio.run(measure(mode, args.sessions)))
        if args.baseline_tree:
            baseline.append(_baseline(args.baseline_tree, args.sessions))
    best = {mode: min(times) for mode, times in rounds.items()}
    base = best.get("openai")
    print(f"edge cost per turn ({args.sessions} sessions x {len(REPLIES)} turns, instant engine and log, "
          f"best of {args.rounds} rounds)")
    for mode, seconds in best.items():
        ratio = f"  x{seconds / base:.2f} vs openai" if base else ""
        print(f"  {mode:18s} {seconds * 1e6:8.0f} us{ratio}")
    if baseline and base:
        other = min(baseline)
        print(f"  openai @ {args.baseline_tree}: {other * 1e6:.0f} us; this tree x{base / other:.2f}")


if __name__ == "__main__":
    main()
