"""Chaos, CI-sized: 200 seeded sessions (OpenAI chat, Anthropic messages and Responses; streaming or
not; tool calls; siblings; a sixth aborted) through nats-server, ``rollbus edge``, ``rollbus projector``
and ``rollbus materializer``, each a process, while every one of them is SIGKILLed (and started again)
and SIGSTOPped for a few seconds at seeded moments of a minute. Every acknowledged turn must be in the
log, none twice; every finalized session's records in Parquet once and equal to the same sessions'
without faults; aborted sessions none; nothing quarantined; ``rollbus replay --verify --all`` clean; no
500. ``ops/chaos/run.py --seed N --minutes M`` is the long run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollbus.testing.chaos import KINDS, PARTS, compare_records, plans, run, schedule

SEED = 20261202


def test_the_schedule_and_the_sessions_are_the_seeds():
    assert schedule(1, 60, 8) == schedule(1, 60, 8) != schedule(2, 60, 8)
    assert {(f.component, f.kind) for f in schedule(3, 60, 8)} == {(c, k) for c in PARTS for k in KINDS}
    assert all(3 <= f.at <= 51 and (f.pause_s > 0) == (f.kind == "SIGSTOP") for f in schedule(4, 60, 20))
    sessions = plans(SEED, 200, 60)
    assert sessions == plans(SEED, 200, 60)
    assert {p.wire for p in sessions} == {"openai", "anthropic", "responses"}
    assert {p.end for p in sessions} == {"finalize", "abort"} and any(p.sibling for p in sessions)
    assert {p.stream for p in sessions} == {True, False}


def _row(phase: str, uid: int, index: int, trajectory: int = 0, **fields: object) -> dict[str, object]:
    return {"key": f"{phase}-{uid}_{index}_{trajectory}", "uid": f"{phase}-{uid}", "session_index": index,
            "session_id": f"{phase}{uid}{index}", "metadata": '{"rollout_n": 4, "attempt": 0}',
            "responses": [1, 2, 3], **fields}


def test_the_comparison_with_the_fault_free_run_finds_what_differs():
    base = [_row("base", 0, i) for i in range(4)] + [_row("base", 0, 0, 1, parent_key="base-0_0_0")]
    same = [_row("chaos", 0, 0),
            _row("chaos", 0, 0, 1, metadata='{"rollout_n": 4, "attempt": 2}', parent_key="chaos-0_0_0")]
    clean = compare_records(base + same, {0: "finalized", 3: "aborted"})
    assert (clean.records, clean.missing, clean.different, clean.aborted_with_records, clean.duplicated) == \
        (2, [], [], [], 0)  # the session id, a re-sent open's attempt, the phase in a fork's parent: no differences
    changed = _row("chaos", 0, 1, responses=[1, 2, 4])
    found = compare_records([*base, _row("chaos", 0, 0), changed, changed, _row("chaos", 0, 3)],
                            {0: "finalized", 1: "finalized", 2: "finalized", 3: "aborted"})
    assert found.missing == ["0/0", "0/2"]  # a sibling's row, a whole session
    assert found.different == ["0/1"] and found.aborted_with_records == ["0/3"] and found.duplicated == 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_200_sessions_through_killed_and_stopped_parts_lose_and_duplicate_nothing(tmp_path: Path, tool_engine):
    report = run(tmp_path, tool_engine.url, seed=SEED, sessions=200, window_s=60, faults=8)
    print(report.render())
    assert report.failures == [], report.render()
    assert report.faults == {f"{c} {k}": 1 for c in PARTS for k in KINDS}
    assert report.sessions == 200 and report.finalized + report.aborted == 200
    assert report.turns_acknowledged >= 400 and report.records >= report.finalized
    assert report.retried, "no request needed a retry: the faults missed the sessions"
