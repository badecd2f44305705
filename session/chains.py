"""Chain selection: which chain a request continues, decided from digests alone (pure).

A request continues the open chain whose whole history (its last reply included) is a
strict prefix of the request's messages, preferring the longest such history and then
the most recent chain. A chain with a request in flight is skipped (requests never
interleave on a chain), so a concurrent request that shares its history diverges into a
new chain. A request that extends a *closed* chain gets ``finish_reason = "length"``
again without sampling.

**Rollback.** When no chain continues, a request may *rewrite* a chain's last reply: its
messages match the chain's history up to that reply, then carry a different assistant
message (an agent that edited or trimmed the reply) and more. With rollback on, that chain
drops the reply's sampled tokens and takes the rewritten message as context (mask 0);
only the deepest such chain qualifies, and only when it is the one candidate there (a tie
is ambiguous: a new chain). A reply that was the chain's first turn is not rolled back
(nothing sampled would remain): a new chain. Anything else starts a new chain.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

from session.fold import ChainState, SessionState


class Continue(msgspec.Struct, frozen=True):
    chain: ChainState
    n_history: int  # messages[:n_history] are the chain's history; the rest is new


class Rollback(msgspec.Struct, frozen=True):
    chain: ChainState
    n_history: int  # messages[:n_history] precede the rewritten reply (messages[n_history])


class Exhausted(msgspec.Struct, frozen=True):
    chain: ChainState


class NewChain(msgspec.Struct, frozen=True):
    pass


Selection = Continue | Rollback | Exhausted | NewChain


def _matches(chain: ChainState, digests: Sequence[str]) -> bool:
    n = chain.n_messages
    return bool(chain.tip_digest) and 0 < n < len(digests) and digests[n - 1] == chain.tip_digest


def _rewrites(chain: ChainState, digests: Sequence[str], roles: Sequence[str]) -> int | None:
    """Where the request rewrites the chain's last reply (the reply's index), if it does."""
    if chain.closed is not None or len(chain.turns) < 2:
        return None
    turn = chain.turns[-1]
    n = turn.n_prefix_messages
    if not 0 < n < len(digests) - 1 or roles[n] != "assistant" or digests[n - 1] != turn.prefix_digest:
        return None
    return n if digests[n] != chain.tip_digest else None


def select_chain(state: SessionState, digests: Sequence[str], busy: Collection[int] = (),
                 roles: Sequence[str] = (), rollback: bool = False) -> Selection:
    """``digests[i]`` is the hex digest of the request's messages ``[: i + 1]``, ``roles[i]`` its role."""
    best: ChainState | None = None
    for chain in state.chains:
        if chain.index in busy or not _matches(chain, digests):
            continue
        if best is None or chain.n_messages >= best.n_messages:
            best = chain
    if best is not None:
        return Exhausted(best) if best.closed is not None else Continue(best, best.n_messages)
    if rollback:
        return _rollback(state, digests, busy, roles)
    return NewChain()


def _rollback(state: SessionState, digests: Sequence[str], busy: Collection[int], roles: Sequence[str]) -> Selection:
    candidates = [(n, chain) for chain in state.chains if chain.index not in busy
                  and (n := _rewrites(chain, digests, roles)) is not None]
    if not candidates:
        return NewChain()
    deepest = max(n for n, _ in candidates)
    at_depth = [chain for n, chain in candidates if n == deepest]
    return Rollback(at_depth[0], deepest) if len(at_depth) == 1 else NewChain()
