"""Packed token arrays: ids as little-endian uint32, log probs as little-endian float32.

The log, the fold and the records all hold tokens in this form (4 bytes a token, 4 more
for a log prob), never as lists of Python ints and floats.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

ID_DTYPE = np.dtype("<u4")
LOGPROB_DTYPE = np.dtype("<f4")

# Packing the short lists of a turn (an increment, a reply) is on the edge's hot path:
# ``array`` does it in a quarter of numpy's time, where its layout is the packed one.
_NATIVE = sys.byteorder == "little" and array("I").itemsize == 4 and array("f").itemsize == 4


def pack_ids(ids: Iterable[int] | npt.NDArray[np.integer]) -> bytes:
    if isinstance(ids, np.ndarray):
        return ids.astype(ID_DTYPE, copy=False).tobytes()
    if not isinstance(ids, (list, tuple)):
        ids = list(ids)
    if _NATIVE:
        try:
            return array("I", ids).tobytes()
        except (OverflowError, TypeError):  # negative, too large, or not ints: numpy decides
            pass
    return np.asarray(ids, dtype=ID_DTYPE).tobytes()


def pack_logprobs(values: Sequence[float] | npt.NDArray[np.floating]) -> bytes:
    if _NATIVE and isinstance(values, (list, tuple)):
        return array("f", values).tobytes()
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
