"""``rollbus sessions``: every session the projector knows, from the projections bucket (no replay).

::

    rollbus sessions                       the latest 50, newest first (as the viewer's list)
    rollbus sessions --status open         only open ones (or finalized, aborted, quarantined)
    rollbus sessions --uid prompt42 --all  every session of one prompt
    rollbus sessions --json                one JSON array of summaries
    rollbus sessions --tree                each session's chains as a tree, with the cause of each fork

Projections follow the log a moment behind (the projector's lag): a session opened an
instant ago may not be listed yet; ``GET /sessions/{id}`` and ``rollbus replay`` read the log.

A session the materializer quarantined (it could not be materialized: none of its records are
in the sinks; see ``materializer/quarantine.py``) is listed with status ``quarantined`` and the
reason in the last column; its summary keeps its ``status`` (``finalized`` or ``aborted``) and
says why in ``quarantined``.

The ``forks`` column counts the session's chains after its first (each forked from a parent chain,
for the cause its ``chain_started`` recorded: see ``edge/forks.py``); the last line sums them by
cause over the sessions shown, and ``--tree`` draws each session's chains under it.

The ``model_turns`` column counts the model's replies in the session (its summary's
``turns``), not verl's ``num_turns`` of a record (a chain's messages, as ``rollbus demo``
shows them).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

import msgspec

from rollbus.tools import EXIT_OK, add_connection_args, run_tool
from schemas.log import LogConfig

if TYPE_CHECKING:  # (NATS, the projections and the fold are imported when the command runs: --help answers at once)
    from nats.js.client import JetStreamContext

    from session.summary import ChainSummary, SessionSummary

STATUSES = ("open", "finalized", "aborted", "quarantined")


def register(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Flags and defaults of the commands this module runs, on the parsers the CLI made for them."""
    parser = parsers["sessions"]
    parser.description = ("List the sessions the projector knows (the projections, no replay): "
                          "status, uid, model_turns (the model's replies), chains, trajectories, "
                          "reward.")
    parser.add_argument("--status", choices=STATUSES, help="only sessions with this status")
    parser.add_argument("--uid", help="only sessions of this prompt uid")
    parser.add_argument("--limit", type=int, default=50, help="show the latest N, newest first [50]")
    parser.add_argument("--all", action="store_true", help="no limit")
    parser.add_argument("--json", action="store_true", help="a JSON array of session summaries")
    parser.add_argument("--tree", action="store_true",
                        help="draw each session's chains as a tree, with the cause of each fork")
    add_connection_args(parser)
    parser.set_defaults(run=lambda args: asyncio.run(run_tool(args, sessions_main)))


async def sessions_main(js: JetStreamContext, cfg: LogConfig, args: argparse.Namespace) -> int:
    from session.summary import summarize
    from session_projector.projections import iter_projections

    summaries = [summarize(p.state) async for p in iter_projections(js, cfg)]
    counts = Counter(shown_status(s) for s in summaries)
    chosen = sorted((s for s in summaries if _wanted(s, args)), key=lambda s: (-s.opened_at, s.session_id))
    shown = chosen if args.all or args.limit <= 0 else chosen[:args.limit]
    if args.json:
        print(msgspec.json.encode(shown).decode())
        return EXIT_OK
    print(table(shown, now=time.time(), tree=args.tree))
    tallies = ", ".join(f"{counts[s]} {s}" for s in STATUSES)
    print(f"{len(shown)} of {len(chosen)} matching sessions shown; {len(summaries)} in all ({tallies})")
    print(f"forks by cause: {fork_tally(shown)}")
    return EXIT_OK


def fork_tally(summaries: list[SessionSummary]) -> str:
    """The forks of the sessions, by cause, most frequent first ("none" when there are none)."""
    total: Counter[str] = Counter()
    for summary in summaries:
        total.update(summary.forks)
    return ", ".join(f"{cause} {n}" for cause, n in sorted(total.items(), key=lambda i: (-i[1], i[0]))) or "none"


def chain_tree(summary: SessionSummary) -> list[str]:
    """The session's chains, each under its parent (chains without one at the top), with why it forked."""
    children: dict[int | None, list[ChainSummary]] = {}
    for chain in summary.chains:
        parent = chain.fork.parent if chain.fork is not None else None
        children.setdefault(parent, []).append(chain)
    lines: list[str] = []

    def draw(chain: ChainSummary, depth: int) -> None:
        fork = chain.fork
        why = "no fork recorded" if fork is None else fork.cause if fork.parent is None else (
            f"{fork.cause} at message {fork.message_index}, token {fork.token_offset}")
        turns = f"{chain.turns} turn" + ("" if chain.turns == 1 else "s")
        lines.append(f"{'  ' * depth}  └ chain {chain.index}: {why}; {turns}, "
                     f"{chain.prompt_len}+{chain.response_len} tokens")
        for child in children.get(chain.index, []):
            draw(child, depth + 1)

    for root in children.get(None, []):
        draw(root, 0)
    return lines


def shown_status(summary: SessionSummary) -> str:
    """``quarantined`` for a session the materializer set aside, else its status."""
    return "quarantined" if summary.quarantined is not None else summary.status


def _wanted(summary: SessionSummary, args: argparse.Namespace) -> bool:
    return ((args.status is None or shown_status(summary) == args.status)
            and (args.uid is None or summary.uid == args.uid))


def _reason(summary: SessionSummary) -> str:
    if summary.quarantined is not None:
        return summary.quarantined
    return summary.close_reason if summary.close_reason not in (None, summary.status) else ""


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def table(summaries: list[SessionSummary], *, now: float, tree: bool = False) -> str:
    header = (f"{'session':<32}  {'status':<11} {'uid':<16} {'idx':>3} {'model_turns':>11} {'chains':>6} "
              f"{'forks':>5} {'traj':>4} {'reward':>7}  {'updated':<9} reason")
    lines = [header, "-" * len(header)]
    for s in summaries:
        reward = "-" if s.reward is None else f"{s.reward:.3g}"
        uid = s.uid if len(s.uid) <= 16 else s.uid[:15] + "…"
        lines.append(f"{s.session_id:<32}  {shown_status(s):<11} {uid:<16} {s.session_index:>3} {s.turns:>11} "
                     f"{len(s.chains):>6} {sum(s.forks.values()):>5} {s.trajectories:>4} {reward:>7}  "
                     f"{_ago(now - s.updated_at):<9} {_reason(s)}".rstrip())
        if tree:
            lines += chain_tree(s)
    return "\n".join(lines)
