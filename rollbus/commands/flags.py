"""The flags of the commands whose work needs NATS, Arrow, the viewer or the stack: ``replay``, ``materialize``,
``export``, ``import``, ``view`` and ``demo``.

They live apart from the commands' modules so that ``rollbus <command> --help`` (and a mistake in the flags)
is answered without importing what the command runs: each parser's ``run`` imports its module only when the
command runs (:func:`lazily`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
from collections.abc import Callable
from pathlib import Path

from rollbus.commands.record_flags import add_record_flags
from rollbus.tools import LOG_LEVEL_HELP, add_connection_args, duration, number

DEMO_MODEL = "smollm2"  # a real small model, so the demo shows real text
EXIT_STATUS = ("exit status: 0 when every session was read, whether or not --diff found differences (its last "
               "line says identical or different); 1 when some sessions were unreadable; 2 for a mistake (a "
               "missing --diff dataset, an --out that holds one, no log, no NATS server)")


def register(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Flags and defaults of those of these commands the CLI made parsers for."""
    for name, add in (("replay", _replay), ("materialize", _materialize), ("export", _export), ("view", _view),
                      ("demo", _demo)):
        if name in parsers:
            add(parsers)


def lazily(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """``run(args)`` that imports ``module`` and calls its ``name(args)``."""
    def run(args: argparse.Namespace) -> int:
        result: int = getattr(importlib.import_module(module), name)(args)
        return result

    return run


def since(text: str) -> dt.datetime:
    """An argparse ``type``: a duration back from now (``7d``, ``12h``) or an ISO 8601 time (UTC when naive)."""
    try:
        return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=duration(text))
    except argparse.ArgumentTypeError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration (7d, 12h) or an ISO time (2026-01-31T12:00): "
                                         f"{text!r}") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def _replay(parsers: dict[str, argparse.ArgumentParser]) -> None:
    parser = parsers["replay"]
    parser.add_argument("session_id", nargs="?", help="the session to replay or verify")
    parser.add_argument("--verify", action="store_true", help="compare re-derived records with the markers")
    parser.add_argument("--all", action="store_true", help="with --verify: every session in the log")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--request", type=int, metavar="N", help="print the raw body of request N")
    add_connection_args(parser)
    parser.set_defaults(run=lazily("rollbus.commands.replay", "run"))


def _materialize(parsers: dict[str, argparse.ArgumentParser]) -> None:
    cmd = parsers["materialize"]
    cmd.description = ("Rebuild the records of every finalized session from the log into a new "
                       "dataset; the log is --nats URL, else the running `rollbus up` of "
                       "--data-dir, else an embedded nats-server on <data-dir>/nats.")
    cmd.epilog = EXIT_STATUS
    cmd.add_argument("--from-log", action="store_true", required=True, help="read every session from the log")
    cmd.add_argument("--out", type=Path, required=True, help="directory of the new dataset (must hold none)")
    cmd.add_argument("--diff", type=Path, metavar="DIR",
                     help="then compare the new dataset with this earlier one (it must hold a dataset); "
                          "differences are printed and do not change the exit status")
    cmd.add_argument("--data-dir", type=Path, default=Path("rollbus-data"),
                     help="the stack's directory: its running `rollbus up` (edge.json), else its nats/ store "
                          "[./rollbus-data]")
    cmd.add_argument("--nats", metavar="URL", help="the log's NATS server [the running stack's, else embedded]")
    cmd.add_argument("--sessions-per-file", type=int, default=4096, help="sessions per Parquet file [4096]")
    cmd.add_argument("--log-level", default="WARNING", metavar="LEVEL", help=LOG_LEVEL_HELP)
    add_record_flags(cmd)
    cmd.set_defaults(run=lazily("rollbus.commands.materialize", "main"))


def _export(parsers: dict[str, argparse.ArgumentParser]) -> None:
    export = parsers["export"]
    export.description = ("Write the raw event log of one session, or of every session, as JSON "
                          "lines or Parquet, for long-term audit; `rollbus import` loads it back.")
    export.add_argument("session_id", nargs="?", help="the session to export")
    export.add_argument("--all", action="store_true", help="every session of the log")
    export.add_argument("--since", type=since, metavar="DURATION|ISO",
                        help="with --all: the sessions that appended at or after then (7d, 12h, 2026-01-31), "
                             "each whole")
    export.add_argument("--format", choices=["jsonl", "parquet"], default=None,
                        help="[parquet when -o ends in .parquet, else jsonl]")
    export.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the file to write (new)")
    add_connection_args(export)
    export.set_defaults(run=lazily("rollbus.commands.export", "run_export"))
    load = parsers["import"]
    load.description = ("Republish an export's sessions into a log: --nats URL, else the running "
                        "`rollbus up` of --data-dir, else an embedded nats-server on "
                        "<data-dir>/nats (created when missing).")
    load.epilog = ("exit status: 0 when every session is in the log; 2 when one was refused (the "
                   "log holds a different event for it), or for a mistake")
    load.add_argument("file", type=Path, help="a file written by `rollbus export`")
    add_connection_args(load)
    load.set_defaults(run=lazily("rollbus.commands.export", "run_import"))


def _view(parsers: dict[str, argparse.ArgumentParser]) -> None:
    parser = parsers["view"]
    parser.description = ("Serve the trajectory viewer: the session list (from the projections) "
                          "and each session's chains, tokens, turns, reward and audit trail "
                          "(replayed from the log).")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    parser.add_argument("--port", type=number(int, at_least=0, at_most=65535), default=8090,
                        help="port to listen on; 0: any free port [8090]")
    add_connection_args(parser)
    parser.set_defaults(run=lazily("rollbus.commands.view", "run"))


def _demo(parsers: dict[str, argparse.ArgumentParser]) -> None:
    demo = parsers["demo"]
    demo.description = ("Run calculator-agent sessions (OpenAI SDK, one tool) through a stack, post their rewards, "
                        "finalize them and print one line per materialized trajectory. The stack is the edge of --url, "
                        "else the running `rollbus up` of --data-dir, else an embedded one started in --data-dir.")
    demo.epilog = ("exit status: 0 when every session was materialized; 1 when some were not in time; 2 for a mistake "
                   "(no edge at --url, a refused admin token, a --model that does not exist, an unusable --data-dir)")
    demo.add_argument("--url", metavar="URL",
                      help="a running edge, e.g. http://127.0.0.1:8000 [the one in <data-dir>/edge.json, "
                           "else an embedded stack]")
    demo.add_argument("--admin-token", default=None, metavar="TOKEN",
                      help="the edge's admin token [with --url: $ROLLBUS_ADMIN_TOKEN; a running stack: its "
                           "edge.json's; an embedded stack: $ROLLBUS_ADMIN_TOKEN, else generated]")
    demo.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                      help="the stack's directory: its edge.json, or the embedded stack's NATS store, and the "
                           "trajectories/ the records are read from (with --url: only when given) [./rollbus-data]")
    demo.add_argument("--sessions", type=number(int, at_least=1), default=4, metavar="N",
                      help="agent sessions to run, two per prompt [4]")
    demo.add_argument("--max-tokens", type=number(int, at_least=1), default=48, metavar="N",
                      help="max_tokens of each model call [48]")
    demo.add_argument("--model", default=None, metavar="NAME|PATH",
                      help=f"the embedded stack's local model: tiny-qwen2, smollm2, a model dir or a .gguf file "
                           f"[{DEMO_MODEL}; tiny-qwen2 when it is not installed]; refused with --url")
    demo.add_argument("--log-level", default="WARNING", metavar="LEVEL", help=LOG_LEVEL_HELP)
    demo.set_defaults(run=lazily("rollbus.commands.demo", "main"))
