"""The agent suite's exactness check (tests/agents/exact.py) on hand-made records: it accepts the
exact ones, forks included, and names what is wrong in the others."""

from __future__ import annotations

import pytest

from rollbus.testing.scripted import default_logprobs
from tests.agents.exact import check_records, expected_response, owners

PROMPT = [1, 2, 3]
REPLY1, TOOL, REPLY2 = [10, 11], [20, 21, 22], [30]


def record(key: str, prompt: list[int], response: list[int], mask: list[int], logprobs: list[float]) -> dict:
    return {"key": key, "prompts": prompt, "responses": response, "input_ids": prompt + response,
            "response_mask": mask, "rollout_log_probs": logprobs}


def chain() -> tuple[dict, list[list[int]], list[list[int]]]:
    inputs = [PROMPT, PROMPT + REPLY1 + TOOL]
    lp = default_logprobs
    row = record("k_0", PROMPT, REPLY1 + TOOL + REPLY2, [1, 1, 0, 0, 0, 1], [*lp(2), 0.0, 0.0, 0.0, *lp(1)])
    return row, inputs, [REPLY1, REPLY2]


def test_expected_response_masks_the_context_between_turns():
    _, inputs, replies = chain()
    assert expected_response(inputs, replies) == (REPLY1 + TOOL + REPLY2, [1, 1, 0, 0, 0, 1],
                                                  [-0.01, -0.02, 0.0, 0.0, 0.0, -0.01])


def test_an_exact_chain_passes_and_a_forked_one_is_told_apart_by_what_was_sampled():
    row, inputs, replies = chain()
    check_records([row], inputs, replies)
    rewritten = [40, 41]  # the agent sent its first reply back changed: a new chain from the same prompt
    fork = record("k_1", PROMPT + rewritten + TOOL, REPLY2, [1], default_logprobs(1))
    fork_inputs = [PROMPT, PROMPT + rewritten + TOOL]
    first = record("k_0", PROMPT, REPLY1, [1, 1], default_logprobs(2))
    assert owners([first, fork], fork_inputs, [REPLY1, REPLY2]) == [[0], [1]]
    check_records([first, fork], fork_inputs, [REPLY1, REPLY2])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("response_mask", [1, 1, 0, 0, 1, 1], "mask"),
    ("rollout_log_probs", [-0.01, -0.02, 0.0, 0.0, 0.0, -0.5], "Not equal"),
    ("prompts", [1, 2], "prompt"),
])
def test_a_wrong_record_fails_naming_what(field, value, message):
    row, inputs, replies = chain()
    with pytest.raises(AssertionError, match=message):
        check_records([{**row, field: value}], inputs, replies)


def test_a_request_no_record_holds_fails():
    row, inputs, replies = chain()
    with pytest.raises(AssertionError, match="owned by no record"):
        check_records([row], [*inputs, [9, 9]], [*replies, [1]])
