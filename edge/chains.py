"""Chain selection: which chain a request continues, decided from digests alone (pure).

A request continues the open chain whose whole history (its last reply included) is a
strict prefix of the request's messages, preferring the longest such history and then
the most recent chain. A chain with a request in flight is skipped (requests never
interleave on a chain), so a concurrent request that shares its history diverges into a
new chain. A request that extends a *closed* chain gets ``finish_reason = "length"``
again without sampling. Anything else starts a new chain.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

from session_projector.fold import ChainState, SessionState


class Continue(msgspec.Struct, frozen=True):
    chain: ChainState
    n_history: int  # messages[:n_history] are the chain's history; the rest is new


class Exhausted(msgspec.Struct, frozen=True):
    chain: ChainState


class NewChain(msgspec.Struct, frozen=True):
    pass


Selection = Continue | Exhausted | NewChain


def _matches(chain: ChainState, digests: Sequence[str]) -> bool:
    n = chain.n_messages
    return bool(chain.tip_digest) and 0 < n < len(digests) and digests[n - 1] == chain.tip_digest


def select_chain(state: SessionState, digests: Sequence[str], busy: Collection[int] = ()) -> Selection:
    """``digests[i]`` is the hex digest of the request's messages ``[: i + 1]``."""
    best: ChainState | None = None
    for chain in state.chains:
        if chain.index in busy or not _matches(chain, digests):
            continue
        if best is None or chain.n_messages >= best.n_messages:
            best = chain
    if best is None:
        return NewChain()
    if best.closed is not None:
        return Exhausted(best)
    return Continue(best, best.n_messages)
