"""Rewards over HTTP: posted before the end they are in the records; after it, 409 and kept in the log only."""

from __future__ import annotations

import httpx
from openai import OpenAI

from rollbus.testing.scripted import ScriptedReply, default_logprobs
from schemas.events import RewardReported, SessionFinalized
from tests.e2e.test_openai_session import open_session, wait_for_parquet


def _one_turn(stack, engine, session) -> None:
    engine.push(ScriptedReply(token_ids=[9707, 151645], logprobs=default_logprobs(2)))
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_a_reward_after_materialization_is_refused_and_kept_in_the_log(stack, engine):
    session = open_session(stack, uid="late", metadata={"agent_name": "a"})
    sid, auth = session["session_id"], {"Authorization": f"Bearer {session['api_key']}"}
    _one_turn(stack, engine, session)
    posted = httpx.post(session["reward_url"], json={"reward_info": {"reward": 0.5, "acc": 1, "finished": True}},
                        headers=auth)
    assert posted.status_code == 200
    httpx.post(f"{stack.url}/sessions/{sid}/finalize", headers=stack.admin)
    (row,) = wait_for_parquet(stack.trajectories, sid)
    assert row["reward"] == 0.5 and row["rm_scores"][-1] == 0.5 and row["reward_extra_info"] == '{"acc":1}'

    late = httpx.post(session["reward_url"], json={"reward_info": {"reward": 1.0, "acc": 0}}, headers=auth)
    assert late.status_code == 409
    error = late.json()["error"]
    assert error["code"] == "session_closed" and "recorded in the log" in error["message"]
    events = stack.events(sid)
    assert isinstance(events[-2], SessionFinalized) and isinstance(events[-1], RewardReported)
    assert events[-1].reward == 1.0 and events[-1].extra == {"acc": 0}
    summary = httpx.get(f"{stack.url}/sessions/{sid}", headers=stack.admin).json()
    assert summary["reward"] == 0.5 and summary["reward_info"] == {"acc": 1, "finished": True}
    assert wait_for_parquet(stack.trajectories, sid) == [row]  # the records did not change

    stranger = httpx.post(session["reward_url"], json={"reward_info": {"reward": 1.0}},
                          headers={"Authorization": "Bearer rb-not-the-key"})
    assert stranger.status_code == 401 and len(stack.events(sid)) == len(events)


def test_a_reward_after_abort_is_refused_and_kept(stack):
    session = open_session(stack)
    sid = session["session_id"]
    httpx.post(f"{stack.url}/sessions/{sid}/abort", json={"reason": "runner crashed"}, headers=stack.admin)
    late = httpx.post(session["reward_url"], json={"reward_info": {"reward": 1.0}},
                      headers={"x-api-key": session["api_key"]})
    assert late.status_code == 409 and "aborted" in late.json()["error"]["message"]
    assert isinstance(stack.events(sid)[-1], RewardReported)


def test_finished_must_be_a_bool(stack):
    session = open_session(stack)
    response = httpx.post(session["reward_url"], json={"reward_info": {"reward": 1, "finished": "yes"}},
                          headers={"x-api-key": session["api_key"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reward_info.finished"
