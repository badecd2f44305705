"""Long-horizon sessions: 300 turns through the official SDKs, history resent every turn, with
~4 KB tool results and a 1M-token trajectory length; and one 3 MB tool result.

Each session must end as one token-exact record, ``rollbus replay --verify`` must pass, every
raw request must be rebuilt byte for byte from the log, and what the log stores of the raw
requests must grow with what each turn adds, not with the history it resends.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import numpy as np
import pytest
from openai import OpenAI

from rollbus.cli import build_parser
from rollbus.commands.replay import replay_main
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from schemas import bodies
from schemas.events import RequestReceived
from schemas.log import HDR_BLOBS
from tests.e2e.test_openai_session import open_session, wait_for_parquet
from tests.stack import StackThread

TURNS = 300
IM_END = 151645
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file of the repository.",
                    "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]
WORDS = ("self", "value", "result", "index", "count", "items", "config", "path", "name", "data", "request",
         "response", "error", "token", "chain", "session", "event", "buffer", "stream", "record", "batch", "limit")


def tool_result(turn: int, size: int = 4096) -> str:
    """A distinct ~``size``-byte tool result (numbered source-like lines)."""
    rng = random.Random(turn)
    lines = []
    while sum(map(len, lines)) < size:
        lines.append(f"{rng.randint(1, 9999):5d}  {' '.join(rng.choice(WORDS) for _ in range(6))}()\n")
    return "".join(lines)[:size]


@pytest.fixture
def engine() -> Iterator[ScriptedEngineServer]:
    """This module's engine (what ``make_stack`` starts in front of) keeps only its last request:
    each request of a long session carries the whole context."""
    with ScriptedEngineServer(keep_requests=1) as server:
        yield server


@pytest.fixture
def long_engine(engine: ScriptedEngineServer) -> ScriptedEngineServer:
    return engine


@pytest.fixture
def long_stack(make_stack: Callable[..., StackThread]) -> StackThread:
    return make_stack(max_trajectory_length=1_000_000)


class Recorder:
    """The raw bodies the SDK sent, as they left the client."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def client(self, library: Any = httpx) -> Any:
        """An HTTP client of ``library`` (the anthropic SDK brings its own fork, ``httpx2``)."""
        return library.Client(event_hooks={"request": [lambda request: self.bodies.append(request.read())]},
                              timeout=120.0)


def scripted(tokenizer, text: str) -> ScriptedReply:
    ids = [*tokenizer.encode(text), IM_END]
    return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))


def call_text(turn: int) -> str:
    return f'<tool_call>\n{{"name": "read_file", "arguments": {{"path": "src/module_{turn}.py"}}}}\n</tool_call>'


def run_openai(session: dict, engine: ScriptedEngineServer, tokenizer, recorder: Recorder) -> list[ScriptedReply]:
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0,
                    http_client=recorder.client())
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."},
                            {"role": "user", "content": "Read every module and summarize."}]
    replies = []
    for turn in range(TURNS):
        replies.append(scripted(tokenizer, call_text(turn)))
        engine.push(replies[-1])
        choice = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS).choices[0]
        assert choice.finish_reason == "tool_calls", (turn, choice)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                         "content": tool_result(turn)})
    replies.append(scripted(tokenizer, "All modules are read."))
    engine.push(replies[-1])
    final = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    assert final.choices[0].message.content == "All modules are read."
    return replies


def run_anthropic(session: dict, engine: ScriptedEngineServer, tokenizer, recorder: Recorder) -> list[ScriptedReply]:
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0,
                                 http_client=recorder.client(httpx2))
    messages: list[dict] = [{"role": "user", "content": "Read every module and summarize."}]
    replies = []
    for turn in range(TURNS):
        replies.append(scripted(tokenizer, call_text(turn)))
        engine.push(replies[-1])
        reply = client.messages.create(model="m", max_tokens=256, system="You are a coding agent.",
                                       messages=messages, tools=ANTHROPIC_TOOLS)
        assert reply.stop_reason == "tool_use", (turn, reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        use = next(b for b in reply.content if b.type == "tool_use")
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": tool_result(turn)}]})
    replies.append(scripted(tokenizer, "All modules are read."))
    engine.push(replies[-1])
    final = client.messages.create(model="m", max_tokens=256, system="You are a coding agent.", messages=messages,
                                   tools=ANTHROPIC_TOOLS)
    assert final.content[0].text == "All modules are read."
    return replies


async def _replay_verify(stack: StackThread, session_id: str) -> int:
    import nats

    nc = await nats.connect(stack.nats_url)
    try:
        args = build_parser().parse_args(["replay", "--verify", session_id, "--nats", stack.nats_url])
        return await replay_main(nc.jetstream(), stack.options.log, args)
    finally:
        await nc.close()


def check_session(stack: StackThread, engine: ScriptedEngineServer, session: dict, replies: list[ScriptedReply],
                  sent: list[bytes]) -> None:
    session_id = session["session_id"]
    final = httpx.post(f"{stack.url}/sessions/{session_id}/finalize", headers=stack.admin, timeout=60).json()
    assert final["trajectories"] == 1
    (row,) = wait_for_parquet(stack.trajectories, session_id, timeout=120)

    # Token-exact: the sampled tokens are the scripted replies, in order, each with its log probs,
    # and the engine's last request saw exactly the stored tokens.
    ids = np.array(row["input_ids"])
    mask = np.array(row["response_mask"], dtype=bool)
    responses = np.array(row["responses"])
    assert responses[mask].tolist() == [t for r in replies for t in r.token_ids]
    np.testing.assert_allclose(np.array(row["rollout_log_probs"])[mask],
                               [lp for r in replies for lp in r.logprobs], rtol=1e-6)
    last_input = engine.requests[-1]["input_ids"]
    assert ids[: len(last_input)].tolist() == last_input

    # Every raw request is rebuilt from the log byte for byte, and the log stored each body's new part only.
    events = stack.events(session_id)
    requests = [e for e in events if isinstance(e, RequestReceived)]
    rebuilt = bodies.rebuild(events)
    assert [rebuilt.body(r.request_no) for r in requests] == sent
    assert all(rebuilt.verify(r.request_no) for r in requests)
    stored = sum(len(p.data) for r in requests for p in r.parts)
    assert stored < 1.2 * len(sent[-1]), (stored, len(sent[-1]), sum(map(len, sent)))

    assert asyncio.run(_replay_verify(stack, session_id)) == 0


def test_a_300_turn_openai_session_is_exact_and_its_log_linear(long_stack, long_engine, tokenizer):
    session = open_session(long_stack, uid="long1")
    recorder = Recorder()
    replies = run_openai(session, long_engine, tokenizer, recorder)
    check_session(long_stack, long_engine, session, replies, recorder.bodies)


def test_a_300_turn_anthropic_session_is_exact_and_its_log_linear(long_stack, long_engine, tokenizer):
    session = open_session(long_stack, uid="long2")
    recorder = Recorder()
    replies = run_anthropic(session, long_engine, tokenizer, recorder)
    check_session(long_stack, long_engine, session, replies, recorder.bodies)


def test_a_3mb_tool_result_is_accepted_and_rebuilt(long_stack, long_engine, tokenizer):
    session = open_session(long_stack, uid="big")
    recorder = Recorder()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0,
                    http_client=recorder.client())
    line = "the quick brown fox jumps over the lazy dog, and then the dog sleeps under the old tree.\n"
    big = line * (3 * 1024 * 1024 // len(line) + 1)  # ~700k tokens
    assert len(big) > 3_000_000
    long_engine.push(scripted(tokenizer, call_text(0)), scripted(tokenizer, "Read."))
    messages: list[dict] = [{"role": "user", "content": "Read the log."}]
    choice = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS).choices[0]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": big}]
    final = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    assert final.choices[0].message.content == "Read."

    events = long_stack.events(session["session_id"])
    rebuilt = bodies.rebuild(events)
    assert [rebuilt.body(e.request_no) for e in events if isinstance(e, RequestReceived)] == recorder.bodies
    assert asyncio.run(_has_blobs(long_stack, session["session_id"]))  # the large pieces went to the object store
    final_session = httpx.post(f"{long_stack.url}/sessions/{session['session_id']}/finalize",
                               headers=long_stack.admin, timeout=60).json()
    assert final_session["trajectories"] == 1
    (row,) = wait_for_parquet(long_stack.trajectories, session["session_id"], timeout=120)
    assert tokenizer.decode(row["input_ids"]).count("the quick brown fox") == big.count("the quick brown fox")
    assert asyncio.run(_replay_verify(long_stack, session["session_id"])) == 0


async def _has_blobs(stack: StackThread, session_id: str) -> bool:
    import nats

    nc = await nats.connect(stack.nats_url)
    try:
        js = nc.jetstream()
        cfg = stack.options.log
        found = False
        sub = await js.subscribe(cfg.session_filter(session_id), ordered_consumer=True, stream=cfg.stream)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=2)
                except nats.errors.TimeoutError:
                    break
                found = found or bool(msg.headers and HDR_BLOBS in msg.headers)
        finally:
            await sub.unsubscribe()
        return found
    finally:
        await nc.close()
