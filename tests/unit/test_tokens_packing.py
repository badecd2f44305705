"""Packed token arrays: Python's own arrays pack what numpy's did, byte for byte, and refuse what cannot be an id."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from schemas import tokens


def test_ids_pack_as_little_endian_uint32_from_any_sequence() -> None:
    rng = random.Random(7)
    ids = [rng.randrange(2**32) for _ in range(500)] + [0, 2**32 - 1]
    expected = np.asarray(ids, dtype="<u4").tobytes()
    assert tokens.pack_ids(ids) == expected
    assert tokens.pack_ids(tuple(ids)) == expected
    assert tokens.pack_ids(iter(ids)) == expected
    assert tokens.pack_ids(np.asarray(ids, dtype=np.int64)) == expected
    assert tokens.pack_ids([]) == b""
    assert tokens.unpack_ids(expected).tolist() == ids


@pytest.mark.parametrize("bad", [[-1], [2**32], [5, 2**40]])
def test_an_id_outside_uint32_is_refused(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        tokens.pack_ids(bad)


@pytest.mark.parametrize("bad", [[1.5], ["7"], [None]])
def test_an_id_that_is_no_int_is_refused(bad: list[object]) -> None:
    with pytest.raises(TypeError):
        tokens.pack_ids(bad)  # type: ignore[arg-type]


def test_logprobs_pack_as_little_endian_float32_rounded_as_numpy_rounds() -> None:
    rng = random.Random(11)
    values = [rng.uniform(-30.0, 0.0) for _ in range(500)] + [0.0, -0.0, -1e-45, -math.inf, 1e-7]
    expected = np.asarray(values, dtype="<f4").tobytes()
    assert tokens.pack_logprobs(values) == expected
    assert tokens.pack_logprobs(tuple(values)) == expected
    assert tokens.pack_logprobs(np.asarray(values)) == expected
    assert tokens.unpack_logprobs(tokens.pack_logprobs([-1e40]))[0] == -math.inf  # past float32: infinite
    assert math.isnan(tokens.unpack_logprobs(tokens.pack_logprobs([math.nan]))[0])
