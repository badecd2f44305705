"""The trajectory viewer in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

A real stack runs sessions through the official OpenAI SDK (one with tool calls and a reward, one
whose reply the agent rewrites, one left open); the viewer serves the test's log. The browser
loads the list, filters it by uid, opens a session and checks that the token spans' colour
classes are the materialized record's ``response_mask`` and their log-prob heat its
``rollout_log_probs``; it follows a running session as it grows (live refresh) and saves a
screenshot of the session page under ``$ROLLBUS_ARTIFACTS`` (else ``tests/artifacts/``).

Without ``/usr/bin/chromium`` (or Playwright) the browser test skips, unless
``ROLLBUS_REQUIRE_BROWSER=1`` (CI sets it), where it fails. The API checks run without a browser.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client
from openai import OpenAI

from rollbus.testing.scripted import ScriptedReply
from schemas.log import LogConfig
from tests.e2e.test_openai_session import TOOLS, call_text, open_session, wait_for_parquet
from tests.stack import StackThread
from viewer.server import Viewer

CHROMIUM = Path("/usr/bin/chromium")
IM_END = 151645
ROOT = Path(__file__).resolve().parents[2]


def _reply(tokenizer, text: str) -> ScriptedReply:
    ids = [*tokenizer.encode(text), IM_END]
    return ScriptedReply(token_ids=ids, logprobs=[-0.005 * (1 + (7 * i) % 900) for i in range(len(ids))])


class ViewerThread:
    """The viewer on a loop and thread of its own, reading the test's log."""

    def __init__(self, nats_url: str, cfg: LogConfig) -> None:
        self._nats_url, self._cfg = nats_url, cfg
        self._ready, self._stop = threading.Event(), None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = Client()
        await nc.connect(self._nats_url)
        viewer = Viewer(nc.jetstream(), self._cfg, port=0)
        self.url = viewer.start()
        self._ready.set()
        await self._stop.wait()
        await viewer.stop()
        await nc.close()

    def __enter__(self) -> ViewerThread:
        self._thread.start()
        assert self._ready.wait(30), "the viewer did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)


def _tool_session(stack: StackThread, engine, tokenizer) -> dict:
    session = open_session(stack, uid="viewertools", metadata={"agent_name": "calc"})
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(_reply(tokenizer, "Let me compute.\n" + call_text("6*7")), _reply(tokenizer, "It is 42 ✓."))
    messages: list[dict] = [{"role": "system", "content": "Use the calculator."},
                            {"role": "user", "content": "What is 6*7?"}]
    message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    posted = httpx.post(session["reward_url"], json={"reward_info": {"reward": 1.0, "acc": 1.0}}, headers=auth)
    assert posted.status_code == 200, posted.text
    httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin).raise_for_status()
    return session


def _rewritten_session(stack: StackThread, engine, tokenizer) -> dict:
    """Two tool calls; the agent then rewrites the second (its chain's last turn): a rollback."""
    session = open_session(stack, uid="viewerrewrite")
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(_reply(tokenizer, call_text("1+1")), _reply(tokenizer, call_text("2+2")), _reply(tokenizer, "Done."))
    messages = [{"role": "user", "content": "add"}]
    for _ in range(2):
        message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "ok"}]
    messages[3]["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": "3+3"})
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    return session


def _one_turn(session: dict, engine, tokenizer, text: str, history: list[dict]) -> None:
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    engine.push(_reply(tokenizer, text))
    history.append({"role": "user", "content": "go on"})
    answer = client.chat.completions.create(model="m", messages=history).choices[0].message
    history.append(answer.model_dump(exclude_none=True))


def _listed(viewer_url: str, count: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        listed = httpx.get(f"{viewer_url}/api/sessions").json()
        if listed["total"] >= count or time.monotonic() > deadline:
            return listed
        time.sleep(0.1)


@pytest.fixture
def sessions(stack, engine, tokenizer) -> Iterator[dict]:
    tools = _tool_session(stack, engine, tokenizer)
    rewritten = _rewritten_session(stack, engine, tokenizer)
    live = open_session(stack, uid="viewerlive")
    history = [{"role": "user", "content": "count"}]
    _one_turn(live, engine, tokenizer, "one", history)
    (record,) = wait_for_parquet(stack.trajectories, tools["session_id"])
    yield {"tools": tools, "rewritten": rewritten, "live": live, "history": history, "record": record}


def test_the_api_pages_filters_and_answers_mistakes_in_json(stack, sessions, log_config, engine, tokenizer):
    with ViewerThread(stack.nats_url, log_config) as viewer:
        listed = _listed(viewer.url, 3)
        assert listed["total"] == 3 and [s["uid"] for s in listed["sessions"]] == \
            ["viewerlive", "viewerrewrite", "viewertools"]
        first = httpx.get(f"{viewer.url}/api/sessions", params={"limit": 2}).json()
        rest = httpx.get(f"{viewer.url}/api/sessions", params={"limit": 2, "after": first["next"]}).json()
        assert [s["uid"] for s in first["sessions"] + rest["sessions"]] == [s["uid"] for s in listed["sessions"]]
        assert rest["next"] is None
        tools = httpx.get(f"{viewer.url}/api/sessions", params={"uid": "tools", "status": "finalized"}).json()
        assert [(s["uid"], s["reward"], s["turns"]) for s in tools["sessions"]] == [("viewertools", 1.0, 2)]

        sid = sessions["tools"]["session_id"]
        detail = httpx.get(f"{viewer.url}/api/sessions/{sid}").json()
        (chain,) = detail["chains"]
        assert chain["response"]["mask"] == sessions["record"]["response_mask"]
        assert detail["reward"]["extra"] == {"acc": 1.0}
        assert chain["turns"][0]["tool_calls"][0]["name"] == "calculator"
        assert "<tool_response>\n42\n</tool_response>" in chain["turns"][1]["context_text"]
        again = httpx.get(f"{viewer.url}/api/sessions/{sid}", params={"known": detail["last_stream_seq"]}).json()
        assert again == {"unchanged": True, "last_stream_seq": detail["last_stream_seq"]}
        raw = httpx.get(f"{viewer.url}/api/sessions/{sid}/requests/2")
        assert raw.status_code == 200 and json.loads(raw.content)["messages"][-1]["content"] == "42"
        window = httpx.get(f"{viewer.url}/api/sessions/{sid}/chains/0/tokens",
                           params={"offset": 3, "limit": 5}).json()
        assert window["ids"] == sessions["record"]["responses"][3:8]

        _one_turn(sessions["live"], engine, tokenizer, "again", sessions["history"])  # the list follows
        deadline = time.monotonic() + 15
        while (live := httpx.get(f"{viewer.url}/api/sessions", params={"uid": "viewerlive"}).json()["sessions"][0]
               )["turns"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live["turns"] == 2 and live["status"] == "open"

        for path, status, param in (("/api/sessions?limit=501", 400, "limit"),
                                    ("/api/sessions?status=done", 400, "status"),
                                    ("/api/sessions?after=bogus", 400, "after"),
                                    (f"/api/sessions/{'f' * 32}", 404, "session_id"),
                                    ("/api/sessions/Bad.Id%20x", 404, "session_id"),
                                    (f"/api/sessions/{sid}/requests/99", 404, "request_no"),
                                    (f"/api/sessions/{sid}/chains/7/tokens", 404, "chain"),
                                    (f"/api/sessions/{sid}/chains/0/tokens?limit=0", 400, "limit"),
                                    ("/nothing/here", 404, None)):
            answer = httpx.get(f"{viewer.url}{path}")
            assert answer.status_code == status, (path, answer.text)
            assert answer.json()["error"]["param"] == param and answer.json()["error"]["message"]


def test_rollbus_view_prints_its_url_and_stops_on_sigint(nats_server):
    process = subprocess.Popen([sys.executable, "-m", "rollbus.cli", "view", "--nats", nats_server.url, "--port", "0"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        found = re.match(r"rollbus view: serving (http://127\.0\.0\.1:\d+) \(the log at (\S+)\); Ctrl-C stops it", line)
        assert found and found[2] == nats_server.url, line
        assert httpx.get(f"{found[1]}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{found[1]}/").headers["content-type"].startswith("text/html")
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(15) == 0, process.stderr.read()


def _browser():
    reason = None
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing (apt-get install chromium)"
    else:
        try:
            from playwright.sync_api import expect, sync_playwright
        except ImportError:
            reason = "playwright is not installed (pip install playwright)"
    if reason is not None:
        if os.environ.get("ROLLBUS_REQUIRE_BROWSER") == "1":
            pytest.fail(f"ROLLBUS_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    return sync_playwright, expect


def _artifacts() -> Path:
    directory = Path(os.environ.get("ROLLBUS_ARTIFACTS") or ROOT / "tests" / "artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def open_page(playwright):
    """Debian's chromium, headless, and a page on it whose script errors and failed responses are kept in
    ``errors`` (each browser test ends asserting there are none)."""
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    return browser, page, errors


def test_the_viewer_in_chromium(stack, sessions, log_config, engine, tokenizer):
    sync_playwright, expect = _browser()
    record = sessions["record"]
    with ViewerThread(stack.nats_url, log_config) as viewer, sync_playwright() as playwright:
        _listed(viewer.url, 3)
        browser, page, errors = open_page(playwright)

        page.goto(viewer.url)
        page.wait_for_selector("#sessions tbody tr")
        assert page.locator("#sessions tbody tr").count() == 3
        page.fill("#f-uid", "viewertools")
        page.click("#f-apply")
        expect(page.locator("#sessions tbody tr")).to_have_count(1)  # no eval: the page's CSP forbids it
        row = page.locator("#sessions tbody tr")
        assert row.locator("td").nth(1).inner_text() == "finalized" and row.locator("td").nth(7).inner_text() == "1"
        row.locator("a").click()

        page.wait_for_selector("#chain-0 .tokens.response .tok")
        spans = page.eval_on_selector_all("#chain-0 .tokens.response .tok", """spans => spans.map(s => ({
            cls: s.className, id: Number(s.dataset.id), text: s.textContent,
            logprob: s.dataset.logprob === undefined ? null : Number(s.dataset.logprob),
            bg: getComputedStyle(s).backgroundColor, color: getComputedStyle(s).color }))""")
        assert [1 if "model" in s["cls"] else 0 for s in spans] == record["response_mask"]
        assert ["ctx" in s["cls"] for s in spans] == [m == 0 for m in record["response_mask"]]
        assert [s["id"] for s in spans] == record["responses"]
        assert "".join(s["text"] for s in spans) == tokenizer.decode(record["responses"])
        sampled = [(s["logprob"], lp) for s, lp, m in zip(spans, record["rollout_log_probs"],
                                                            record["response_mask"], strict=True) if m]
        assert all(shown == pytest.approx(lp, abs=1e-5) for shown, lp in sampled)
        colours = {s["color"] for s in spans if "model" in s["cls"]} | {s["color"] for s in spans if "ctx" in s["cls"]}
        assert len(colours) == 2  # model and continuation tokens in different colours
        heats = {s["bg"] for s in spans if "model" in s["cls"]}
        assert len(heats) > 5  # log-prob heat: the backgrounds follow the log probs

        body = page.inner_text("body")
        assert "calculator" in body and '{"acc":1.0}' in body and "session_finalized" in body
        assert "reward_reported" in body
        page.locator("#chain-0 .turn").nth(1).locator("button", has_text="raw request").click()
        page.wait_for_selector("#chain-0 .turn >> nth=1 >> pre.raw:not([hidden])")
        assert '"tool_call_id"' in page.locator("#chain-0 .turn").nth(1).locator("pre.raw").inner_text()
        shot = _artifacts() / "viewer_session.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"viewer screenshot: {shot}")

        page.goto(f"{viewer.url}/session/{sessions['rewritten']['session_id']}")
        page.wait_for_selector("#audit tr.turn_rolled_back")
        assert "rolled back" in page.inner_text("#audit")

        live_id = sessions["live"]["session_id"]
        page.goto(f"{viewer.url}/session/{live_id}")
        page.wait_for_selector("#chain-0 .tokens.response .tok")
        assert page.is_visible("#live")
        before = page.locator("#chain-0 .turn").count()
        _one_turn(sessions["live"], engine, tokenizer, "two", sessions["history"])
        expect(page.locator("#chain-0 .turn")).to_have_count(before + 1, timeout=15000)
        assert "two" in page.inner_text("#chain-0")
        browser.close()
        assert not errors, errors


def test_rollbus_view_answers_a_busy_port_or_no_nats_in_one_line(nats_server, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = subprocess.run([sys.executable, "-m", "rollbus.cli", "view", "--nats", nats_server.url, "--port",
                                str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert taken.returncode == 2 and taken.stdout == ""
    assert re.fullmatch(rf"rollbus view: cannot listen on 127\.0\.0\.1:{port}: .+\n", taken.stderr), taken.stderr
    nowhere = subprocess.run([sys.executable, "-m", "rollbus.cli", "view", "--data-dir", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert nowhere.returncode == 2 and nowhere.stderr.count("\n") == 1 and "no NATS server" in nowhere.stderr


def test_a_log_never_provisioned_is_a_503_for_the_list_and_a_404_for_a_session(nats_server, log_config):
    with ViewerThread(nats_server.url, log_config) as viewer:
        listed = httpx.get(f"{viewer.url}/api/sessions")
        assert listed.status_code == 503 and listed.json()["error"]["code"] == "log_unavailable"
        assert "does not exist" in listed.json()["error"]["message"]
        missing = httpx.get(f"{viewer.url}/api/sessions/{'a' * 32}")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "session_id"
