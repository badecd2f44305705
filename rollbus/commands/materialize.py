"""``rollbus materialize --from-log``: rebuild the records of every finalized session into a new dataset.

::

    rollbus materialize --from-log --out DIR [--prompt-length P --response-length R]
                        [--mask-unfinished-episode] [--trajectory-selection longest]
                        [--reward-scorer MODULE:ATTR] [--diff EARLIER_DIR]

The log comes from ``--nats URL``, else the running ``rollbus up`` of ``--data-dir``, else
an embedded nats-server on ``<data-dir>/nats`` (which must hold a log). Progress goes to
stderr (a bar on a terminal, else a line every 5 s and one at the end, then a summary table);
``--diff`` then compares the new output with an earlier one, key by key, and prints
``identical`` or ``different`` last.

Exit status (:data:`rollbus.commands.flags.EXIT_STATUS`): 0 when every session was read, whether or not the diff
found differences (read its last line); 1 when some sessions' events were unreadable; 2
for a mistake (a missing ``--diff`` dataset, an ``--out`` that holds one, no log, no NATS).

The record flags (:mod:`rollbus.commands.record_flags`) are shared with ``rollbus up`` and
``rollbus materializer``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time

from materializer.dataset import dataset_files, read_dataset
from materializer.diff import diff_tables, render
from materializer.parquet import ParquetSink
from materializer.rematerialize import Progress, Rematerializer
from reward.scorer import RewardScorer, load_scorer
from rollbus.commands.record_flags import padding, record_options
from rollbus.progress import Progress as Shown
from rollbus.progress import rate_text, summary
from rollbus.tools import find_log, opened_log
from schemas.errors import UserError
from schemas.log import LogConfig
from stack.provision import connect
from stack.user_error import check_writable_dir


def main(args: argparse.Namespace) -> int:
    """``rollbus materialize``."""
    return asyncio.run(run(args))


def _check(args: argparse.Namespace) -> RewardScorer | None:
    """Refuse, before reading the log, what would fail late or compare against nothing; the reward scorer."""
    padding(args)
    if args.diff is not None:
        if not args.diff.is_dir():
            raise UserError(f"--diff {args.diff}: no such directory")
        if not dataset_files(args.diff):
            raise UserError(f"--diff {args.diff}: holds no dataset (no part-*.parquet files)")
    if args.out.is_dir() and dataset_files(args.out):
        raise UserError(f"--out {args.out} already holds a dataset; choose a new --out")
    if not args.reward_scorer:
        return None
    try:
        return load_scorer(args.reward_scorer)
    except (ValueError, ImportError, AttributeError) as exc:
        raise UserError(f"--reward-scorer {args.reward_scorer}: {exc}") from exc


def _line(progress: Progress) -> str:
    elapsed = max(time.monotonic() - progress.started, 1e-9)
    share = 100.0 * progress.position / max(progress.last, 1)
    return (f"  log {progress.position}/{progress.last} ({share:.0f}%)  sessions {progress.sessions}  "
            f"records {progress.records}  {rate_text(progress.sessions, elapsed, 'sessions')}")


def _reporter(shown: Shown, progress: Progress) -> None:
    shown.update(progress.position, total=progress.last,
                 detail=f"{progress.sessions} sessions, {progress.records} records")


async def run(args: argparse.Namespace) -> int:
    scorer = _check(args)
    place = await find_log(args)
    check_writable_dir(args.out, flag="--out")
    async with opened_log(place, name="rollbus-materialize") as url:
        return await _rematerialize(args, url, scorer)


async def _rematerialize(args: argparse.Namespace, url: str, scorer: RewardScorer | None) -> int:
    sink = ParquetSink(args.out, padding=padding(args))
    worker = Rematerializer(sink, options=record_options(args), scorer=scorer,
                            sessions_per_file=args.sessions_per_file)
    nc = await connect(url, name="rollbus-materialize")
    try:
        with Shown("materialize", unit="envelopes", line=lambda: _line(worker.progress)) as shown:
            progress = await worker.run(nc.jetstream(), LogConfig(), report=functools.partial(_reporter, shown),
                                        every=0.2)
    finally:
        await nc.close()
    elapsed = time.monotonic() - progress.started
    summary("materialize", [("log envelopes", str(progress.position)), ("finalized sessions", str(progress.sessions)),
                            ("records", str(progress.records)), ("files", str(progress.files)),
                            ("aborted", str(progress.aborted)), ("still open", str(progress.open)),
                            ("unreadable", str(progress.errors)),
                            ("rate", rate_text(progress.sessions, elapsed, "sessions"))])
    print(f"rematerialized {progress.sessions} finalized sessions into {progress.records} records "
          f"({progress.files} files) in {args.out} in {elapsed:.1f}s; {progress.aborted} aborted, "
          f"{progress.open} still open, {progress.errors} unreadable")
    if args.diff is not None:
        diff = diff_tables(read_dataset(args.diff), read_dataset(args.out))
        print(f"diff against {args.diff}:")
        print(render(diff))
    return 0 if progress.errors == 0 else 1
