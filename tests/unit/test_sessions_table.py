"""``rollbus sessions``' forks: the column, the tally by cause and the tree (pure: summaries in, text out)."""

from __future__ import annotations

from rollbus.commands.sessions import chain_tree, fork_tally, table
from schemas.events import ForkPoint
from session.fold import fold
from session.summary import summarize
from tests.helpers import SessionScript


def _summary(forks: bool = True):
    script = SessionScript()
    fork = (lambda **f: ForkPoint(**f)) if forks else (lambda **f: None)
    script.turn(0, [1, 2, 3], [4], new_chain=True, fork=fork(cause="new_conversation"))
    script.turn(1, [9], [5], new_chain=True, fork=fork(cause="sub_agent", parent=0, token_offset=0))
    script.turn(2, [9, 8], [6], new_chain=True, fork=fork(cause="sibling", parent=1, message_index=2, token_offset=1))
    script.turn(3, [1, 2], [7], new_chain=True, fork=fork(cause="sibling", parent=0, message_index=2, token_offset=2))
    return summarize(fold(script.events))


def test_the_tree_puts_each_chain_under_its_parent():
    assert chain_tree(_summary()) == [
        "  └ chain 0: new_conversation; 1 turn, 3+1 tokens",
        "    └ chain 1: sub_agent at message 0, token 0; 1 turn, 1+1 tokens",
        "      └ chain 2: sibling at message 2, token 1; 1 turn, 2+1 tokens",
        "    └ chain 3: sibling at message 2, token 2; 1 turn, 2+1 tokens",
    ]


def test_forks_are_counted_by_cause_and_a_log_without_them_says_so():
    summary, old = _summary(), _summary(forks=False)
    assert summary.forks == {"sub_agent": 1, "sibling": 2}
    assert fork_tally([summary, old]) == "unrecorded 3, sibling 2, sub_agent 1"
    assert fork_tally([]) == "none"
    assert chain_tree(old)[0] == "  └ chain 0: no fork recorded; 1 turn, 3+1 tokens"
    row = table([summary], now=0.0).splitlines()[2].split()
    assert row[5:7] == ["4", "3"]  # chains, forks
