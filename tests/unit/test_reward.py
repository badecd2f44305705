"""Reward intake and precedence: task reward, then a scorer, then 0 with a warning."""

import logging

import pytest

from reward.intake import parse_reward_info
from reward.precedence import decide_reward, resolve_reward
from reward.scorer import FunctionScorer, RewardLoopScorer, ScoreResult, load_scorer
from schemas.errors import MalformedRequest, ScorerError
from schemas.events import RewardReported


def _posted(reward, **extra):
    return RewardReported(session_id="s" * 32, seq=5, time=0.0, reward=reward, extra=extra)


def test_intake_splits_reward_from_extra_and_validates():
    posted = parse_reward_info({"reward": 1, "acc": 0.5, "finished": False})
    assert posted.reward == 1.0 and posted.extra == {"acc": 0.5, "finished": False}
    assert parse_reward_info({"acc": 1}).reward is None
    for bad, param in (({"reward": "1"}, "reward_info.reward"), ({"reward": True}, "reward_info.reward"),
                       ({"finished": "no"}, "reward_info.finished")):
        with pytest.raises(MalformedRequest) as err:
            parse_reward_info(bad)
        assert err.value.param == param


def test_task_reward_wins_and_finished_is_not_extra_info():
    decision = decide_reward(_posted(0.5, acc=1.0, finished=False), "s")
    assert (decision.reward, decision.source, decision.extra, decision.unfinished) == (0.5, "task", {"acc": 1.0}, True)


def test_no_reward_is_zero_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        decision = decide_reward(_posted(None, acc=1.0), "sess")
    assert (decision.reward, decision.source, decision.extra) == (0.0, "default", {"acc": 1.0})
    assert "sess: no reward reported" in caplog.text


async def test_the_scorer_comes_between_and_is_not_asked_when_the_task_posted():
    calls = []

    async def score(scorer):
        calls.append(scorer)
        return ScoreResult(reward=0.25, extra={"judge": 1})

    scorer = FunctionScorer(lambda request: 0.0)
    scored = await resolve_reward(_posted(None, acc=1.0), "s", scorer, score)
    assert (scored.reward, scored.source, scored.extra) == (0.25, "scorer", {"acc": 1.0, "judge": 1})
    task = await resolve_reward(_posted(1.0), "s", scorer, score)
    assert task.source == "task" and len(calls) == 1
    assert (await resolve_reward(None, "s", None, None)).source == "default"


class _Method:
    def __init__(self, answer):
        self.answer = answer
        self.seen = []

    def remote(self, data):
        self.seen.append(data)

        async def done():
            return self.answer

        return done()


class _Worker:
    def __init__(self, answer):
        self.compute_score = _Method(answer)


async def test_reward_loop_scorer_speaks_the_reward_worker_contract():
    from materializer.records import derive_records, score_request
    from tests.unit.test_records import _session

    state = _session(reward=None)
    request = score_request(state, derive_records(state)[-1])
    workers = [_Worker({"reward_score": 1.5, "reward_extra_info": {"acc": 1}}), _Worker({"reward_score": 0})]
    scorer = RewardLoopScorer(workers, build_input=lambda r: {"responses": r.trajectory.responses.tolist()})
    first, second = await scorer.score(request), await scorer.score(request)
    assert (first.reward, first.extra, second.reward) == (1.5, {"acc": 1}, 0.0)
    assert workers[0].compute_score.seen == [{"responses": [60, 61, 62]}]
    with pytest.raises(ScorerError):
        await RewardLoopScorer([_Worker({"score": 1})], build_input=lambda r: r).score(request)


def test_load_scorer_takes_functions_classes_and_instances():
    assert isinstance(load_scorer("tests.unit.test_reward:constant_scorer"), FunctionScorer)
    assert isinstance(load_scorer("tests.unit.test_reward:ConstantScorer"), ConstantScorer)
    with pytest.raises(ValueError):
        load_scorer("no-colon")


def constant_scorer(request) -> float:
    return 1.0


class ConstantScorer:
    async def score(self, request) -> ScoreResult:
        return ScoreResult(reward=1.0)
