"""The README's first steps, executed: its ``<!-- snippet: first-steps -->`` Python blocks run
top to bottom in one namespace, as a user pastes them, against a running stack, and each prints
what the README shows under it.

Only what ties the snippets to ``rollbus up`` is substituted: its URL, its admin token and its
``rollbus-data/trajectories``. The stack's engine is the scripted SGLang server; every model
call gets a reply longer than the snippets' ``max_tokens``, as the default tiny random model
gives one (it seldom samples its end token), so the finish, the token counts and the records
are the ones shown.

The tables the README shows from ``rollbus demo`` and ``rollbus sessions`` are checked against
what those commands print, column names included.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest

from materializer.dataset import session_rows
from rollbus.commands.demo import _print_table
from rollbus.commands.sessions import table
from rollbus.testing.scripted import ScriptedReply
from tests.e2e.conftest import ADMIN_TOKEN

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- snippet: first-steps -->"
SNIPPET = re.compile(re.escape(MARKER) + r"\n```python\n(?P<code>.*?)```\n(?:\n```\n(?P<shown>.*?)```\n)?", re.S)
README_URL, README_TOKEN, README_RECORDS = "http://127.0.0.1:8000", "<admin token>", "rollbus-data/trajectories"
REPLY_TOKENS = 40  # longer than any snippet's max_tokens: the reply is cut there, finish "length"


def first_steps() -> list[tuple[str, str | None]]:
    """(code, the output shown under it) of each first-steps snippet, in README order."""
    text = README.read_text()
    found = [(m["code"], m["shown"]) for m in SNIPPET.finditer(text)]
    assert len(found) == text.count(MARKER), "a first-steps marker not followed by a ```python block"
    assert len(found) >= 4, "the README's first steps lost their snippets"
    return found


def for_stack(code: str, stack) -> str:
    """The snippet as it reads against ``stack`` instead of ``rollbus up`` on 127.0.0.1:8000."""
    code = code.replace(README_URL, stack.url).replace(README_TOKEN, ADMIN_TOKEN)
    code = code.replace(README_RECORDS, str(stack.trajectories))
    assert "127.0.0.1:8000" not in code, "a snippet names rollbus up's address in another form"
    return code


def wait_for_records(stack, session_id: str, timeout: float = 60.0) -> None:
    """The materializer writes a finalized session's records a moment after the finalize (a user's paste
    takes longer than that; this test does not)."""
    deadline = time.monotonic() + timeout
    while not session_rows(stack.trajectories, [session_id]):
        assert time.monotonic() < deadline, f"no records for {session_id}"
        time.sleep(0.1)


def run_snippets(snippets: list[tuple[str, str | None]], stack, engine, tokenizer, *,
                 check_output: bool = True) -> dict[str, Any]:
    """Execute the snippets in order in one namespace; each one's stdout must be the output shown under it."""
    words = tokenizer.encode(" ".join(["word"] * REPLY_TOKENS))[:REPLY_TOKENS]
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    for index, (code, shown) in enumerate(snippets):
        code = for_stack(code, stack)
        engine.push(*[ScriptedReply(token_ids=words) for _ in range(code.count(".create("))])
        if str(stack.trajectories) in code and "s" in namespace:
            wait_for_records(stack, namespace["s"]["session_id"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md first-steps snippet {index + 1}", "exec"), namespace)
        if check_output and shown is not None:
            assert out.getvalue() == shown, f"snippet {index + 1} printed\n{out.getvalue()}\nnot\n{shown}"
    return namespace


def test_the_first_steps_run_top_to_bottom_and_print_what_is_shown(stack, engine, tokenizer):
    snippets = first_steps()
    assert README_TOKEN in snippets[0][0] and README_URL in snippets[0][0]
    assert all(shown is not None for _, shown in snippets), "every first-steps snippet shows its output"
    namespace = run_snippets(snippets, stack, engine, tokenizer)
    assert namespace["done"]["status"] == "finalized"
    limits = [request["sampling_params"]["max_new_tokens"] for request in engine.requests]
    assert limits and all(limit <= 64 for limit in limits), f"a model call without a small max_tokens: {limits}"


def test_finalizing_before_the_anthropic_turn_is_refused(stack, engine, tokenizer):
    """The order matters: with the finalize moved before the Anthropic turn (as the README once had
    it) the Anthropic call gets 409, so the test above fails on such an order."""
    snippets = first_steps()
    anthropic_turn = next(i for i, (code, _) in enumerate(snippets) if "Anthropic(" in code)
    finalize = next(i for i, (code, _) in enumerate(snippets) if "/finalize" in code)
    assert anthropic_turn < finalize
    reordered = [s for i, s in enumerate(snippets) if i != finalize]
    reordered.insert(anthropic_turn, snippets[finalize])
    with pytest.raises(anthropic.ConflictError):
        run_snippets(reordered[: anthropic_turn + 2], stack, engine, tokenizer, check_output=False)


def _shown_table(header: str, page: Path = README) -> list[str]:
    """The lines of ``page``'s output block whose table header starts with the words ``header`` does."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == header.split()[:2])
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    return lines[start:end]


def test_the_demo_table_in_the_readme_is_what_the_demo_prints(capsys):
    _print_table([])
    header = capsys.readouterr().out.splitlines()[0]
    assert "num_turns" in header.split() and "turns" not in header.split()
    shown = _shown_table(header)
    assert shown[0] == header and shown[1] == "-" * len(header)


def test_the_sessions_table_in_the_docs_is_what_sessions_prints():
    header = table([], now=0.0).splitlines()[0]
    assert "model_turns" in header.split() and "turns" not in header.split()
    shown = _shown_table(header, README.parent / "docs" / "sessions.md")
    assert shown[0] == header and shown[1] == "-" * len(header)
