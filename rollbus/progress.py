"""Progress of the long commands, the stages of a start-up, and the summary table they end with, on stderr.

On a terminal a ``rich`` progress bar shows the count (of the total when it is known) and
the rate; otherwise (a log file, a pipe, CI) a plain line every ``every_s`` seconds and one
at the end, so logs stay readable. :func:`summary` prints a two-column table the same
way: a ``rich`` table on a terminal, aligned text otherwise. Both write to stderr, so what
a command prints on stdout (its result lines, ``--json``) is unchanged.

::

    with Progress("export", unit="envelopes", total=last) as progress:
        for item in items:
            ...
            progress.update(done, detail=f"{sessions} sessions")
    summary("export", [("sessions", "12"), ("envelopes", "340")])

:class:`Stages` says what a start-up waits on (``rollbus up``: the nats-server, the log's streams, the
engine, the edge's first answer), one line as each stage begins and, when it took more than
``SLOW_STAGE_S``, one as it ends with how long it took; on a terminal a ``rich`` spinner turns while it
waits (never in a log: there the lines alone)::

    stages = Stages("rollbus up")
    with stages("starting the embedded nats-server"):
        ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Self, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

PLAIN_EVERY_S = 5.0
SLOW_STAGE_S = 1.0  # a stage that took longer says so as it ends


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def rate_text(done: int, elapsed_s: float, unit: str) -> str:
    """``done / elapsed_s`` per second, whole from 10 up, else to two significant digits (4 sessions in 39 s
    are ``0.1 sessions/s``, not ``0``)."""
    if elapsed_s <= 0:
        return f"- {unit}/s"
    rate = done / elapsed_s
    if rate >= 10 or rate == 0:
        return f"{rate:,.0f} {unit}/s"
    return f"{rate:.2g} {unit}/s" if rate >= 0.01 else f"<0.01 {unit}/s"


class Progress:
    """One command's progress: :meth:`update` with the count so far (cheap: call it per item).

    ``line``: the plain line to print instead of the default ``"<what>: <done>[/<total>] <unit>
    (<rate>) <detail>"`` (a command whose log lines are read keeps its own wording).
    ``tty``: force the mode (default: whether ``stream`` is a terminal); ``clock``: for tests.
    """

    def __init__(self, what: str, *, unit: str = "items", total: int | None = None, stream: TextIO | None = None,
                 every_s: float = PLAIN_EVERY_S, line: Callable[[], str] | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.unit, self.total = what, unit, total
        self.done, self.detail = 0, ""
        self._stream = stream if stream is not None else sys.stderr
        self._every_s, self._line, self._clock = every_s, line, clock
        self._tty = _is_tty(self._stream) if tty is None else tty
        self.started = clock()
        self._next_line = self.started + every_s
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self.lines = 0  # plain lines printed

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self.started

    def __enter__(self) -> Self:
        if self._tty:
            console = Console(file=self._stream, force_terminal=True)
            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                     TextColumn("{task.fields[detail]}"), console=console)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total, rate="", detail="")
        return self

    def update(self, done: int, *, total: int | None = None, detail: str = "") -> None:
        self.done, self.detail = done, detail
        if total is not None:
            self.total = total
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=self.total, detail=detail,
                             rate=rate_text(done, self.elapsed_s, self.unit))
            return
        now = self._clock()
        if now >= self._next_line:
            self._print_line()
            self._next_line = now + self._every_s

    def plain_line(self) -> str:
        if self._line is not None:
            return self._line()
        of = f"/{self.total}" if self.total is not None else ""
        detail = f", {self.detail}" if self.detail else ""
        return (f"{self.what}: {self.done}{of} {self.unit} ({rate_text(self.done, self.elapsed_s, self.unit)})"
                f"{detail}")

    def _print_line(self) -> None:
        print(self.plain_line(), file=self._stream, flush=True)
        self.lines += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif exc_type is None:
            self._print_line()  # the last count, always (a run shorter than every_s prints only this)


class Stages:
    """The stages of a start-up, said as they happen: call it with what a stage does (``"starting the
    projector"``) and run the stage inside the context it returns.

    Each stage prints ``<prefix>: <what>`` as it begins and, if it took over ``SLOW_STAGE_S``, ``<prefix>:
    <what>: done in <s>s`` as it ends (nothing more when it fails: the error says why). On a terminal the
    beginning is a ``rich`` spinner instead, replaced by the line ``<what> (<s>s)`` when the stage ends.
    ``tty``: force the mode (default: whether ``stream`` is a terminal); ``clock``: for tests.
    """

    def __init__(self, prefix: str, *, stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix = prefix
        self._stream = stream if stream is not None else sys.stderr
        self._tty = _is_tty(self._stream) if tty is None else tty
        self._clock = clock
        self._console = Console(file=self._stream, force_terminal=True) if self._tty else None

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        started = self._clock()
        if self._console is not None:
            with self._console.status(f"{what} ..."):
                yield
            took = self._clock() - started
            self._console.print(f"[green]✓[/green] {what}" + (f" [dim]({took:.1f}s)[/dim]" if took > SLOW_STAGE_S
                                                                 else ""), highlight=False)
            return
        self._line(what)
        yield
        if (took := self._clock() - started) > SLOW_STAGE_S:
            self._line(f"{what}: done in {took:.1f}s")

    def _line(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self._stream, flush=True)


def summary(title: str, rows: Sequence[tuple[str, str]], *, stream: TextIO | None = None,
            tty: bool | None = None) -> None:
    """A two-column table (what, how many): ``rich`` on a terminal, aligned plain text otherwise."""
    out = stream if stream is not None else sys.stderr
    if _is_tty(out) if tty is None else tty:
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column(justify="right")
        for name, value in rows:
            table.add_row(name, value)
        Console(file=out, force_terminal=True).print(table)
        return
    print(plain_table(title, rows), file=out, flush=True)


def plain_table(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """``title`` then one ``  name  value`` line per row, names padded and values right-aligned."""
    width = max((len(name) for name, _ in rows), default=0)
    value_width = max((len(value) for _, value in rows), default=0)
    return "\n".join([f"{title}:", *(f"  {name:<{width}}  {value:>{value_width}}" for name, value in rows)])
