"""Fuzzing the three wires and ``POST /sessions`` over real HTTP against one running stack.

Hypothesis draws nearly valid requests and hostile ones (:mod:`tests.e2e.fuzz_payloads`,
:mod:`tests.e2e.fuzz_responses`): a valid
body with one field perturbed, bytes cut short or garbled, lone surrogates, integers past 64
bits, nesting past the bounds, odd headers (mostly with the right key, so the decoder is reached).
Some bodies extend the history of the session's last accepted request, so the incremental decoding
of a known prefix is fuzzed too; on the Responses wire some continue the last accepted response by
its ``previous_response_id`` instead, and others carry forged reasoning references or ids the
session never issued. Every answer must come within a few
seconds, with a status the route documents (never a 5xx) and, for an error, the route's wire shape;
a streamed answer must end with its wire's last event or an in-stream error. Afterwards a normal
session still works through the official SDKs, and ``rollbus replay --verify`` passes for it, for a
sample of the fuzzed sessions (finalized first) and for the whole log.

2,850 examples in all (800 a wire, 450 session opens). The example database is off and the seed is
Hypothesis's own (not ``derandomize``): every run, in CI too, explores inputs no run tried before,
and none replays examples saved by a run against other code; what makes a failure reproducible is
its message, which carries the exact request (URL, headers, body bytes), enough for a regression
test whatever the seed (Hypothesis prints the seed and a ``@reproduce_failure`` blob as well, but
the stack's state, unlike the request, is not replayed). ``ROLLBUS_FUZZ_SCALE=10 pytest --timeout=0
tests/e2e/test_fuzz.py`` runs ten times as many examples.
"""

from __future__ import annotations

import asyncio
import copy
import io
import json
import os
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from contextlib import redirect_stdout
from typing import Any

import anthropic
import httpx
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from edge.tokens.tokenizer import Tokenizer
from materializer.verify import read_marker
from rollbus.cli import build_parser
from rollbus.commands.replay import replay_main
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from tests.e2e import fuzz_payloads as fp
from tests.e2e import fuzz_responses as fr
from tests.e2e.test_hostile_input import IM_END, Session, anthropic_error, openai_error
from tests.e2e.test_openai_session import open_session
from tests.stack import StackThread

SCALE = float(os.environ.get("ROLLBUS_FUZZ_SCALE", "1"))
WIRE_EXAMPLES = int(800 * SCALE)  # each wire
OPEN_EXAMPLES = int(450 * SCALE)
ANSWER_WITHIN_S = 5.0  # no request may take longer
VERIFY_SAMPLE = 20  # fuzzed sessions finalized and verified one by one (all of them are verified with --all)
ROTATE_AFTER = 40  # accepted turns, after which a wire's fuzzing moves on to a fresh session
MODEL_STATUSES = {200, 400, 401, 404, 409, 413, 429}
OPEN_STATUSES = {201, 400, 401, 409, 413, 429}
ABORT_STATUSES = {200, 400, 409}
FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
REPLIES = ["Hi.", "<think>\nhmm\n</think>\n\nOK.",
           '<tool_call>\n{"name": "f", "arguments": {"path": "a"}}\n</tool_call>',
           '<tool_call>\n{"name": "f", "arguments": "text"}\n</tool_call>', "<tool_call>\n{broken\n</tool_call>"]


@pytest.fixture
def engine(tokenizer: Tokenizer) -> Iterator[ScriptedEngineServer]:
    """An engine that answers every request: one of a few replies (text, reasoning, tool calls, a
    broken tool call), chosen by the request's tokens so that the same request gets the same one."""
    replies = []
    for text in REPLIES:
        ids = [*tokenizer.encode(text), IM_END]
        replies.append(ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids))))

    def respond(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        return replies[sum(input_ids[-16:]) % len(replies)]

    with ScriptedEngineServer(responder=respond, keep_requests=4) as server:
        yield server


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=httpx.Timeout(ANSWER_WITHIN_S + 5)) as c:
        yield c


def _shown(raw: bytes, headers: list[tuple[bytes, bytes]], url: str) -> str:
    return f"POST {url}\nheaders: {headers!r}\nbody ({len(raw)} bytes): {raw[:3000]!r}"


def send(client: httpx.Client, url: str, raw: bytes, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    started = time.monotonic()
    response = client.post(url, content=raw, headers=headers)
    took = time.monotonic() - started
    assert took < ANSWER_WITHIN_S, f"answered in {took:.1f} s\n{_shown(raw, headers, url)}"
    return response


def check_answer(response: httpx.Response, wire: str, expected: set[int], shown: str, tally: Counter[str]) -> None:
    """A status the route documents; an error in the wire's shape; a whole plain or streamed reply.
    ``tally`` counts the answers by status (``"200 stream"`` for a streamed one)."""
    status = response.status_code
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    tally[f"{status} stream" if streamed else str(status)] += 1
    assert status in expected, f"{status}: {response.text[:2000]}\n{shown}"
    try:
        if status >= 400:
            (anthropic_error if wire == "anthropic" else openai_error)(response, status)
        elif streamed:
            _check_stream(response.text, wire)
        elif wire == "openai":
            assert response.json()["object"] == "chat.completion"
        elif wire == "responses":
            assert response.json()["object"] == "response"
        elif wire == "anthropic":
            assert response.json()["type"] == "message"
        elif wire == "open":
            assert {"session_id", "base_url", "api_key"} <= set(response.json())
        else:
            assert response.json()["status"] == "aborted"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{status}: {response.text[:2000]}\n{shown}") from None


def _check_stream(text: str, wire: str) -> None:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events, "an empty stream"
    last = events[-1]
    if wire == "openai":
        assert last == "data: [DONE]" or last.startswith('data: {"error":'), last
    elif wire == "responses":
        assert last.startswith(("event: response.completed", "event: response.incomplete",
                                "event: response.failed")), last
    else:
        assert last.startswith(("event: message_stop", "event: error")), last


class Fuzzed:
    """The sessions one wire's fuzzing uses: the current one, replaced by a fresh one when it cannot
    serve (404, 409) or after :data:`ROTATE_AFTER` accepted turns; and the body of its last accepted
    request, whose history a next request may extend."""

    def __init__(self, stack: StackThread, wire: str) -> None:
        self.stack = stack
        self.wire = wire
        self.ids: list[str] = []
        self.session = self._open()
        self.last: dict[str, Any] | None = None
        self.last_id: str | None = None  # the Responses wire: the id of the last plain response
        self.turns = 0
        self.tally: Counter[str] = Counter()

    def _open(self) -> Session:
        session = Session(self.stack)
        self.ids.append(session.id)
        return session

    @property
    def url(self) -> str:
        return {"openai": self.session.openai, "anthropic": self.session.anthropic,
                "responses": self.session.responses}[self.wire]

    def answered(self, response: httpx.Response, body: dict[str, Any] | None) -> None:
        if response.status_code == 200:
            self.turns += 1
            self.last = body
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            if self.wire == "responses" and not streamed:
                self.last_id = response.json()["id"]
        if response.status_code == 409 or (response.status_code == 404 and self.wire != "responses") \
                or self.turns >= ROTATE_AFTER:  # (a Responses 404 may be a previous_response_id's)
            self.session, self.last, self.last_id, self.turns = self._open(), None, None, 0


BASE = {"openai": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "anthropic": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        "responses": {"model": "m", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4}}
HISTORY = {"openai": "messages", "anthropic": "messages", "responses": "input"}
NEW = {"openai": fp.openai_messages, "anthropic": fp.anthropic_messages, "responses": fr.responses_items}


def _extended(fuzzed: Fuzzed, data: st.DataObject) -> tuple[bytes, dict[str, Any] | None]:
    """The request the session accepted last (a minimal one without it) with a reply and new messages
    after its history, the rest of the body as it was (so the body starts with the bytes of the known
    prefix); on the Responses wire, half the time the new items alone, continuing the last response by
    its id. Sometimes with its bytes mutated. What is drawn does not depend on the last request
    (Hypothesis replays the draws)."""
    wire, key = fuzzed.wire, HISTORY[fuzzed.wire]
    body = copy.deepcopy(fuzzed.last if fuzzed.last is not None else BASE[wire])
    new: Any = [{"role": "assistant", "content": "Hi."}, *data.draw(NEW[wire]())]
    if data.draw(st.booleans()):
        new = data.draw(fp.perturbed(new))
    new = new if isinstance(new, list) else [new]
    if wire == "responses" and data.draw(st.booleans()) and fuzzed.last_id is not None:
        body = {**BASE[wire], "input": new[1:], "previous_response_id": fuzzed.last_id}
    else:
        history = body.get(key)
        body[key] = [*(history if isinstance(history, list) else []), *new]
    raw = fp.encode(body)
    if data.draw(st.integers(0, 3)) == 0:
        return data.draw(fp.mutated_bytes(raw)), None
    return raw, body


def fuzz_wire(stack: StackThread, client: httpx.Client, wire: str, data: st.DataObject, fuzzed: Fuzzed) -> None:
    body: dict[str, Any] | None = None
    if data.draw(st.integers(0, 2)) == 0:
        raw, body = _extended(fuzzed, data)
    else:
        requests = {"openai": fp.openai_request, "anthropic": fp.anthropic_request, "responses": fr.responses_request}
        raw = data.draw(fp.body_bytes(requests[wire]()))
    url = fuzzed.url
    if data.draw(st.integers(0, 29)) == 0:  # another session's path, or no session's
        other = data.draw(st.one_of(fp.short_text, st.just(fuzzed.session.id.upper()), st.just(fuzzed.ids[0])))
        # (not "/", which even percent-encoded splits the path, nor "." or "..", which the client
        # removes: either way the path is not a model route's, so its errors not in this wire's shape)
        other = other.replace("/", "-") if other.strip(".") else "x"
        url = url.replace(fuzzed.session.id, urllib.parse.quote(other, safe=""))
    headers = data.draw(fp.header_list(fuzzed.session.key))
    response = send(client, url, raw, headers)
    check_answer(response, wire, MODEL_STATUSES, _shown(raw, headers, url), fuzzed.tally)
    if url != fuzzed.url:
        return
    try:
        accepted = json.loads(raw) if body is None and response.status_code == 200 else body
    except ValueError:
        accepted = None
    fuzzed.answered(response, accepted if isinstance(accepted, dict) else None)


# --- after the fuzzing --------------------------------------------------------------------------------------


def sdk_session_works(stack: StackThread) -> str:
    """A normal session through the official SDKs (no retries: a 5xx would fail), finalized."""
    opened = open_session(stack, uid="after-fuzz", metadata={"agent_name": "fine"})
    openai = OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, timeout=30)
    first = openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert first.choices[0].finish_reason in ("stop", "tool_calls", "length")
    claude = anthropic.Anthropic(base_url=opened["anthropic_base_url"], api_key=opened["api_key"], max_retries=0,
                                 timeout=30)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "again"}]
    second = claude.messages.create(model="m", max_tokens=8, messages=messages)  # type: ignore[arg-type]
    assert second.type == "message" and second.stop_reason is not None
    third = openai.responses.create(model="m", input="hi", max_output_tokens=8)
    assert third.status in ("completed", "incomplete")
    assert openai.responses.retrieve(third.id).id == third.id
    final = httpx.post(f"{stack.url}/sessions/{opened['session_id']}/finalize", headers=stack.admin, timeout=30)
    assert final.status_code == 200 and final.json()["trajectories"] >= 1, final.text
    return opened["session_id"]


def finalize_all(stack: StackThread, session_ids: list[str]) -> list[str]:
    """Finalize the sessions still open; the ids of those with records (to wait for their markers)."""
    with_records = []
    for session_id in session_ids:
        answer = httpx.post(f"{stack.url}/sessions/{session_id}/finalize", headers=stack.admin, timeout=30)
        assert answer.status_code in (200, 409), answer.text  # 409: aborted by the fuzzing
        if answer.status_code == 200 and answer.json()["trajectories"]:
            with_records.append(session_id)
    return with_records


async def _replay(stack: StackThread, materialized: list[str], verified: list[str]) -> None:
    nc = await nats.connect(stack.nats_url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 60
        for session_id in materialized:  # the materializer has written each marker
            while await read_marker(js, stack.options.log, session_id) is None:
                assert time.monotonic() < deadline, f"no marker for {session_id}"
                await asyncio.sleep(0.1)
        for argv in [[session_id] for session_id in verified] + [["--all"]]:
            out = io.StringIO()
            args = build_parser().parse_args(["replay", "--verify", *argv, "--nats", stack.nats_url])
            with redirect_stdout(out):
                code = await replay_main(js, stack.options.log, args)
            assert code == 0, f"replay --verify {' '.join(argv)}: {code}\n{out.getvalue()[-3000:]}"
    finally:
        await nc.close()


def still_works_and_replays(stack: StackThread, fuzzed_ids: list[str]) -> None:
    """Finalize (a sample of) the fuzzed sessions, run a normal session, and verify the log: those
    sessions one by one, then every session in it (``--all``: the fuzzed ones left open too)."""
    sample = fuzzed_ids[:: max(1, len(fuzzed_ids) // VERIFY_SAMPLE)]
    materialized = finalize_all(stack, sample)
    after = sdk_session_works(stack)
    asyncio.run(_replay(stack, [*materialized, after], [*sample, after]))


# --- the fuzz tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_fuzzed_model_requests_never_get_a_5xx_and_the_stack_still_works(stack: StackThread, client: httpx.Client,
                                                                       wire: str) -> None:
    fuzzed = Fuzzed(stack, wire)

    @settings(FUZZ, max_examples=WIRE_EXAMPLES)
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        fuzz_wire(stack, client, wire, data, fuzzed)

    fuzz()
    # The fuzzing went as far as the engine, plain and streamed, often enough to mean something. (The
    # draws are new every run: on the Anthropic wire, the one with the fewest, 800 cases gave 28 to 60
    # plain 200s and 20 to 59 streamed; a bar at about a third of the mean does not flake.)
    assert fuzzed.tally["200"] >= WIRE_EXAMPLES // 50 and fuzzed.tally["200 stream"] >= WIRE_EXAMPLES // 100, \
        fuzzed.tally
    still_works_and_replays(stack, fuzzed.ids)


def test_fuzzed_session_opens_never_get_a_5xx_and_the_stack_still_works(stack: StackThread,
                                                                       client: httpx.Client) -> None:
    opened: list[str] = []
    tally: Counter[str] = Counter()
    admin = stack.options.admin_token

    @settings(FUZZ, max_examples=OPEN_EXAMPLES)
    @given(raw=fp.body_bytes(fp.session_request()), headers=fp.header_list(admin), abort=st.integers(0, 3),
           reason=fp.body_bytes(st.builds(lambda r: {"reason": r}, fp.text)))
    def fuzz(raw: bytes, headers: list[tuple[bytes, bytes]], abort: int, reason: bytes) -> None:
        url = f"{stack.url}/sessions"
        response = send(client, url, raw, headers)
        check_answer(response, "open", OPEN_STATUSES, _shown(raw, headers, url), tally)
        if response.status_code != 201:
            return
        session_id = response.json()["session_id"]
        opened.append(session_id)
        if abort == 0:  # abort it, with a fuzzed reason
            abort_url = f"{stack.url}/sessions/{session_id}/abort"
            answer = send(client, abort_url, reason, [(b"authorization", b"Bearer " + admin.encode())])
            check_answer(answer, "abort", ABORT_STATUSES, _shown(reason, [], abort_url), Counter())

    fuzz()
    assert tally["201"] >= OPEN_EXAMPLES // 10, tally  # sessions opened, and not only refused
    still_works_and_replays(stack, opened)
