"""Deterministic workloads of ended sessions for the materializer tests, written straight to the log.

Prompts cycle through five shapes so every prompt status and record shape occurs:
all sessions finalized (one or two chains, with or without log probs, rewards posted or
not, ``finished: false``; even prompts record where their chains forked, odd ones do not, as logs
written before forks were), some aborted, all aborted (a ``failure`` prompt), and one
finalized without any turn (a failed session of a ``finished`` prompt).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from eventlog.publisher import JetStreamLog
from schemas.events import (
    ChainStarted,
    ContextAppended,
    Event,
    ForkPoint,
    RequestReceived,
    TokensGenerated,
    TurnCompleted,
)
from tests.helpers import SessionScript


def session_id(prompt: int, index: int) -> str:
    return f"{prompt:016x}{index:016x}"


def _fork(chain: int, forks: bool) -> ForkPoint | None:
    """A second chain forks from the first as a sibling; ``forks`` False: none recorded (an older log)."""
    if not forks:
        return None
    return ForkPoint(cause="new_conversation") if chain == 0 else ForkPoint(cause="sibling", parent=0, message_index=1)


def _turns(script: SessionScript, rng: random.Random, logprobs: bool, forks: bool = True) -> None:
    chains = 1 + (rng.random() < 0.3)
    for chain in range(chains):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(2, 12))]
        for turn in range(rng.randint(1, 3)):
            sampled = [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
            probs = [-rng.random() for _ in sampled] if logprobs else None
            context = prompt if turn == 0 else [rng.randrange(1000) for _ in range(rng.randint(0, 4))]
            script.turn(chain, context, sampled, new_chain=turn == 0, logprobs=probs, n_messages=2 + 2 * turn,
                        tip=f"t{chain}.{turn}", fork=_fork(chain, forks))
            if probs is None:  # the helper fills log probs in; drop them to model an engine without
                script.events[-2] = msgspec.structs.replace(script.events[-2], logprobs=None)
        if rng.random() < 0.2:
            script.close(chain)


def workload(prompts: int, n: int, seed: int = 0) -> list[SessionScript]:
    """``prompts`` x ``n`` ended sessions (``rollout_n = n`` in their metadata)."""
    rng = random.Random(seed)
    scripts = []
    for p in range(prompts):
        shape = p % 5
        for i in range(n):
            script = SessionScript(session_id=session_id(p, i), uid=f"q{p:05d}", session_index=i,
                                   metadata={"global_steps": 4, "rollout_n": n, "data_source": "synthetic"})
            aborted = shape == 3 or (shape == 2 and i % 2 == 0)
            empty = shape == 4 and i == 0
            if not empty:
                _turns(script, rng, logprobs=rng.random() < 0.8, forks=p % 2 == 0)
            if not aborted and rng.random() < 0.8:
                finished = {"finished": False} if rng.random() < 0.15 else {}
                script.reward(round(rng.random(), 3), acc=float(rng.random() < 0.5), **finished)
            script.abort() if aborted else script.finalize()
            scripts.append(script)
    return scripts


_TURN = (ChainStarted, ContextAppended, TokensGenerated, TurnCompleted)


def envelopes(events: Sequence[Event]) -> list[list[Event]]:
    """The session's events grouped as the edge appends them: one envelope per turn, the others alone."""
    groups: list[list[Event]] = []
    for event in events:
        if isinstance(event, _TURN) and groups and isinstance(groups[-1][0], RequestReceived):
            groups[-1].append(event)
        else:
            groups.append([event])
    return groups


async def append(log: JetStreamLog, script: SessionScript) -> int:
    """Append a session's events; returns the stream sequence of its last envelope."""
    last = 0
    for group in envelopes(script.events):
        last = (await log.append(script.session_id, group, last)).stream_seq
    return last


def expected_statuses(scripts: Sequence[SessionScript]) -> dict[str, str]:
    """What each prompt's status must end as: finished when any session has a trajectory, else failure."""
    from session.fold import fold

    ok: dict[str, bool] = {}
    for script in scripts:
        state = fold(script.events)
        assert state is not None
        ok[state.uid] = ok.get(state.uid, False) or (state.status == "finalized" and bool(state.trajectory_chains()))
    return {uid: "finished" if good else "failure" for uid, good in ok.items()}
