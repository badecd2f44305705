"""Hostile input on every route, over real HTTP against a running stack: JSON nested a thousand
levels deep, integers past 64 bits, out-of-range sampling, fields the records cannot hold,
options rollbus does not serve, Anthropic tool blocks without their ids, unknown routes and
a foreign ``Host``. Each gets a clear 4xx in its route's wire shape, naming the field (never
a 500, never a silent acceptance); afterwards a normal session on both wires still works."""

from __future__ import annotations

import json
from typing import Any

import httpx

from rollbus.testing.scripted import ScriptedReply, default_logprobs
from tests.e2e.test_openai_session import open_session

DEEP = 1000  # nesting levels: past Python's recursion limit
IM_END = 151645


def deep(levels: int = DEEP) -> bytes:
    return b"[" * levels + b"]" * levels


def _post(url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
          **kwargs: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=raw, timeout=30, **kwargs,
                      headers={"Content-Type": "application/json", **(headers or {})})


def openai_error(response: httpx.Response, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped error (``{"error": {"message", "type", "param", "code"}}``) of ``response``."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


def anthropic_error(response: httpx.Response, status: int = 400, field: str | None = None) -> dict[str, Any]:
    """The Anthropic-shaped error (``{"type": "error", "error": {"type", "message"}}``); the field is
    named at the head of the message."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert body.get("type") == "error" and set(body) == {"type", "error"}, body
    error = body["error"]
    assert set(error) == {"type", "message"} and error["message"], error
    if field is not None:
        assert error["message"].startswith(f"{field}: "), error
    return error


class Session:
    def __init__(self, stack, **spec: Any) -> None:
        opened = open_session(stack, **spec)
        self.id: str = opened["session_id"]
        self.key: str = opened["api_key"]
        self.auth = {"Authorization": f"Bearer {self.key}"}
        self.openai = f"{opened['base_url']}/chat/completions"
        self.anthropic = f"{opened['anthropic_base_url']}/v1/messages"
        self.responses = f"{opened['base_url']}/responses"
        self.reward = opened["reward_url"]


def openai_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def anthropic_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


def hello(tokenizer, text: str = "Hello.") -> ScriptedReply:
    ids = [*tokenizer.encode(text), IM_END]
    return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))


def assert_still_works(stack, engine, tokenizer) -> None:
    """A normal session, on both wires, with a reward and its record."""
    s = Session(stack, uid="fine", session_index=3, metadata={"global_steps": 7, "rollout_n": 2},
                sampling={"max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["</x>"]})
    engine.push(hello(tokenizer), hello(tokenizer, "Again."))
    first = _post(s.openai, openai_body(max_tokens=None, response_format={"type": "text"}), s.auth)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == "Hello."
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "again"}]
    second = _post(s.anthropic, anthropic_body(messages=messages, max_tokens=2**31 - 1), s.auth)
    assert second.status_code == 200, second.text
    assert second.json()["content"] == [{"type": "text", "text": "Again."}]
    sampling = engine.requests[-1]["sampling_params"]
    assert sampling["top_k"] == 20 and sampling["temperature"] == 0.5 and sampling["stop"] == ["</x>"]
    assert engine.requests[-2]["sampling_params"]["max_new_tokens"] == 64  # the session's default
    assert _post(s.reward, {"reward_info": {"reward": 1, "big": 2**63 - 1}}, s.auth).status_code == 200
    final = httpx.post(f"{stack.url}/sessions/{s.id}/finalize", headers=stack.admin, timeout=30)
    assert final.json()["trajectories"] == 1


# --- 1. nesting ---------------------------------------------------------------------------------------------


def test_json_nested_a_thousand_levels_deep_is_a_400_on_every_route(stack, engine, tokenizer):
    s = Session(stack)
    nested = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "x": ' + deep() + b"}"
    openai_error(_post(s.openai, nested, s.auth))
    anthropic_error(_post(s.anthropic, nested, s.auth))
    openai_error(_post(s.openai, nested, {}), 401)  # without the key: refused before the body is read
    anthropic_error(_post(s.anthropic, nested, {}), 401)
    openai_error(_post(s.openai, deep(100_000), s.auth))
    anthropic_error(_post(s.anthropic, deep(100_000), s.auth))
    in_message = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi", "x": ' + \
        deep() + b"}]}"
    openai_error(_post(s.openai, in_message, s.auth))
    anthropic_error(_post(s.anthropic, in_message, s.auth))
    openai_error(_post(f"{stack.url}/sessions", b'{"metadata": {"x": ' + deep() + b"}}", stack.admin))
    openai_error(_post(f"{stack.url}/sessions", deep(), stack.admin))
    openai_error(_post(s.reward, b'{"reward_info": {"x": ' + deep() + b"}}", s.auth))
    openai_error(_post(f"{stack.url}/sessions/{s.id}/abort", b'{"reason": ' + deep() + b"}", stack.admin))
    for levels in (200, 500, 900):  # decodable, but deeper than what the values go through later may take
        openai_error(_post(f"{stack.url}/sessions", b'{"metadata": {"x": ' + deep(levels) + b"}}", stack.admin))
        openai_error(_post(s.reward, b'{"reward_info": {"x": ' + deep(levels) + b"}}", s.auth))
    assert not engine.requests
    assert_still_works(stack, engine, tokenizer)


def test_free_form_values_nested_past_the_bound_are_refused_naming_the_field(stack):
    s = Session(stack)
    nested: Any = 1
    for _ in range(100):  # past the bound (64 levels), well within what decodes
        nested = [nested]
    openai_error(_post(f"{stack.url}/sessions", {"metadata": {"extra_info": {"a": nested}}}, stack.admin),
                 param="metadata.extra_info")
    openai_error(_post(s.reward, {"reward_info": {"reward": 1.0, "trace": nested}}, s.auth),
                 param="reward_info.trace")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": nested}}}]
    openai_error(_post(s.openai, openai_body(tools=tools), s.auth), param="tools[0].function.parameters")
    anthropic_tools = [{"name": "f", "input_schema": {"type": "object", "x": nested}}]
    anthropic_error(_post(s.anthropic, anthropic_body(tools=anthropic_tools), s.auth),
                    field="tools[0].input_schema")
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": nested})}}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c", "content": "r"}]
    openai_error(_post(s.openai, openai_body(messages=history), s.auth),
                 param="messages[1].tool_calls[0].function.arguments")
    # A thousand levels inside the arguments string: the JSON around it is shallow.
    calls[0]["function"]["arguments"] = deep().decode()
    openai_error(_post(s.openai, openai_body(messages=history), s.auth),
                 param="messages[1].tool_calls[0].function.arguments")
    use = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": nested}}]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]
    anthropic_error(_post(s.anthropic, anthropic_body(messages=use), s.auth), field="messages[1].content[0].input")


# --- 2. integers past 64 bits -------------------------------------------------------------------------------


def test_integers_past_64_bits_are_refused_naming_the_field(stack, engine, tokenizer):
    s = Session(stack)
    huge = b"1" + b"0" * 400
    answer = _post(s.reward, b'{"reward_info": {"reward": ' + huge + b"}}", s.auth)
    assert "64" in openai_error(answer, param="reward_info.reward")["message"]
    openai_error(_post(s.reward, {"reward_info": {"reward": -(2**64)}}, s.auth), param="reward_info.reward")
    openai_error(_post(s.reward, {"reward_info": {"reward": 1.0, "n": 2**64}}, s.auth), param="reward_info.n")
    openai_error(_post(s.reward, {"reward_info": {"steps": [1, {"k": -(2**63) - 1}]}}, s.auth),
                 param="reward_info.steps[1].k")
    admin = f"{stack.url}/sessions"
    openai_error(_post(admin, {"session_index": 2**64}, stack.admin), param="session_index")
    assert "session_index" in openai_error(_post(admin, {"session_index": True}, stack.admin))["message"]
    openai_error(_post(admin, b'{"session_index": ' + huge + b"}", stack.admin), param="session_index")
    openai_error(_post(admin, {"sampling": {"top_k": 2**64}}, stack.admin), param="sampling.top_k")
    openai_error(_post(admin, {"metadata": {"tokens": 2**64}}, stack.admin), param="metadata.tokens")
    openai_error(_post(admin, {"metadata": {"extra_info": {"ids": [1, 2**70]}}}, stack.admin),
                 param="metadata.extra_info.ids[1]")
    openai_error(_post(s.openai, openai_body(top_k=2**64), s.auth), param="top_k")
    openai_error(_post(s.openai, openai_body(max_tokens=None, max_completion_tokens=2**70), s.auth),
                 param="max_completion_tokens")
    anthropic_error(_post(s.anthropic, anthropic_body(max_tokens=2**64), s.auth), field="max_tokens")
    anthropic_error(_post(s.anthropic, anthropic_body(top_k=2**64), s.auth), field="top_k")
    for hostile in (b'"max_tokens": ' + huge, b'"max_tokens": 1e300'):
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], ' + hostile + b"}"
        openai_error(_post(s.openai, raw, s.auth))
        anthropic_error(_post(s.anthropic, raw, s.auth))
    assert not engine.requests  # nothing reached the engine
    assert_still_works(stack, engine, tokenizer)


# --- 3. POST /sessions against what the records hold ---------------------------------------------------------


REFUSED_SESSIONS: list[tuple[dict[str, Any], str]] = [
    ({"session_index": 2**31}, "session_index"),
    ({"session_index": -1}, "session_index"),
    ({"uid": ""}, "uid"),
    ({"uid": "a_b"}, "uid"),
    ({"metadata": {"global_steps": 2**63}}, "metadata.global_steps"),
    ({"metadata": {"global_steps": -(2**63) - 1}}, "metadata.global_steps"),
    ({"metadata": {"global_steps": "3"}}, "metadata.global_steps"),
    ({"metadata": {"global_steps": 3.0}}, "metadata.global_steps"),
    ({"metadata": {"global_steps": True}}, "metadata.global_steps"),
    ({"metadata": {"global_steps": None}}, "metadata.global_steps"),
    ({"metadata": {"rollout_n": 0}}, "metadata.rollout_n"),
    ({"metadata": {"rollout_n": 2**63}}, "metadata.rollout_n"),
    ({"metadata": {"rollout_n": False}}, "metadata.rollout_n"),
    ({"metadata": {"attempt": 2**63}}, "metadata.attempt"),
    ({"metadata": {"attempt": "now"}}, "metadata.attempt"),
    ({"metadata": {"tq_partition": 1}}, "metadata.tq_partition"),
    ({"metadata": {"tq_partition": ""}}, "metadata.tq_partition"),
    ({"metadata": {"prompt_status_rule": "most_success"}}, "metadata.prompt_status_rule"),
    ({"metadata": {"trajectory_selection": "shortest"}}, "metadata.trajectory_selection"),
    ({"metadata": {"mask_unfinished_episode": 1}}, "metadata.mask_unfinished_episode"),
    ({"metadata": {"mask_unfinished_episode": "true"}}, "metadata.mask_unfinished_episode"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
    ({"sampling": {"max_tokens": -5}}, "sampling.max_tokens"),
    ({"sampling": {"max_tokens": 2**31}}, "sampling.max_tokens"),
    ({"sampling": {"max_tokens": 10**300}}, "sampling.max_tokens"),
    ({"sampling": {"temperature": -0.5}}, "sampling.temperature"),
    ({"sampling": {"temperature": 1e300}}, "sampling.temperature"),
    ({"sampling": {"top_p": 0}}, "sampling.top_p"),
    ({"sampling": {"top_p": 1.5}}, "sampling.top_p"),
    ({"sampling": {"top_k": 0}}, "sampling.top_k"),
    ({"sampling": {"top_k": -2}}, "sampling.top_k"),
    ({"sampling": {"top_k": 2**31}}, "sampling.top_k"),
    ({"sampling": {"stop": ["x"] * 17}}, "sampling.stop"),
    ({"sampling": {"stop": ["x" * 1025]}}, "sampling.stop[0]"),
    ({"sampling": {"stop": ["ok", ""]}}, "sampling.stop[1]"),
]


def test_a_session_is_opened_only_with_what_its_records_can_hold(stack):
    for spec, param in REFUSED_SESSIONS:
        answer = _post(f"{stack.url}/sessions", spec, stack.admin)
        assert openai_error(answer, param=param)["type"] == "invalid_request_error", spec


def test_a_session_with_every_documented_metadata_key_opens_and_works(stack, engine, tokenizer):
    metadata = {"rollout_n": 4, "global_steps": 2**63 - 1, "tq_partition": "train", "attempt": -(2**63),
                "prompt_status_rule": "all_success", "trajectory_selection": "longest",
                "mask_unfinished_episode": True, "agent_name": "a", "data_source": "x",
                "extra_info": {"ids": [2**64 - 2**63 - 1, -1], "deep": [[[[1]]]], "f": 1.5, "n": None}}
    session = Session(stack, uid="all-keys", session_index=2**31 - 1, metadata=metadata,
                      sampling={"max_tokens": 2**31 - 1, "temperature": 0, "top_p": 1, "top_k": -1, "stop": []})
    summary = httpx.get(f"{stack.url}/sessions/{session.id}", headers=stack.admin, timeout=30)
    assert summary.status_code == 200, summary.text
    engine.push(hello(tokenizer))
    answer = _post(session.openai, openai_body(max_tokens=None), session.auth)
    assert answer.status_code == 200, answer.text
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] < 4096  # capped by the room left


# --- 4. per-request sampling on both wires -------------------------------------------------------------------


OPENAI_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 8}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -3}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": ["a", "x" * 1025]}, "stop[1]"),
    ({"stop": ""}, "stop"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
]


def test_openai_sampling_out_of_range_is_a_400_naming_the_field(stack, engine):
    s = Session(stack)
    for fields, param in OPENAI_REFUSED:
        for stream in (False, True):
            openai_error(_post(s.openai, openai_body(stream=stream, **fields), s.auth), param=param)
    assert not engine.requests


ANTHROPIC_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 1000}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
    ({"stop_sequences": ["", "b"]}, "stop_sequences[0]"),
]


def test_anthropic_sampling_out_of_range_is_a_400_naming_the_field(stack, engine):
    s = Session(stack)
    for fields, field in ANTHROPIC_REFUSED:
        for stream in (False, True):
            anthropic_error(_post(s.anthropic, anthropic_body(stream=stream, **fields), s.auth), field=field)
    assert not engine.requests


# --- 6. Anthropic tool blocks without their ids ---------------------------------------------------------------


def _tool_turn(use: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]}]


ID_LESS: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    ({"type": "tool_use", "name": "f", "input": {}}, {"type": "tool_result", "tool_use_id": "t", "content": "r"},
     "messages[1].content[0].id"),
    ({"type": "tool_use", "id": "", "name": "f", "input": {}},
     {"type": "tool_result", "tool_use_id": "t", "content": "r"}, "messages[1].content[0].id"),
    ({"type": "tool_use", "id": "t", "input": {}}, {"type": "tool_result", "tool_use_id": "t", "content": "r"},
     "messages[1].content[0].name"),
    ({"type": "tool_use", "id": "t", "name": "f", "input": {}}, {"type": "tool_result", "content": "r"},
     "messages[2].content[0].tool_use_id"),
    ({"type": "tool_use", "id": "t", "name": "f", "input": {}},
     {"type": "tool_result", "tool_use_id": "", "content": "r"}, "messages[2].content[0].tool_use_id"),
]


def test_anthropic_tool_blocks_without_ids_are_refused(stack, engine, tokenizer):
    for use, result, field in ID_LESS:
        s = Session(stack)
        for stream in (False, True):
            anthropic_error(_post(s.anthropic, anthropic_body(messages=_tool_turn(use, result), stream=stream),
                                  s.auth), field=field)
        # The same session, once its history is known (decoded incrementally past it), words it the same.
        engine.push(hello(tokenizer))
        assert _post(s.anthropic, anthropic_body(), s.auth).status_code == 200
        later = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "more"}, *_tool_turn(use, result)[1:]]
        later_field = field.replace("messages[1]", "messages[3]").replace("messages[2]", "messages[4]")
        anthropic_error(_post(s.anthropic, anthropic_body(messages=later), s.auth), field=later_field)
    # With its ids, the same exchange is served.
    engine.push(hello(tokenizer, "Done."))
    s = Session(stack)
    served = _tool_turn({"type": "tool_use", "id": "t", "name": "f", "input": {"a": [1]}},
                        {"type": "tool_result", "tool_use_id": "t", "content": "r"})
    answer = _post(s.anthropic, anthropic_body(messages=served), s.auth)
    assert answer.status_code == 200 and answer.json()["content"][0]["text"] == "Done.", answer.text


# --- 7. unknown routes, methods and hosts ---------------------------------------------------------------------


def test_unknown_routes_and_methods_answer_in_the_wire_shape(stack):
    s = Session(stack)
    base = f"{stack.url}/sessions/{s.id}"
    openai_error(httpx.get(f"{stack.url}/nope", timeout=30), 404)
    openai_error(httpx.post(f"{stack.url}/v1/chat/completions", timeout=30), 404)
    get_sessions = httpx.get(f"{stack.url}/sessions", headers=stack.admin, timeout=30)
    openai_error(get_sessions, 405)
    assert get_sessions.headers["allow"] == "POST"
    openai_error(httpx.delete(f"{base}", headers=stack.admin, timeout=30), 405)
    openai_error(httpx.get(f"{base}/reward_info", headers=s.auth, timeout=30), 405)
    openai_error(httpx.get(f"{base}/v1/models", headers=s.auth, timeout=30), 404)
    openai_error(httpx.post(f"{base}/v1/completions", headers=s.auth, timeout=30), 404)
    openai_error(httpx.post(f"{base}/v1/chat/completions/", headers=s.auth, timeout=30), 404)
    for method in ("GET", "PUT", "DELETE"):
        wrong = httpx.request(method, s.openai, headers=s.auth, timeout=30)
        openai_error(wrong, 405)
        assert wrong.headers["allow"] == "POST"
        wrong = httpx.request(method, s.anthropic, headers=s.auth, timeout=30)
        anthropic_error(wrong, 405)
        assert wrong.headers["allow"] == "POST"
    anthropic_error(httpx.post(f"{base}/v1/messages/count_tokens", headers=s.auth, timeout=30), 400)  # no body
    anthropic_error(httpx.post(f"{base}/v1/messages/count_tokens", timeout=30), 401)
    anthropic_error(httpx.post(f"{base}/v1/messages/batches", headers=s.auth, timeout=30), 404)


def test_a_trailing_slash_never_redirects_to_the_requests_host(stack):
    for path in ("/sessions/", "/healthz/", "/metrics/"):
        for method in ("GET", "POST"):
            answer = httpx.request(method, f"{stack.url}{path}", headers={**stack.admin, "Host": "evil.example"},
                                   timeout=30, follow_redirects=False)
            assert "location" not in answer.headers, (path, method, answer.headers)
            assert answer.status_code in (404, 405), (path, method, answer.status_code)
            openai_error(answer, answer.status_code)


def test_after_hostile_requests_a_normal_session_still_works(stack, engine, tokenizer):
    s = Session(stack)
    admin = f"{stack.url}/sessions"
    hostile = [(s.openai, deep(), s.auth), (s.anthropic, deep(), s.auth), (admin, deep(), stack.admin),
               (s.reward, deep(), s.auth), (s.openai, json.dumps(openai_body(max_tokens=0)).encode(), s.auth),
               (s.anthropic, json.dumps(anthropic_body(top_k=0)).encode(), s.auth),
               (admin, json.dumps({"session_index": 2**64}).encode(), stack.admin),
               (s.reward, b'{"reward_info": {"reward": 1' + b"0" * 400 + b"}}", s.auth)]
    for url, raw, headers in hostile:
        assert _post(url, raw, headers).status_code == 400
    assert_still_works(stack, engine, tokenizer)


# --- 8. what the fuzzer found (tests/e2e/test_fuzz.py): each was a 500 --------------------------------------


def test_what_the_fuzzer_found_is_answered_not_a_500(stack, engine, tokenizer):
    s = Session(stack)
    # An SDK retry counter of "²" (str.isdigit says yes, int says no), or of more digits than int takes.
    for count in ("\xb2", "9" * 5000):  # (other bodies: a retry of a recorded one is answered from the log)
        engine.push(hello(tokenizer))
        body = openai_body(messages=[{"role": "user", "content": f"hi {len(count)}"}])
        answer = httpx.post(s.openai, content=json.dumps(body).encode(), timeout=30,
                            headers={**s.auth, "x-stainless-retry-count": count.encode("latin-1")})
        assert answer.status_code == 200, answer.text
    # Invalid UTF-8 in tools (kept raw at first, and decoded later), or in a field's name the decoder
    # skips, in tools a Responses answer echoes (a stray byte reached the answer): the body is refused.
    raw = json.dumps(openai_body(tools=[{"type": "function", "function": {"name": "f"}}])).encode()
    error = openai_error(_post(s.openai, raw.replace(b'"f"', b'"f\xff"'), s.auth))
    assert error["message"].startswith("request body is not valid UTF-8"), error
    raw = json.dumps({"model": "m", "input": "0", "tools": [{"type": "web_search", "access": False}]}).encode()
    error = openai_error(_post(s.responses, raw.replace(b'"access"', b'"\xffaccess"'), s.auth))
    assert error["message"].startswith("request body is not valid UTF-8"), error
    # Tool-call arguments with a lone surrogate escape: json.loads took it, the template could not render it.
    engine.push(hello(tokenizer, "Done."))
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c", "content": "r"}]
    answer = _post(s.openai, openai_body(messages=history), s.auth)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Done.", answer.text
