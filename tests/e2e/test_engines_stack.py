"""Engines behind a real stack, driven with the OpenAI SDK: several SGLang servers (placement,
stickiness, failover), vLLM and verl failures in the agent's wire shape, the weight version and
the sampling allowlist in the log."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from edge.tokens.tokenizer import Tokenizer
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, ScriptedServer, default_logprobs
from rollbus.testing.scripted_vllm import ScriptedVLLMServer
from schemas.events import EngineFailed, TurnCompleted
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.runtime import StackOptions
from tests.e2e.conftest import ADMIN_TOKEN
from tests.stack import StackThread

IM_END = 151645


def reply(tokenizer: Tokenizer, text: str, **kwargs: object) -> ScriptedReply:
    ids = [*tokenizer.encode(text), IM_END]
    return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)), **kwargs)  # type: ignore[arg-type]


def open_session(stack: StackThread, **body: object) -> dict:
    response = httpx.post(f"{stack.url}/sessions", json=body, headers=stack.admin)
    assert response.status_code == 201, response.text
    return response.json()


def ask(session: dict, messages: list[dict], **extra: object) -> httpx.Response:
    return httpx.post(f"{session['base_url']}/chat/completions", json={"model": "m", "messages": messages, **extra},
                      headers={"Authorization": f"Bearer {session['api_key']}"}, timeout=60)


def eventually(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def sessions_on(server: ScriptedServer) -> list[str]:
    return [body["rid"].split(":")[0] for body in server.requests]


def start(nats: EmbeddedNats, log: LogConfig, tmp: Path, engine: str, urls: tuple[str, ...],
          **options: object) -> StackThread:
    return StackThread(StackOptions(port=0, data_dir=tmp / "data", nats_url=nats.url, engine=engine, engine_urls=urls,
                                    admin_token=ADMIN_TOKEN, log=log, max_trajectory_length=4096,
                                    **options)).start()  # type: ignore[arg-type]


@pytest.fixture
def two_servers(tokenizer: Tokenizer) -> Iterator[tuple[ScriptedEngineServer, ScriptedEngineServer]]:
    def responder(ids: list[int], body: dict) -> ScriptedReply:
        return reply(tokenizer, "fine")

    with ScriptedEngineServer(responder=responder) as a, ScriptedEngineServer(responder=responder) as b:
        yield a, b


def test_two_sglang_servers_placement_stickiness_and_failover(nats_server, log_config, tmp_path, two_servers):
    a, b = two_servers
    stack = start(nats_server, log_config, tmp_path, "sglang", (a.url, b.url), health_interval=0.1)
    try:
        pool = stack.stack._engine.pool  # type: ignore[union-attr]
        s1, s2, s3 = (open_session(stack) for _ in range(3))
        history = [{"role": "user", "content": "hi"}]
        for session in (s1, s2, s3):  # placement: new sessions spread over the servers
            assert ask(session, history).status_code == 200
        assert sessions_on(a) == [s1["session_id"], s3["session_id"]] and sessions_on(b) == [s2["session_id"]]
        follow_up = [*history, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "more"}]
        for session in (s1, s2, s3):  # stickiness: each session stays on its server
            assert ask(session, follow_up).status_code == 200
        assert sessions_on(a) == [s1["session_id"], s3["session_id"]] * 2 and sessions_on(b) == [s2["session_id"]] * 2

        b.down()  # failover: b refuses connections and fails its health probes
        eventually(lambda: not pool.is_healthy(b.url))
        s4 = open_session(stack)
        assert ask(s4, history).status_code == 200  # b has the fewest sessions, but is down
        later = [*follow_up, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "again"}]
        assert ask(s2, later).status_code == 200  # s2's server is down: re-placed on a, no error
        assert sessions_on(a)[-2:] == [s4["session_id"], s2["session_id"]] and len(b.requests) == 2
        moved = a.requests[-1]["input_ids"]
        assert moved[: len(b.requests[-1]["input_ids"])] == b.requests[-1]["input_ids"]  # the whole chain came along

        b.up()  # back: probed healthy, it takes new sessions again
        eventually(lambda: pool.is_healthy(b.url))
        s5 = open_session(stack)
        assert ask(s5, history).status_code == 200
        assert sessions_on(b)[-1] == s5["session_id"]
    finally:
        stack.stop()


def test_the_weight_version_reaches_the_turn_event(stack, engine, tokenizer):
    session = open_session(stack)
    engine.push(reply(tokenizer, "hello", weight_version="global_step_17"))
    assert ask(session, [{"role": "user", "content": "hi"}]).status_code == 200
    (turn,) = [e for e in stack.events(session["session_id"]) if isinstance(e, TurnCompleted)]
    assert turn.weight_version == "global_step_17" and turn.finish_reason == "stop"


def test_only_allowlisted_sampling_reaches_the_engine_with_session_defaults_and_a_clamp(stack, engine, tokenizer):
    session = open_session(stack, sampling={"temperature": 0.3, "top_k": 5, "max_tokens": 7, "stop": ["END"]})
    engine.push(reply(tokenizer, "a"), reply(tokenizer, "b"))
    history = [{"role": "user", "content": "hi"}]
    response = ask(session, history, top_p=0.5, seed=3, frequency_penalty=1.0, presence_penalty=0.5)
    assert response.status_code == 200, response.text
    first = engine.requests[-1]["sampling_params"]
    assert first == {"max_new_tokens": 7, "temperature": 0.3, "top_p": 0.5, "top_k": 5, "stop": ["END"],
                     "stop_token_ids": list(tokenizer.stop_token_ids), "skip_special_tokens": False,
                     "no_stop_trim": True}
    more = [*history, {"role": "assistant", "content": "a"}, {"role": "user", "content": "go"}]
    assert ask(session, more, max_tokens=100_000, temperature=0.9, stop="STOP").status_code == 200
    second = engine.requests[-1]
    room = 4096 - len(second["input_ids"])  # the stack's max_trajectory_length minus what the chain holds
    assert second["sampling_params"]["max_new_tokens"] == room
    assert (second["sampling_params"]["temperature"], second["sampling_params"]["stop"]) == (0.9, ["STOP"])


@pytest.fixture
def vllm_server() -> Iterator[ScriptedVLLMServer]:
    with ScriptedVLLMServer() as server:
        yield server


@pytest.mark.parametrize(("fault", "status", "code"), [
    ({"fault": "http_503"}, 503, "engine_unavailable"),
    ({"delay_s": 3.0}, 504, "engine_timeout"),
    ({"fault": "malformed_json"}, 502, "engine_error"),
    ({"logprobs": [-0.1]}, 502, "engine_error"),
])
def test_vllm_failures_are_clear_errors_recorded_and_retryable(nats_server, log_config, tmp_path, vllm_server,
                                                               tokenizer, fault, status, code):
    stack = start(nats_server, log_config, tmp_path, "vllm", (vllm_server.url,), engine_timeout=0.5)
    try:
        session = open_session(stack)
        messages = [{"role": "user", "content": "hi"}]
        vllm_server.push(ScriptedReply(token_ids=[*tokenizer.encode("no"), IM_END], **fault))  # type: ignore[arg-type]
        failed = ask(session, messages)
        assert failed.status_code == status and failed.json()["error"]["code"] == code
        vllm_server.push(reply(tokenizer, "yes"))
        client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "yes"
        kinds = [type(e) for e in stack.events(session["session_id"])]
        assert EngineFailed in kinds and kinds.count(TurnCompleted) == 1
        summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
        assert summary["turns"] == 1 and len(summary["chains"]) == 1
    finally:
        stack.stop()


def test_vllm_length_stays_length_for_the_agent(nats_server, log_config, tmp_path, vllm_server, tokenizer):
    stack = start(nats_server, log_config, tmp_path, "vllm", (vllm_server.url,))
    try:
        session = open_session(stack)
        vllm_server.push(reply(tokenizer, "one two three four five six"))
        client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        choice = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "count"}],
                                                max_tokens=3).choices[0]
        assert choice.finish_reason == "length"
        vllm_server.push(reply(tokenizer, "done"))
        again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert again.choices[0].finish_reason == "stop"
    finally:
        stack.stop()


class FakeVerlClient:
    """Follows verl's ``LLMServerClient.generate``; answers with ``TokenOutput``-shaped objects."""

    def __init__(self) -> None:
        self.outputs: list[object] = []
        self.calls: list[dict] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict,
                       image_data: list | None = None, **kwargs: object) -> object:
        self.calls.append({"request_id": request_id, "prompt_ids": prompt_ids, "sampling_params": sampling_params})
        output = self.outputs.pop(0)
        if isinstance(output, BaseException):
            raise output
        return output


class TokenOutput:
    def __init__(self, token_ids: list[int], stop_reason: str, global_steps: int) -> None:
        self.token_ids, self.stop_reason = token_ids, stop_reason
        self.log_probs = default_logprobs(len(token_ids))
        self.extra_fields = {"global_steps": global_steps}


class ActorDiedError(Exception):
    """Named like Ray's."""


def test_an_edge_inside_a_verl_job_uses_its_llm_server_client(nats_server, log_config, tmp_path, tokenizer):
    from edge.engines.verl import VerlEngine

    client = FakeVerlClient()
    options = StackOptions(port=0, data_dir=tmp_path / "data", nats_url=nats_server.url, admin_token=ADMIN_TOKEN,
                           log=log_config, max_trajectory_length=4096)
    stack = StackThread(options, engine=VerlEngine(client)).start()
    try:
        session = open_session(stack)
        truncated = tokenizer.encode("one two three")
        client.outputs += [TokenOutput(truncated, "completed", 7), ActorDiedError("replica 0 died"),
                           TokenOutput([*tokenizer.encode("ok"), IM_END], "completed", 8)]
        messages = [{"role": "user", "content": "count"}]
        first = ask(session, messages, max_tokens=len(truncated))
        assert first.json()["choices"][0]["finish_reason"] == "length"  # verl said "completed"; rollbus knows
        messages += [{"role": "assistant", "content": "one two three"}, {"role": "user", "content": "go on"}]
        failed = ask(session, messages)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_unavailable"
        assert ask(session, messages).json()["choices"][0]["message"]["content"] == "ok"
        assert {call["request_id"] for call in client.calls} == {session["session_id"]}  # verl's sticky key
        turns = [e for e in stack.events(session["session_id"]) if isinstance(e, TurnCompleted)]
        assert [(t.finish_reason, t.weight_version) for t in turns] == [("length", "7"), ("stop", "8")]
    finally:
        stack.stop()
