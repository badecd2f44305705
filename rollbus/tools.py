"""What the command-line tools share: user mistakes as one line, finding and joining the log.

Every tool that reads or writes the log (``replay``, ``sessions``, ``export``, ``import``,
``view``, ``materialize``) finds it the same way (:func:`find_log`, :func:`opened_log`):
``--nats URL`` (``$ROLLBUS_NATS`` for all but ``materialize``), else the NATS server of the
``rollbus up`` running on ``--data-dir`` (its ``<data-dir>/edge.json``, while its pid lives),
else an embedded nats-server the tool starts on ``<data-dir>/nats`` and stops when it is done.
That store must exist (a typo'd ``--data-dir`` is refused: "no log"), except for ``import``,
which creates a fresh one. A store another process has open is refused in one line (one store
takes one server: :meth:`stack.nats_server.EmbeddedNats.start`).

A mistake the user can fix (a busy port, no NATS server where ``--nats`` points, an
unwritable ``--data-dir``) is a :class:`~schemas.errors.UserError`: the CLI prints its
message as one line on stderr and exits with :data:`EXIT_ERROR`, never with a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import math
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from schemas.errors import RollbusError, UserError
from schemas.log import LogConfig
from stack.user_error import check_writable_dir, one_line

if TYPE_CHECKING:  # (the CLI's parser is built without NATS: `--help` answers at once)
    from nats.js.client import JetStreamContext

# A tool's body: (JetStream, log names, parsed args) -> exit code.
ToolMain = Callable[["JetStreamContext", LogConfig, argparse.Namespace], Awaitable[int]]

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2

LOG_LEVEL_HELP = "logging level on stderr: DEBUG, INFO, WARNING, ERROR [%(default)s]"
NATS_PROBE_TIMEOUT_S = 2.0


def number(kind: type[int] | type[float], *, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None) -> Callable[[str], int | float]:
    """An argparse ``type`` for a number within bounds: a nonsensical setting (a trajectory length of
    0, a negative timeout) is refused before anything starts, in argparse's one line."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if kind is float and not math.isfinite(value):  # NaN would pass every bound
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least:g}, not {text}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be more than {above:g}, not {text}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most:g}, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
               "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def duration(text: str) -> float:
    """An argparse ``type``: seconds from ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a bare number of seconds
    (``0``: none); a negative, unitless-unknown or non-finite value is refused in one line."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([smhdw]?)\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration (e.g. 30d, 12h, 90m, 45s; 0: unlimited): {text!r}")
    return float(match[1]) * _DURATION_UNITS[match[2] or "s"]


def size(text: str) -> int:
    """An argparse ``type``: bytes from ``500GiB``, ``500G`` (both 1024-based), ``2TB`` (1000-based) or a bare
    number (``0``: none)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match[2] not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size (e.g. 500GiB, 2TB, 1048576; 0: unlimited): {text!r}")
    return int(float(match[1]) * _SIZE_UNITS[match[2]])


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", metavar="URL", default=os.environ.get("ROLLBUS_NATS"),
                        help="the log's NATS server [$ROLLBUS_NATS, else the running `rollbus up` of --data-dir, "
                             "else an embedded one on <data-dir>/nats]")
    parser.add_argument("--data-dir", type=Path, default=Path("rollbus-data"),
                        help="the stack's directory: its running `rollbus up` (edge.json), else its nats/ store "
                             "[./rollbus-data]")
    parser.add_argument("--log-level", default="WARNING", metavar="LEVEL", help=LOG_LEVEL_HELP)


def running_nats(data_dir: Path) -> str | None:
    """The NATS URL of the ``rollbus up`` running on ``data_dir`` (its edge.json, while its pid lives), else None."""
    try:
        info = json.loads((data_dir / "edge.json").read_text())
        os.kill(int(info["pid"]), 0)
        return str(info["nats_url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def embedded_store(data_dir: Path, *, create: bool = False) -> Path:
    """``<data-dir>/nats`` for an embedded nats-server: it must hold a log unless ``create``, and the data dir
    must be writable (the server writes its store, log, ports and lock files there)."""
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} is a file, not a directory")
    store = data_dir / "nats"
    if not create and not store.is_dir():
        raise UserError(f"no log: no NATS server given (--nats URL), no running `rollbus up` in --data-dir "
                        f"{data_dir}, and no nats/ store there to open")
    check_writable_dir(data_dir, flag="--data-dir", subdirs=("nats",))
    return store


async def find_log(args: argparse.Namespace, *, create: bool = False) -> str | Path:
    """Where the log is (see the module docstring): a NATS URL something answers at, or the store to start an
    embedded server on (checked, not started: :func:`opened_log` starts it)."""
    if args.nats:
        await check_nats(str(args.nats))
        return str(args.nats)
    url = running_nats(Path(args.data_dir))
    if url is not None:
        await check_nats(url, where=f" (the running stack's, in {Path(args.data_dir) / 'edge.json'})")
        return url
    return embedded_store(Path(args.data_dir), create=create)


@contextlib.asynccontextmanager
async def opened_log(place: str | Path, *, name: str) -> AsyncIterator[str]:
    """The URL of ``place`` (from :func:`find_log`): as it is, or an embedded server started on the store and
    stopped on leaving."""
    if isinstance(place, str):
        yield place
        return
    from stack.nats_server import EmbeddedNats

    embedded = await asyncio.to_thread(EmbeddedNats(place, name=name).start)
    try:
        yield embedded.url
    finally:
        await asyncio.to_thread(embedded.stop)


def _server_address(server: str) -> tuple[str, int]:
    """(host, port) of one server of a NATS URL, as nats-py reads it (no scheme: ``nats://``; port 4222)."""
    parts = urlsplit(server if "://" in server else f"nats://{server}")
    port = parts.port  # ValueError for a port that is not a number or out of range
    if not parts.hostname:
        raise ValueError("no host")
    return parts.hostname, port or 4222


_UNKNOWN_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_NO_ROUTE_HERE = {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH}  # e.g. ::1 without IPv6


async def _refusal(server: str, timeout_s: float) -> str | None:
    """Why ``server`` certainly has no NATS server (refused, unknown host, a bad URL), else None."""
    try:
        host, port = _server_address(server)
    except ValueError as exc:
        return f"{server!r} is not a NATS URL ({exc})"
    try:
        addresses = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"unknown host {host!r}" if exc.errno in _UNKNOWN_HOST else None
    refused = False
    for *_, address in addresses:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address[0], address[1]), timeout_s)
        except ConnectionRefusedError:
            refused = True
            continue
        except TimeoutError:
            return None  # slow, or unreachable for now: the client's own bounded connect decides
        except OSError as exc:
            if exc.errno in _NO_ROUTE_HERE:
                continue
            return None  # the same
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return None
    return "connection refused" if refused else None


async def nats_problem(url: str, *, timeout_s: float = NATS_PROBE_TIMEOUT_S) -> str | None:
    """Why nothing can answer at the NATS ``url`` (a comma-separated list: one answering is enough), else None.

    Only definite answers count (a refused connection, an unknown host, a malformed URL);
    a host that does not answer in time is left to :func:`stack.provision.connect`, which
    waits for it within its own bound.
    """
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if not servers:
        return "an empty NATS URL"
    reasons = [await _refusal(server, timeout_s) for server in servers]
    if any(reason is None for reason in reasons):
        return None
    return "; ".join(sorted(set(r for r in reasons if r)))


async def check_nats(url: str, *, where: str = "") -> None:
    """Raise :class:`UserError` when no NATS server can answer at ``url``; ``where`` says where it came from."""
    problem = await nats_problem(url)
    if problem is not None:
        raise UserError(f"no NATS server at {url}{where}: {problem}")


async def run_tool(args: argparse.Namespace, main: ToolMain, *, cfg: LogConfig = LogConfig()) -> int:
    """Find the log (:func:`find_log`), connect, run ``main``, close; errors become one line on stderr and exit
    code 2. ``args.log_url`` is the URL it ran against."""
    from stack.provision import connect

    try:
        place = await find_log(args)
        async with opened_log(place, name=f"rollbus-{args.command}") as url:
            args.log_url = url
            nc = await connect(url, name=f"rollbus-{args.command}", timeout_s=10)
            try:
                return await main(nc.jetstream(), cfg, args)
            finally:
                await nc.close()
    except UserError as exc:
        print(f"rollbus {args.command}: {one_line(str(exc))}", file=sys.stderr)
    except RollbusError as exc:
        print(f"rollbus {args.command}: {one_line(exc.message)}", file=sys.stderr)
    return EXIT_ERROR
