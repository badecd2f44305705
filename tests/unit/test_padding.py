"""The padded form: layout, masks, reward position, the truncation rule (pure, milliseconds)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from materializer.padding import Jagged, Padding, pad, pad_records
from materializer.records import derive_records
from schemas.errors import RecordTooLong
from session.fold import fold
from tests.helpers import SessionScript


def _records():
    script = SessionScript(uid="p", session_index=0)
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True, logprobs=[-0.1, -0.2])
    script.turn(0, [30, 31], [40], logprobs=[-0.3], n_messages=4, tip="t2")  # response 20 21 30 31 40
    script.turn(1, [50], [60], new_chain=True, logprobs=[-1.0])
    script.reward(2.0)
    script.finalize()
    return derive_records(fold(script.events))


def test_prompt_left_response_right_masks_zero_on_padding_reward_on_last_valid():
    first, second = _records()
    out = pad_records([first, second], Padding(prompt_length=5, response_length=6, pad_token_id=99))
    assert out["prompts"].tolist() == [[99, 99, 10, 11, 12], [99, 99, 99, 99, 50]]
    assert out["responses"].tolist() == [[20, 21, 30, 31, 40, 99], [60, 99, 99, 99, 99, 99]]
    assert out["input_ids"][0].tolist() == [99, 99, 10, 11, 12, 20, 21, 30, 31, 40, 99]
    assert out["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    assert out["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 7]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert out["loss_mask"].tolist() == out["response_mask"].tolist()
    assert out["rm_scores"].tolist() == [[0, 0, 0, 0, 2.0, 0], [2.0, 0, 0, 0, 0, 0]]
    np.testing.assert_allclose(out["rollout_log_probs"][0], [-0.1, -0.2, 0, 0, -0.3, 0], rtol=1e-6)
    assert out["prompt_len"].tolist() == [3, 1] and out["response_len"].tolist() == [5, 1]
    assert out["truncated"].tolist() == [False, False]


def test_truncation_keeps_the_prompt_end_and_the_response_start_and_moves_the_reward():
    first, _ = _records()
    out = pad_records([first], Padding(prompt_length=2, response_length=3))
    assert out["prompts"].tolist() == [[11, 12]]  # the context nearest the response
    assert out["responses"].tolist() == [[20, 21, 30]]  # what was sampled first
    assert out["response_mask"].tolist() == [[1, 1, 0]]
    assert out["rm_scores"].tolist() == [[0, 0, 2.0]]  # the reward on the last kept token
    assert out["truncated"].tolist() == [True] and out["response_len"].tolist() == [3]


def test_overflow_error_names_the_records():
    first, second = _records()
    with pytest.raises(RecordTooLong, match="p_0_0"):
        pad_records([first, second], Padding(prompt_length=2, response_length=3, overflow="error"))
    pad_records([second], Padding(prompt_length=2, response_length=3, overflow="error"))


def test_lengths_must_be_positive():
    with pytest.raises(ValueError):
        Padding(prompt_length=0, response_length=4)


rows = st.lists(st.lists(st.integers(0, 1000), max_size=9), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(prompts=rows, responses=rows, width=st.integers(1, 10))
def test_valid_tokens_are_the_record_within_the_limits(prompts, responses, width):
    n = min(len(prompts), len(responses))
    prompts, responses = prompts[:n], responses[:n]
    as_rows = [np.array(r, dtype=np.int32) for r in responses]
    masks = Jagged.of([np.ones(len(r), np.int8) for r in responses])
    scores = Jagged.of([np.arange(len(r), dtype=np.float32) for r in responses])
    out = pad(Jagged.of([np.array(p, dtype=np.int32) for p in prompts]), Jagged.of(as_rows), masks, masks, scores,
              None, Padding(prompt_length=width, response_length=width, pad_token_id=-1))
    for i in range(n):
        kept_p, kept_r = prompts[i][-width:] if prompts[i] else [], responses[i][:width]
        assert out["prompts"][i][width - len(kept_p):].tolist() == kept_p
        assert out["responses"][i][:len(kept_r)].tolist() == kept_r
        assert out["attention_mask"][i].sum() == len(kept_p) + len(kept_r)
        assert out["response_mask"][i].sum() == len(kept_r)
        assert out["truncated"][i] == (len(prompts[i]) > width or len(responses[i]) > width)
        expected_reward = len(responses[i]) - 1 if responses[i] else 0
        assert out["rm_scores"][i].sum() == expected_reward
        if kept_r:
            assert out["rm_scores"][i][len(kept_r) - 1] == expected_reward
