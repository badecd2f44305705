"""The agent and the engine script of ``adapter_overhead.py``, importable by name
(``runner_fqn: ops.bench.adapter_runner.eight_turns``).

- :func:`eight_turns`: an agent runner (the adapter's runner signature): the conversation goes
  through the official ``openai`` AsyncOpenAI SDK to the session's ``base_url`` until the model
  answers without a tool call, a tool result appended after every tool call; then the reward
  is posted to ``reward_url``. It raises when the session took another number of turns than
  ``tools_kwargs["turns"]`` (so a broken script is a failed session, not a fast one).
- :func:`responder`: the scripted SGLang engine's replies: a tool call while the context holds
  fewer than ``turns - 1`` tool results, then the final answer.
- ``python -m ops.bench.adapter_runner --turns 8``: serves a :class:`ScriptedEngineServer`
  with that responder on a free port of 127.0.0.1, prints its URL, and serves until its
  standard input is closed (the benchmark holds the other end: the engine dies with it).

Every session of one event loop shares one HTTP connection pool (``http_client``): the SDK's
own per-client pool would cost each session a new client and new connections, the same in
both of the benchmark's modes, and hide what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a range of lines from a file in the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                    "end": {"type": "integer"}}, "required": ["path"]}}}]
SYSTEM = "You are a software engineering agent. Call one tool per turn; when done, answer in one sentence."
TOOL_RESULT = ("  41  def parse_body(raw: bytes) -> dict:\n  42      data = json.loads(raw)\n"
               "  43      return data")
CALL = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app/main.py", "start": 1, "end": 80}}\n'
        '</tool_call>')
ANSWER = "The body is parsed in parse_body; it now returns 400 on an empty body."
IM_END = 151645  # Qwen2.5's <|im_end|>
TOOL_RESPONSE = 151665  # Qwen2.5's <tool_response> (one added token)

_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def _http() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = DefaultAsyncHttpxClient(
            timeout=120.0, limits=httpx.Limits(max_connections=2048, max_keepalive_connections=2048,
                                               keepalive_expiry=2.0))  # under the edge's 5 s keep-alive
    return client


async def close_clients() -> None:
    """Close this loop's shared pool (call on the loop the runners ran on)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def eight_turns(*, session: Any, raw_prompt: list[dict[str, Any]], sample_index: int,
                      tools_kwargs: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
    expected = int((tools_kwargs or {}).get("turns", 8))
    http = _http()
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, http_client=http)
    messages = list(raw_prompt)
    turns = 0
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        turns += 1
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        if turns >= expected:
            raise RuntimeError(f"session {session.session_id}: still calling tools after {turns} turns")
        messages += [{"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT} for call in message.tool_calls]
    if turns != expected:
        raise RuntimeError(f"session {session.session_id}: answered after {turns} turns, expected {expected}")
    answer = await http.post(session.reward_url, json={"reward_info": {"reward": 1.0, "turns": turns}},
                             headers={"Authorization": f"Bearer {session.api_key}"})
    answer.raise_for_status()
    return {"reward": 1.0, "turns": turns}


def responder(turns: int) -> Any:
    """Replies by the number of tool results in the context: a tool call, until ``turns - 1`` of them."""
    from edge.tokens.tokenizer import load_tokenizer
    from rollbus.testing.scripted import ScriptedReply

    tokenizer = load_tokenizer("builtin:qwen2.5")
    call = ScriptedReply(token_ids=[*tokenizer.encode(CALL), IM_END])
    answer = ScriptedReply(token_ids=[*tokenizer.encode(ANSWER), IM_END])

    def reply(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        return answer if input_ids.count(TOOL_RESPONSE) >= turns - 1 else call

    return reply


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from rollbus.testing.scripted import ScriptedEngineServer

    parser = argparse.ArgumentParser(description="a scripted SGLang engine for adapter_overhead.py")
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    server = ScriptedEngineServer(responder=responder(args.turns))
    server.requests = collections.deque(maxlen=16)  # type: ignore[assignment] # not every body of the run
    print(server.start(), flush=True)
    try:
        sys.stdin.read()  # until the benchmark closes it (or exits)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
