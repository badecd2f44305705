"""``rollbus view``: the trajectory viewer, a web page over the log (``viewer/``).

::

    rollbus view                          against the `rollbus up` of ./rollbus-data (its edge.json), else
                                          an embedded nats-server on ./rollbus-data/nats
    rollbus view --nats URL --port 8090   against any log's NATS server

It prints the URL it serves and runs until Ctrl-C. The list comes from the projections (as
``rollbus sessions``); a session page replays the session from the log, so any past session
opens, and polls while the session is open.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from nats.js.client import JetStreamContext

from rollbus.tools import EXIT_ERROR, EXIT_OK, add_connection_args, number, run_tool
from schemas.errors import UserError
from schemas.log import LogConfig
from viewer.server import Viewer


def register(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Flags and defaults of the commands this module runs, on the parsers the CLI made for them."""
    parser = parsers["view"]
    parser.description = ("Serve the trajectory viewer: the session list (from the projections) "
                          "and each session's chains, tokens, turns, reward and audit trail "
                          "(replayed from the log).")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    parser.add_argument("--port", type=number(int, at_least=0, at_most=65535), default=8090,
                        help="port to listen on; 0: any free port [8090]")
    add_connection_args(parser)
    parser.set_defaults(run=lambda args: asyncio.run(run_tool(args, view_main)))


async def view_main(js: JetStreamContext, cfg: LogConfig, args: argparse.Namespace) -> int:
    viewer = Viewer(js, cfg, host=args.host, port=args.port)
    try:
        url = viewer.start()
    except UserError as exc:
        print(f"rollbus view: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    print(f"rollbus view: serving {url} (the log at {args.log_url}); Ctrl-C stops it", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await viewer.stop()
    return EXIT_OK
