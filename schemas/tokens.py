"""Packed token arrays: ids as little-endian uint32, log probs as little-endian float32.

The log, the fold and the records all hold tokens in this form (4 bytes a token, 4 more
for a log prob), never as lists of Python ints and floats.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

ID_DTYPE = np.dtype("<u4")
LOGPROB_DTYPE = np.dtype("<f4")


# Python's own arrays pack a list of ints or floats 3-5x faster than numpy's ``asarray``, which first discovers the
# list's type and shape (~60k instructions a turn in the edge, 5 % of it): the same bytes where the machine's own
# order and sizes are the log's (little-endian, 4 bytes), which is everywhere rollbus runs; numpy's otherwise.
_NATIVE = sys.byteorder == "little" and array.array("I").itemsize == 4 and array.array("f").itemsize == 4


def pack_ids(ids: Iterable[int] | npt.NDArray[np.integer]) -> bytes:
    """``ids`` as the log holds them; OverflowError for an id under 0 or past uint32, TypeError for one not an int."""
    if isinstance(ids, np.ndarray):
        return ids.astype(ID_DTYPE, copy=False).tobytes()
    if _NATIVE:
        return array.array("I", ids).tobytes()
    return np.fromiter(ids, dtype=ID_DTYPE).tobytes()


def pack_logprobs(values: Sequence[float] | npt.NDArray[np.floating]) -> bytes:
    """``values`` as float32, as the log holds them (past float32's range: infinite)."""
    if _NATIVE and not isinstance(values, np.ndarray):
        return array.array("f", values).tobytes()
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def unpack_ids(data: bytes) -> npt.NDArray[np.uint32]:
    return np.frombuffer(data, dtype=ID_DTYPE)


def unpack_logprobs(data: bytes) -> npt.NDArray[np.float32]:
    return np.frombuffer(data, dtype=LOGPROB_DTYPE)


def last_id(data: bytes) -> int:
    """The last id of a non-empty packed array."""
    return int.from_bytes(data[-4:], "little")


def count(data: bytes) -> int:
    """Number of tokens (or log probs) in a packed array."""
    return len(data) // 4


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading tokens two packed arrays share."""
    n = min(len(a), len(b)) // 4
    differ = np.flatnonzero(np.frombuffer(a, ID_DTYPE, n) != np.frombuffer(b, ID_DTYPE, n))
    return int(differ[0]) if len(differ) else n
