"""rollbus.progress: plain lines and an aligned table off a terminal, a rich bar and table on one."""

from __future__ import annotations

import io

import pytest

from rollbus.progress import Progress, Stages, plain_table, rate_text, summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_plain_line_every_interval_and_one_at_the_end() -> None:
    clock, out = Clock(), io.StringIO()
    with Progress("export", unit="envelopes", total=100, stream=out, every_s=5.0, clock=clock) as progress:
        for done in range(1, 101):
            clock.now += 0.25  # 25 s in all: a line at 5, 10, 15, 20, 25 s, then the last one
            progress.update(done, detail=f"{done // 10} sessions")
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 == progress.lines
    assert lines[0] == "export: 20/100 envelopes (4 envelopes/s), 2 sessions"
    assert lines[-1] == "export: 100/100 envelopes (4 envelopes/s), 10 sessions"
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()  # no terminal codes in a log file


def test_a_short_run_prints_only_its_last_count_and_a_command_keeps_its_own_wording() -> None:
    clock, out = Clock(), io.StringIO()
    with Progress("verify", stream=out, clock=clock, line=lambda: "verify: 3 envelopes read") as progress:
        for done in range(3):
            progress.update(done + 1)
    assert out.getvalue() == "verify: 3 envelopes read\n"


def test_a_failed_run_prints_no_final_count() -> None:
    out = io.StringIO()
    try:
        with Progress("import", stream=out) as progress:
            progress.update(1)
            raise RuntimeError("refused")
    except RuntimeError:
        pass
    assert out.getvalue() == ""


def test_on_a_terminal_a_bar_with_count_and_rate_and_no_plain_lines() -> None:
    out = Terminal()
    with Progress("export", unit="envelopes", total=10, stream=out) as progress:
        progress.update(4)
    text = out.getvalue()
    assert progress.lines == 0 and "\x1b[" in text  # rich's terminal codes
    assert "export" in text and "4/10" in text and "envelopes/s" in text


def test_the_summary_table_is_aligned_text_off_a_terminal_and_a_rich_table_on_one() -> None:
    rows = [("sessions", "12"), ("envelopes", "3400"), ("pieces", "2 (3 MiB)")]
    out = io.StringIO()
    summary("export", rows, stream=out)
    assert out.getvalue().splitlines() == [
        "export:",
        "  sessions          12",
        "  envelopes       3400",
        "  pieces     2 (3 MiB)",
    ]
    assert plain_table("empty", []) == "empty:"
    terminal = Terminal()
    summary("export", rows, stream=terminal)
    drawn = terminal.getvalue()
    assert "┌" in drawn and "envelopes" in drawn and "3400" in drawn


def test_a_slow_rate_is_not_rounded_to_zero() -> None:
    """`rollbus demo` said "(0 sessions/s)" for 4 sessions in 39 s."""
    assert rate_text(4, 39.0, "sessions") == "0.1 sessions/s"
    assert rate_text(7, 2.0, "sessions") == "3.5 sessions/s"
    assert rate_text(1234, 1.0, "envelopes") == "1,234 envelopes/s"
    assert rate_text(1, 3600.0, "sessions") == "<0.01 sessions/s"
    assert rate_text(0, 5.0, "sessions") == "0 sessions/s"
    assert rate_text(3, 0.0, "sessions") == "- sessions/s"


def test_stages_off_a_terminal_a_line_as_each_begins_and_the_time_of_a_slow_one() -> None:
    clock, out = Clock(), io.StringIO()
    stages = Stages("rollbus up", stream=out, clock=clock)
    with stages("starting the embedded nats-server"):
        assert out.getvalue() == "rollbus up: starting the embedded nats-server\n"  # said before it waits
        clock.now += 2.5
    with stages("starting the projector"):
        clock.now += 0.2  # quick: no second line
    with pytest.raises(RuntimeError), stages("loading the engine"):
        clock.now += 5
        raise RuntimeError("no model")  # a failed stage: the error says the rest
    assert out.getvalue().splitlines() == [
        "rollbus up: starting the embedded nats-server",
        "rollbus up: starting the embedded nats-server: done in 2.5s",
        "rollbus up: starting the projector",
        "rollbus up: loading the engine",
    ]


def test_stages_on_a_terminal_a_spinner_then_a_line_each() -> None:
    clock, out = Clock(), Terminal()
    stages = Stages("rollbus up", stream=out, clock=clock)
    with stages("starting the embedded nats-server"):
        clock.now += 2.5
    with stages("starting the projector"):
        pass
    text = out.getvalue()
    assert "\x1b[" in text and "rollbus up:" not in text  # rich's, not the plain lines
    assert "starting the embedded nats-server" in text and "(2.5s)" in text and "starting the projector" in text
