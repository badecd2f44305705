"""What the read-only tool commands (``replay``, ``sessions``) share: finding and joining the log.

The NATS server is ``--nats URL``, else ``$ROLLBUS_NATS``, else the one a running
``rollbus up`` announced in ``<data-dir>/edge.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.js.client import JetStreamContext

from rollbus.provision import connect
from schemas.errors import RollbusError
from schemas.log import LogConfig

# A tool's body: (JetStream, log names, parsed args) -> exit code.
ToolMain = Callable[[JetStreamContext, LogConfig, argparse.Namespace], Awaitable[int]]

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", metavar="URL", default=os.environ.get("ROLLBUS_NATS"),
                        help="the log's NATS server [$ROLLBUS_NATS, else the one in <data-dir>/edge.json]")
    parser.add_argument("--data-dir", type=Path, default=Path("rollbus-data"))
    parser.add_argument("--log-level", default="WARNING")


def nats_url(args: argparse.Namespace) -> str | None:
    if args.nats:
        return str(args.nats)
    state = Path(args.data_dir) / "edge.json"
    try:
        return str(json.loads(state.read_text())["nats_url"])
    except (OSError, ValueError, KeyError):
        return None


async def run_tool(args: argparse.Namespace, main: ToolMain, *, cfg: LogConfig = LogConfig()) -> int:
    """Connect, run ``main``, close; errors become a message on stderr and exit code 2."""
    url = nats_url(args)
    if url is None:
        print("rollbus: no NATS server: pass --nats URL (or run `rollbus up` in this --data-dir)", file=sys.stderr)
        return EXIT_ERROR
    try:
        nc = await connect(url, name=f"rollbus-{args.command}", timeout_s=10)
    except RollbusError as exc:
        print(f"rollbus: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return await main(nc.jetstream(), cfg, args)
    except RollbusError as exc:
        print(f"rollbus: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        await nc.close()
