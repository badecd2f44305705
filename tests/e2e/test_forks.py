"""Chains as a tree, end to end: one session driven through the official OpenAI SDK forks four ways
(a sub-agent with its own system prompt and tools, a sibling sampled from the same history, a
compacted history, and smolagents-style tool calls re-sent as text); each fork's parent and cause
are in the log, the Parquet records, the metrics, ``rollbus sessions`` and the viewer, which draws the
session as a tree of chains (in a real headless Chromium: skipped without one, as the viewer's own
browser test)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from nats.aio.client import Client
from openai import OpenAI

from rollbus.cli import build_parser
from rollbus.commands.sessions import sessions_main
from schemas import tokens
from schemas.events import ChainStarted
from tests.e2e.test_openai_session import TOOLS, call_text, open_session, reply, wait_for_parquet
from tests.e2e.test_viewer_browser import CHROMIUM, ViewerThread
from tests.e2e.test_viewer_browser import _artifacts as artifacts
from tests.e2e.test_viewer_browser import _browser as browser
from tests.integration.test_metrics import eventually, scrape, value

SYSTEM = {"role": "system", "content": "You are a careful arithmetic agent."}
TASK = {"role": "user", "content": "Add 1+1, then 2+3, with the calculator."}
SUB_SYSTEM = {"role": "system", "content": "You check one sum and answer yes or no."}
SUB_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a sum up.",
                                               "parameters": {"type": "object", "properties": {}}}}]
SUMMARY = {"role": "user", "content": "Summary of the conversation so far: the calculator evaluates the expression "
                                      "1+1 to 2 and the expression 2+3 to 5. Both done; continue."}
CAUSES = ["new_conversation", "sub_agent", "sibling", "history_compacted", "tool_calls_as_text"]


def _smolagents_text(message: dict) -> dict:
    """An assistant tool call as smolagents sends it back: text, not a call."""
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                              "arguments": json.loads(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {"role": "assistant", "content": f"Calling tools:\n{calls!r}"}


def _drive(client: OpenAI, engine, tokenizer) -> None:
    ask = lambda messages, tools=TOOLS: client.chat.completions.create(  # noqa: E731
        model="m", messages=messages, tools=tools).choices[0].message
    engine.push(reply(tokenizer, call_text("1+1")), reply(tokenizer, "yes"), reply(tokenizer, call_text("2+3")),
                reply(tokenizer, "Both done: 2 and 5."), reply(tokenizer, call_text("1+1")),
                reply(tokenizer, "Done."), reply(tokenizer, "2"))
    first = ask([SYSTEM, TASK]).model_dump(exclude_none=True)  # chain 0
    ask([SUB_SYSTEM, {"role": "user", "content": "Is 1+1 equal to 2?"}], SUB_TOOLS)  # chain 1: the sub-agent
    main = [SYSTEM, TASK, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                                  "content": "The expression 1+1 evaluates to 2"}]
    second = ask(main).model_dump(exclude_none=True)
    main += [second, {"role": "tool", "tool_call_id": second["tool_calls"][0]["id"],
                      "content": "The expression 2+3 evaluates to 5"}]
    ask(main)  # chain 0, third turn
    ask([SYSTEM, TASK])  # chain 2: a sibling of chain 0's first turn
    ask([SYSTEM, SUMMARY])  # chain 3: the history compacted
    ask([SYSTEM, TASK, _smolagents_text(first),
         {"role": "user", "content": "Observation:\nThe expression 1+1 evaluates to 2"}])  # chain 4


def _sessions_output(stack, session_id: str, capsys: pytest.CaptureFixture[str], chains: int) -> str:
    async def listing() -> str:
        nc = Client()
        await nc.connect(stack.nats_url)
        try:
            args = build_parser().parse_args(["sessions", "--tree", "--nats", stack.nats_url])
            for _ in range(200):  # the projection follows the log a moment behind
                assert await sessions_main(nc.jetstream(), stack.options.log, args) == 0
                out = capsys.readouterr().out
                if f"chain {chains - 1}:" in out:
                    return out
                await asyncio.sleep(0.1)
            raise AssertionError(f"the projection of {session_id} never showed {chains} chains:\n{out}")
        finally:
            await nc.close()

    return asyncio.run(listing())


def test_forks_are_recorded_with_their_parent_and_cause_everywhere(stack, engine, tokenizer, capsys):
    session = open_session(stack, uid="forks")
    sid = session["session_id"]
    _drive(OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0), engine, tokenizer)

    started = [e for e in stack.events(sid) if isinstance(e, ChainStarted)]
    assert [e.fork.cause for e in started] == CAUSES
    assert [e.fork.parent for e in started] == [None, 0, 0, 0, 0]
    assert [e.fork.message_index for e in started] == [0, 0, 2, 1, 2]
    root, sub, sibling, compacted, as_text = started
    assert sibling.prompt_ids == root.prompt_ids and sibling.fork.token_offset == tokens.count(root.prompt_ids)
    for fork in (sub, compacted, as_text):  # the shared tokens are exactly the prompts' common start
        assert fork.fork.token_offset == tokens.common_prefix(fork.prompt_ids, root.prompt_ids) > 0
    assert as_text.fork.token_offset > compacted.fork.token_offset > sub.fork.token_offset

    def forks_counted() -> bool:
        samples = scrape(f"{stack.url}/metrics")
        return all(value(samples, "rollbus_chain_forks_total", cause=c) == 1 for c in CAUSES[1:])

    eventually(forks_counted)
    assert value(scrape(f"{stack.url}/metrics"), "rollbus_chain_forks_total", cause="new_conversation") == 0

    out = _sessions_output(stack, sid, capsys, chains=5)
    (line,) = [row for row in out.splitlines() if row.startswith(sid)]
    assert line.split()[5:7] == ["5", "4"]  # chains, forks
    assert "forks by cause: history_compacted 1, sibling 1, sub_agent 1, tool_calls_as_text 1" in out
    assert "└ chain 0: new_conversation; 3 turns" in out
    assert "    └ chain 2: sibling at message 2, token " in out  # under chain 0
    assert "    └ chain 4: tool_calls_as_text at message 2, token " in out

    httpx.post(f"{stack.url}/sessions/{sid}/finalize", headers=stack.admin)
    rows = sorted(wait_for_parquet(stack.trajectories, sid), key=lambda r: r["trajectory_index"])
    assert [r["fork_cause"] for r in rows] == CAUSES
    assert [r["parent_key"] for r in rows] == ["", *["forks_0_0"] * 4]
    assert [r["fork_message_index"] for r in rows] == [0, 0, 2, 1, 2]
    assert [r["fork_token_offset"] for r in rows] == [e.fork.token_offset for e in started]


def test_the_viewer_draws_the_session_as_a_tree_of_chains_with_their_causes(stack, engine, tokenizer, log_config):
    session = open_session(stack, uid="forktree")
    sid = session["session_id"]
    _drive(OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0), engine, tokenizer)
    with ViewerThread(stack.nats_url, log_config) as viewer:
        detail = httpx.get(f"{viewer.url}/api/sessions/{sid}").json()
        assert [c["fork"]["cause"] for c in detail["chains"]] == CAUSES
        assert [c["fork"]["parent"] for c in detail["chains"]] == [None, 0, 0, 0, 0]
        eventually(lambda: [(r["chains"], sum(r["forks"].values())) for r in httpx.get(
            f"{viewer.url}/api/sessions", params={"uid": "forktree"}).json()["sessions"]] == [(5, 4)])  # projected
        sync_playwright, expect = browser()
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                                  args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            page = chromium.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{viewer.url}/?uid=forktree")
            page.wait_for_selector("#sessions tbody tr td.chains")
            chains = page.locator("#sessions tbody tr td.chains")
            assert chains.inner_text() == "5 (4 forked)"
            assert chains.get_attribute("title") == "sub_agent 1, sibling 1, history_compacted 1, tool_calls_as_text 1"
            page.goto(f"{viewer.url}/session/{sid}")
            page.wait_for_selector("#tree li")
            expect(page.locator("#tree > li")).to_have_count(1)  # one root: chain 0
            root = page.locator("#tree > li")
            assert root.get_attribute("data-chain") == "0" and root.get_attribute("data-cause") == "new_conversation"
            children = root.locator(":scope > ul > li")
            expect(children).to_have_count(4)
            shown = [(children.nth(i).get_attribute("data-chain"), children.nth(i).locator(".cause").inner_text())
                     for i in range(4)]
            assert shown == [(str(i), cause) for i, cause in enumerate(CAUSES[1:], 1)]
            assert "at message 2, token" in children.nth(1).inner_text()
            assert page.locator("#chain-3 p.fork").inner_text().startswith("fork: history_compacted from chain 0")
            page.screenshot(path=str(artifacts() / "viewer_forks.png"), full_page=True)
            chromium.close()
            assert not errors, errors
