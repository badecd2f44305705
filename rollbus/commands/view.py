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

from rollbus.tools import EXIT_ERROR, EXIT_OK, run_tool
from schemas.errors import UserError
from schemas.log import LogConfig
from viewer.server import Viewer


def run(args: argparse.Namespace) -> int:
    """``rollbus view``."""
    return asyncio.run(run_tool(args, view_main))


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
