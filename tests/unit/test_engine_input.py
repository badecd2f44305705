"""A long chain's engine input grown in place equals the chain's ids joined afresh, every turn,
through growth, failed turns and rollbacks; and a view handed out never changes afterwards."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.engine_input import InputBuffer
from schemas import tokens
from session.fold import fold
from tests.helpers import SessionScript


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 151_000) for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["turn", "turn", "turn", "fail", "rollback"]), min_size=1, max_size=40),
       st.integers(0, 2**32))
def test_the_buffer_is_the_chain_joined_afresh(steps: list[str], seed: int) -> None:
    rng = random.Random(seed)
    script = SessionScript(max_len=10**9)
    script.turn(0, _ids(rng, rng.randint(1, 300)), _ids(rng, rng.randint(1, 50)), new_chain=True)
    buffer = InputBuffer()
    views: list[tuple[np.ndarray, list[int]]] = []
    for step in steps:
        chain = fold(script.events).chains[0]
        increment = tokens.pack_ids(_ids(rng, rng.randint(0, 80)))
        got = buffer.input_ids(chain, increment)
        assert got.tolist() == tokens.unpack_ids(chain.packed_ids() + increment).tolist()
        views.append((got, got.tolist()))
        if step == "turn":
            script.turn(0, tokens.unpack_ids(increment).tolist(), _ids(rng, rng.randint(1, 50)),
                        n_messages=2 + 2 * len(views), tip=f"t{len(views)}")
        elif step == "rollback" and chain.turns:
            dropped = sum(s.length for s in chain.segments[chain.turns[-1].first_segment:] if s.generated)
            script.roll_back(0, chain.turns[-1].request_no, dropped)
            script.turn(0, _ids(rng, rng.randint(1, 30)), _ids(rng, rng.randint(1, 50)),
                        n_messages=2 + 2 * len(views), tip=f"r{len(views)}")
        # "fail": the turn's engine call failed: nothing reached the chain, the next turn asks again
    for view, seen in views[:-1]:
        assert view.tolist() == seen  # what the engine was handed for an earlier turn was never rewritten


def test_a_failed_turns_increment_is_not_overwritten_under_its_view() -> None:
    script = SessionScript(max_len=10**9)
    script.turn(0, list(range(1, 100)), [5, 6], new_chain=True)
    chain = fold(script.events).chains[0]
    buffer = InputBuffer()
    failed = buffer.input_ids(chain, tokens.pack_ids([7] * 10))  # this turn's engine call fails
    retried = buffer.input_ids(chain, tokens.pack_ids([9] * 5))  # the next request on the same chain
    assert failed.tolist() == [*range(1, 100), 5, 6, *[7] * 10]
    assert retried.tolist() == [*range(1, 100), 5, 6, *[9] * 5]
