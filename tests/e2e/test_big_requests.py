"""Big requests do not stall the edge. A request whose new text cannot fit its chain is
answered ``length`` without being tokenized (its size bounds its tokens from below); one that
may fit is tokenized on a worker thread. Meanwhile ``/healthz`` and other sessions' turns are
answered as usual: the event loop is never held for the seconds that tokenizing megabytes takes.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from edge.chat.conversation import Message
from edge.tokens.incremental import TemplateCodec
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from schemas.events import ChainClosed, ContextAppended, RequestReceived
from tests.e2e.test_openai_session import open_session
from tests.stack import StackThread

IM_END = 151645
SLOW_S = 1.0  # no /healthz answer for this long: the edge was stalled (tokenizing 1 MB takes ~2 s)


@pytest.fixture
def engine(tokenizer) -> Iterator[ScriptedEngineServer]:
    """Every request gets a short reply; only the last request is kept (they carry megabytes)."""
    ids = [*tokenizer.encode("ok"), IM_END]

    def respond(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))

    with ScriptedEngineServer(responder=respond, keep_requests=1) as server:
        yield server


def words(size: int, *, seed: int = 0, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> str:
    """~``size`` characters of random words (about two characters a token)."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(4000)]
    text = " ".join(rng.choices(vocabulary, k=size // 6 + 1))
    return text[:size]


class Watch:
    """Meanwhile: polls ``/healthz`` on one thread and runs turns of a session of its own on
    another, until stopped. ``longest_silence`` is the longest time between two health answers
    (or from the start to the first): it counts an event loop that was held, and also a GIL
    that was (the stack runs in this process, so the watcher would be frozen with it)."""

    def __init__(self, stack: StackThread) -> None:
        self._stack = stack
        self._session = open_session(stack)
        self.health: list[float] = []
        self.answered: list[float] = []
        self.turns: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll, daemon=True),
                         threading.Thread(target=self._run, daemon=True)]

    def __enter__(self) -> Watch:
        self.answered.append(time.monotonic())
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    @property
    def longest_silence(self) -> float:
        return max(later - earlier for earlier, later in itertools.pairwise(self.answered))

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                assert client.get(f"{self._stack.url}/healthz").status_code == 200
                self.answered.append(time.monotonic())
                self.health.append(self.answered[-1] - started)
                time.sleep(0.02)

    def _run(self) -> None:
        url = f"{self._session['base_url']}/chat/completions"
        auth = {"Authorization": f"Bearer {self._session['api_key']}"}
        with httpx.Client(timeout=30) as client:
            turn = 0
            while not self._stop.is_set():
                started = time.monotonic()
                body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"ping {turn}"}]}
                response = client.post(url, json=body, headers=auth)
                assert response.status_code == 200, response.text
                self.turns.append(time.monotonic() - started)
                turn += 1
                time.sleep(0.05)


def post(session: dict[str, Any], content: str) -> httpx.Response:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{session['base_url']}/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {session['api_key']}"})


def test_a_request_that_cannot_fit_is_answered_without_being_tokenized(stack, engine) -> None:
    """10 MB of ASCII needs at least 10 MB / 128 (Qwen's longest token) = 82k tokens: past the
    default 32k trajectory length. Tokenizing it would take ~20 s here."""
    session = open_session(stack)
    served = engine.served
    with Watch(stack) as watch:
        started = time.monotonic()
        response = post(session, words(10 * 1024 * 1024))
        took = time.monotonic() - started
        time.sleep(0.3)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert took < 8, f"the refusal took {took:.1f} s: the request was tokenized"
    events = stack.events(session["session_id"])
    assert [type(e) for e in events if isinstance(e, (RequestReceived, ContextAppended))] == [RequestReceived]
    assert engine.served - served == len(watch.turns)  # only the watcher's turns reached the engine
    assert watch.turns and watch.longest_silence < SLOW_S, (watch.longest_silence, watch.health)

    # On a chain that exists, the same request closes the chain (its next turn cannot fit).
    first = post(session, "hello")
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": words(10 * 1024 * 1024, seed=1)}]}
    closing = httpx.post(f"{session['base_url']}/chat/completions", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {session['api_key']}"})
    assert closing.json()["choices"][0]["finish_reason"] == "length"
    closed = [e for e in stack.events(session["session_id"]) if isinstance(e, ChainClosed)]
    assert [(e.chain, e.reason) for e in closed] == [(0, "max_trajectory_length")]


@pytest.fixture
def roomy_stack(make_stack: Callable[..., StackThread]) -> StackThread:
    return make_stack(max_trajectory_length=4_000_000)


@pytest.mark.parametrize("alphabet", ["abcdefghijklmnopqrstuvwxyz", "äöüßéèàçñ"], ids=["ascii", "latin"])
def test_a_long_tokenization_does_not_stall_other_sessions(roomy_stack, engine, tokenizer, alphabet: str) -> None:
    """1 MB that may fit is tokenized (on a worker thread) and served; meanwhile every health
    check and every other session's turn is answered at once."""
    session = open_session(roomy_stack)
    content = words(1024 * 1024, seed=2, alphabet=alphabet)
    with Watch(roomy_stack) as watch:
        before = len(watch.turns)
        response = post(session, content)
        during = len(watch.turns) - before
        time.sleep(0.3)
    assert response.status_code == 200, response.text
    prompt = response.json()["usage"]["prompt_tokens"]
    rendered = TemplateCodec(tokenizer).prompt_text([Message(role="user", content=content)], ())
    assert prompt == len(tokenizer.encode(rendered)) > len(content) // 10, prompt
    assert engine.requests[-1]["input_ids"][-3:] == tokenizer.encode("<|im_start|>assistant\n")
    assert during >= 2, "the other session's turns waited for the tokenization"
    assert watch.longest_silence < SLOW_S, (watch.longest_silence, watch.health)
