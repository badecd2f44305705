"""The ``rollbus`` command line.

::

    rollbus up            the whole stack in the foreground (embedded NATS unless --nats)
    rollbus edge          the HTTP edge alone            (--nats URL)
    rollbus projector     the session projector alone    (--nats URL)
    rollbus materializer  the materializer alone         (--nats URL)
    rollbus demo          sample agent sessions through a running or embedded stack
    rollbus replay        a session rebuilt from the log; --verify checks what was materialized
    rollbus sessions      sessions with status, model turns, chains, reward (from the projections)
    rollbus materialize   rebuild training records from the log (--from-log)
    rollbus rollout       the verl rollout adapter over a prompts dataset (no trainer)
    rollbus export        sessions' raw log to JSON lines or Parquet (audit); rollbus import loads one back
    rollbus view          the trajectory viewer: a web page of sessions, chains and tokens

A user's mistake (a busy port, no NATS server at ``--nats``, a missing ``--model``, an
unwritable ``--data-dir``, a bad flag) is answered with one line on stderr and exit status
2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, NoReturn

import msgspec

from edge.settings import EdgeSettings
from rollbus.tools import EXIT_ERROR, LOG_LEVEL_HELP, check_nats, duration, number, size
from schemas.errors import RollbusError, UserError
from schemas.log import COMPONENTS, MAX_PAYLOAD, LogConfig
from stack.nats_server import FSYNC_MODES
from stack.user_error import one_line

if TYPE_CHECKING:  # the rest is imported where it is used: `rollbus --help` answers without loading the stack
    from materializer.service import MaterializerOptions
    from stack.provision import Retention
    from stack.runtime import Stack, StackOptions

class Command(NamedTuple):
    """A command beyond the stack itself: the module whose ``register(parsers)`` gives its flags and sets
    ``run(args) -> int`` as its parser's default, imported only when the command is the one asked for."""

    module: str
    help: str


TOOLS: dict[str, Command] = {
    "demo": Command("rollbus.commands.flags", "run sample agent sessions and summarize the records"),
    "replay": Command("rollbus.commands.flags", "rebuild a session from the log; --verify checks materialized "
                                                  "records"),
    "sessions": Command("rollbus.commands.sessions", "list sessions with status, model turns, chains and reward"),
    "materialize": Command("rollbus.commands.flags", "rebuild training records from the log into a new "
                                                            "dataset"),
    "rollout": Command("rollbus.commands.rollout", "run agent rollouts over a prompts dataset (no trainer)"),
    "view": Command("rollbus.commands.flags", "the trajectory viewer: a web page of sessions and their tokens"),
    "export": Command("rollbus.commands.flags", "write sessions' raw log (envelopes, pieces, markers) to a file"),
    "import": Command("rollbus.commands.flags", "load an export into a log (idempotent)"),
}
STACK_HELP = {"up": "run the whole stack in the foreground", "edge": "run the HTTP edge alone",
              "projector": "run the session projector alone", "materializer": "run the materializer alone"}

STATE_FILE = "edge.json"  # <data-dir>/edge.json: where a running `rollbus up` can be reached


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


class EdgeInfo(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    admin_token: str
    nats_url: str
    pid: int


def _common(parser: argparse.ArgumentParser, *, edge: bool, nats_required: bool) -> None:
    """The stack commands' flags; each default is :class:`~stack.options.StackOptions`' (``[...]`` in its help)."""
    from stack.options import StackOptions

    d = StackOptions()
    parser.add_argument("--data-dir", type=Path, default=d.data_dir,
                        help=f"NATS store and Parquet output (trajectories/) [./{d.data_dir}]")
    parser.add_argument("--nats", metavar="URL", required=nats_required, default=None,
                        help="the log's NATS server (required)" if nats_required else
                             "use this NATS server instead of starting an embedded one")
    parser.add_argument("--log-level", default="INFO", metavar="LEVEL", help=LOG_LEVEL_HELP)
    parser.add_argument("--replicas", type=number(int, at_least=1, at_most=5), default=d.replicas, metavar="N",
                        help="cluster nodes that keep the log's streams and buckets (3 on a three-node NATS "
                             "cluster, see docs/operations.md); applied to existing ones too [new: 1; existing: as is]")
    if not edge:
        return
    parser.add_argument("--host", default=d.host, help=f"address the edge listens on [{d.host}]")
    parser.add_argument("--port", type=number(int, at_least=0, at_most=65535), default=d.port,
                        help=f"port the edge listens on; 0: any free port [{d.port}]")
    parser.add_argument("--engine", choices=["local", "sglang", "vllm"], default=d.engine,
                        help=f"local: an in-process CPU model (--model); sglang, vllm: servers at --engine-url "
                             f"[{d.engine}]")
    parser.add_argument("--engine-url", action="append", default=list(d.engine_urls), metavar="URL",
                        help="engine server URL (repeatable; sessions are spread over them and stick)")
    parser.add_argument("--model", default=d.model, metavar="NAME|PATH",
                        help="local engine's model: tiny-qwen2 (default), tiny-qwen2-vl (takes images), smollm2, "
                             "a model dir or a .gguf file")
    parser.add_argument("--engine-timeout", type=number(float, above=0), default=d.engine_timeout, metavar="SECONDS",
                        help="sglang/vllm: the longest wait for the engine's reply, or its next byte or streamed "
                             f"event; past it the turn is 504 [{d.engine_timeout:g}]")
    parser.add_argument("--engine-deadline", type=number(float, above=0), default=d.engine_deadline, metavar="SECONDS",
                        help="sglang/vllm: the longest one engine call may take, its whole reply, streamed or "
                             f"not (set it above your longest generation); past it the turn is 504 "
                             f"[{d.engine_deadline:g}]")
    parser.add_argument("--health-interval", type=number(float, above=0), default=d.health_interval,
                        metavar="SECONDS", help=f"sglang/vllm: probe each server's /health this often "
                                                f"[{d.health_interval:g}]")
    parser.add_argument("--tokenizer", default=None,  # None: the model's (stack.runtime.model_defaults)
                        help="builtin:qwen2.5, builtin:qwen3 (thinking), builtin:qwen3-coder, builtin:smollm2 "
                             "or a local HF tokenizer dir [the model's, else qwen2.5]")
    parser.add_argument("--tool-format", default=None,
                        help="tool-call parser: hermes, qwen3_coder, llama3, smollm2, none or sglang:NAME; must "
                             "match the chat template (checked at startup) [the model's, else hermes]")
    parser.add_argument("--reasoning-format", default=d.reasoning_format,
                        help="reasoning parser: think (<think> ... </think>) or sglang:NAME (SGLang's reasoning "
                             f"parser NAME: qwen3, deepseek-r1, kimi_k2, gpt-oss, ...) [{d.reasoning_format}]")
    parser.add_argument("--max-trajectory-length", type=number(int, at_least=2), default=d.max_trajectory_length,
                        metavar="TOKENS", help="prompt + response tokens per chain; past it the chain is closed "
                                               f"[{d.max_trajectory_length}]")
    parser.add_argument("--admin-token", default=os.environ.get("ROLLBUS_ADMIN_TOKEN", d.admin_token),
                        help="admin bearer token [$ROLLBUS_ADMIN_TOKEN; generated when absent]")
    parser.add_argument("--edge-id", default=d.edge_id,
                        help="unique among running edges; a restarted edge with the same id takes its sessions "
                             "back at once [<hostname>:<port>]")
    parser.add_argument("--lease-ttl", type=number(float, above=0), default=d.lease_ttl_s, metavar="SECONDS",
                        help=f"session lease: another edge may take over a dead edge's sessions after it "
                             f"[{d.lease_ttl_s:g}]")
    parser.add_argument("--idle-timeout", type=number(float, at_least=0), default=d.idle_timeout_s, metavar="SECONDS",
                        help=f"abort open sessions nothing touched for this long; 0: never [{d.idle_timeout_s:g}]")
    parser.add_argument("--send-timeout", type=number(float, above=0), default=d.send_timeout, metavar="SECONDS",
                        help="disconnect a client that takes none of its reply (its receive window closed) for "
                             f"this long [{d.send_timeout:g}]")
    parser.add_argument("--body-min-rate", type=_rate, default=d.body_min_rate, metavar="SIZE",
                        help="bytes a second a request body must arrive at: refused (400) past "
                             f"{EdgeSettings().body_base_s:g} s + its size at this rate "
                             f"[{_size_text(d.body_min_rate)}]")
    _image_flags(parser)


def _image_flags(parser: argparse.ArgumentParser) -> None:
    """Images (README *Images*): the processor, the limits, and the hosts image URLs may be fetched from."""
    from stack.options import StackOptions

    d = StackOptions()
    group = parser.add_argument_group("images")
    group.add_argument("--processor", default=None, metavar="builtin:qwen2.5-vl|PATH",  # None: the model's
                       help="the image processor (builtin:qwen2.5-vl, or a local Hugging Face processor dir; "
                            "nothing is downloaded); without one, a request with an image is refused (400) "
                            "[the local model's (tiny-qwen2-vl: builtin:qwen2.5-vl), else none]")
    group.add_argument("--image-max-count", type=number(int, at_least=1), default=d.max_images, metavar="N",
                       help=f"images in one request, its history's included [{d.max_images}]")
    group.add_argument("--image-max-bytes", type=_positive_size, default=d.max_image_bytes, metavar="SIZE",
                       help=f"bytes of one image, decoded or fetched (413 past it) [{_size_text(d.max_image_bytes)}]")
    group.add_argument("--image-max-pixels", type=number(int, at_least=1), default=d.max_image_pixels, metavar="N",
                       help="width x height an image's header may declare (a decompression bomb is refused before "
                            f"decoding) [{d.max_image_pixels}]")
    group.add_argument("--image-max-side", type=number(int, at_least=1), default=d.max_image_side, metavar="PIXELS",
                       help=f"an image's width or height [{d.max_image_side}]")
    group.add_argument("--image-fetch-allow", action="append", default=list(d.image_fetch_allow), metavar="HOST",
                       help="fetch http(s) image URLs from this host (repeatable); none: image URLs are refused "
                            "(400), only data URLs and base64 are taken [none]")
    group.add_argument("--image-fetch-timeout", type=number(float, above=0), default=d.image_fetch_timeout_s,
                       metavar="SECONDS", help=f"one image fetch, to its last byte [{d.image_fetch_timeout_s:g}]")


def _positive_size(text: str) -> int:
    """A size (``10MiB``) more than 0."""
    value = size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _size_text(count: float) -> str:
    """A byte count as ``--body-min-rate`` is written: ``64KiB``, ``1MiB``, else plain bytes."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= factor and count % factor == 0:
            return f"{int(count // factor)}{unit}"
    return f"{count:g}"


def _rate(text: str) -> int:
    """``--body-min-rate``: bytes a second, written as a size (``64KiB``); more than 0."""
    rate = size(text)
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return rate


def _materializer_flags(parser: argparse.ArgumentParser) -> None:
    from materializer.options import MaterializerOptions
    from rollbus.commands import record_flags

    d = MaterializerOptions()
    group = parser.add_argument_group("materializer")
    group.add_argument("--transfer-queue", action="store_true",
                       help="also write records to TransferQueue (verl's data plane), beside Parquet")
    group.add_argument("--ray-address", default=d.ray_address,
                       help="join the TransferQueue of this Ray cluster (e.g. verl's trainer's); default: host one in "
                            "this process")
    group.add_argument("--tq-partition", default=d.tq_partition,
                       help=f"the TransferQueue partition to write [{d.tq_partition}]")
    group.add_argument("--rollout-n", type=number(int, at_least=1), default=d.rollout_n,
                       help=f"sessions per prompt when a session's metadata has no rollout_n [{d.rollout_n}]")
    group.add_argument("--batch-size", type=number(int, at_least=1), default=d.max_batch,
                       help=f"ready sessions per materialized batch [{d.max_batch}]")
    group.add_argument("--batch-delay", type=number(float, at_least=0), default=d.max_delay,
                       help=f"seconds a batch waits for more sessions after its first [{d.max_delay:g}]")
    group.add_argument("--ack-wait", type=number(float, above=0), default=d.ack_wait,
                       help=f"seconds before JetStream redelivers a batch nobody acknowledged [{d.ack_wait:g}]")
    record_flags.add_record_flags(parser)


def _materializer_options(args: argparse.Namespace) -> MaterializerOptions:
    from materializer.options import MaterializerOptions
    from rollbus.commands import record_flags

    return MaterializerOptions(
        records=record_flags.record_options(args), rollout_n=args.rollout_n, padding=record_flags.padding(args),
        transfer_queue=args.transfer_queue, ray_address=args.ray_address, tq_partition=args.tq_partition,
        reward_scorer=args.reward_scorer, max_batch=args.batch_size, max_delay=args.batch_delay,
        ack_wait=args.ack_wait)


def _log_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("log")
    group.add_argument("--retention-max-age", type=duration, default=0.0, metavar="DURATION",
                       help="delete the log's envelopes older than this (30d, 12h; sessions lose their start: "
                            "export them first); 0: never [0]")
    group.add_argument("--retention-max-bytes", type=size, default=0, metavar="SIZE",
                       help="the log's size limit (500GiB, 2TB): past it appends are refused (503), nothing is "
                            "deleted; 0: only JetStream's store limit [0]")
    group.add_argument("--fsync", choices=FSYNC_MODES, default="default",
                       help="always: the embedded nats-server syncs every write to disk before acknowledging it "
                            "(survives a host crash; see ops/bench/fsync_cost.py); default: every 2 min [default]")


def _retention(args: argparse.Namespace) -> Retention | None:
    """The log's limits from ``rollbus up``'s flags (other commands leave them as they are)."""
    from stack.provision import Retention

    if not hasattr(args, "retention_max_age"):
        return None
    window = LogConfig().duplicate_window_s
    if 0 < args.retention_max_age < window:
        raise UserError(f"--retention-max-age must be 0 (unlimited) or at least the duplicate window, {window:g}s")
    if 0 < args.retention_max_bytes < MAX_PAYLOAD:
        raise UserError(f"--retention-max-bytes must be 0 (unlimited) or at least {MAX_PAYLOAD} (one envelope)")
    return Retention(max_age_s=args.retention_max_age, max_bytes=args.retention_max_bytes)


PROJECTOR_METRICS_PORT = 9310  # where `rollbus projector` serves /metrics by default
MATERIALIZER_METRICS_PORT = 9311  # and `rollbus materializer`


def _metrics_port(text: str) -> int | None:
    """``--metrics-port``: a port, 0 (any free one) or ``off``."""
    if text.lower() == "off":
        return None
    try:
        return int(number(int, at_least=0, at_most=65535)(text))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (a port 0-65535, or off)") from None


def _metrics_flags(parser: argparse.ArgumentParser, default: int) -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument("--metrics-port", type=_metrics_port, default=default, metavar="PORT",
                       help=f"serve Prometheus metrics at http://HOST:PORT/metrics; 0: any free port (printed); "
                            f"off: none [{default}]")
    from stack.options import StackOptions

    host = StackOptions().metrics_host
    group.add_argument("--metrics-host", default=host, metavar="HOST", help=f"address /metrics listens on [{host}]")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, only that command's flags are added (its module alone is imported), so
    that ``rollbus --help`` and ``rollbus <command> --help`` answer at once; ``""``: no command's flags."""
    parser = Parser(prog="rollbus", description="Event-sourced trajectory gateway for agentic RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {name: sub.add_parser(name, help=text) for name, text in
               [*STACK_HELP.items(), *((name, tool.help) for name, tool in TOOLS.items())]}
    wanted = set(parsers) if command is None else {command}
    if "up" in wanted:
        _common(parsers["up"], edge=True, nats_required=False)
        _log_flags(parsers["up"])
        _materializer_flags(parsers["up"])
    if "edge" in wanted:
        _common(parsers["edge"], edge=True, nats_required=True)
    if "projector" in wanted:
        _common(parsers["projector"], edge=False, nats_required=True)
        _metrics_flags(parsers["projector"], PROJECTOR_METRICS_PORT)
    if "materializer" in wanted:
        _common(parsers["materializer"], edge=False, nats_required=True)
        _metrics_flags(parsers["materializer"], MATERIALIZER_METRICS_PORT)
        _materializer_flags(parsers["materializer"])
    modules = dict.fromkeys(TOOLS[name].module for name in TOOLS if name in wanted)
    for module in modules:  # (a module registers every command it runs: export and import)
        importlib.import_module(module).register({name: parsers[name] for name in TOOLS
                                                  if TOOLS[name].module == module})
    return parser


def _command_of(argv: list[str]) -> str:
    """The command ``argv`` names (its first word), or ``""`` when it names none the parser knows."""
    first = argv[0] if argv else ""
    return first if first in STACK_HELP or first in TOOLS else ""


def _options(args: argparse.Namespace, components: tuple[str, ...]) -> StackOptions:
    """The stack's options from the flags; what a command has no flag for keeps StackOptions' default."""
    from stack.runtime import StackOptions, model_defaults, model_processor

    given: dict[str, object] = {}
    if "edge" in components:
        tokenizer, tool_format = model_defaults(args.engine, args.model, args.tokenizer, args.tool_format)
        given.update(
            host=args.host, port=args.port, engine=args.engine, engine_urls=tuple(args.engine_url), model=args.model,
            engine_timeout=args.engine_timeout, engine_deadline=args.engine_deadline,
            health_interval=args.health_interval, tokenizer=tokenizer, tool_format=tool_format,
            reasoning_format=args.reasoning_format, admin_token=args.admin_token or secrets.token_urlsafe(18),
            max_trajectory_length=args.max_trajectory_length, edge_id=args.edge_id, lease_ttl_s=args.lease_ttl,
            idle_timeout_s=args.idle_timeout, body_min_rate=args.body_min_rate, send_timeout=args.send_timeout,
            processor=model_processor(args.engine, args.model, args.processor),
            max_images=args.image_max_count, max_image_bytes=args.image_max_bytes,
            max_image_pixels=args.image_max_pixels, max_image_side=args.image_max_side,
            image_fetch_allow=tuple(args.image_fetch_allow), image_fetch_timeout_s=args.image_fetch_timeout)
    else:  # no edge: no port of its own; /metrics where --metrics-port says (the edge serves its own)
        given.update(port=0, metrics_port=getattr(args, "metrics_port", None))
    if "materializer" in components:
        given["materializer"] = _materializer_options(args)
    for flag, field in (("metrics_host", "metrics_host"), ("fsync", "fsync")):
        if hasattr(args, flag):
            given[field] = getattr(args, flag)
    return StackOptions(data_dir=args.data_dir, nats_url=args.nats, components=components,
                        retention=_retention(args), replicas=args.replicas, **given)  # type: ignore[arg-type]


def _announce(stack: Stack) -> None:
    from stack.provision import Retention
    from stack.runtime import engine_summary

    options = stack.options
    print(f"rollbus {' + '.join(options.components)} running", flush=True)
    nats_kind = "external" if options.nats_url else f"embedded, store {options.data_dir / 'nats'}"
    print(f"  nats:         {stack.nats_url} ({nats_kind})")
    print(f"  log limits:   {(options.retention or Retention()).describe()}{_store_limit(stack)}")
    print(f"  fsync:        {_fsync_summary(stack)}")
    if stack.url:
        print(f"  edge:         {stack.url}")
        print(f"  admin token:  {options.admin_token}")
        print(f"  metrics:      {stack.url}/metrics")
        print(f"  engine:       {engine_summary(options)}")
        reasoning = "" if options.reasoning_format == "think" else f", reasoning format {options.reasoning_format}"
        print(f"  tokenizer:    {options.tokenizer} (tool format {options.tool_format}{reasoning})")
        if stack.template_mode is not None:
            print(f"  template:     {stack.template_mode.describe()}")
        if options.processor:
            print(f"  images:       {image_summary(options)}")
    if "materializer" in options.components:
        print(f"  trajectories: {options.data_dir / 'trajectories'}/")
        mo = options.materializer
        if mo.transfer_queue:
            where = f"joined Ray at {mo.ray_address}" if mo.ray_address else "hosted by this process"
            print(f"  transferqueue: partition {mo.tq_partition} ({where})")
    if stack.metrics_server is not None:
        print(f"  metrics:      {stack.metrics_server.url}")
    print("  Ctrl-C (SIGINT) or SIGTERM stops it", flush=True)


def image_summary(options: StackOptions) -> str:
    """The ``images:`` line of a stack with a processor: the processor, the limits, and where URLs are fetched."""
    fetched = ", ".join(options.image_fetch_allow) or "none (data URLs and base64 only)"
    return (f"{options.processor} (up to {options.max_images} a request, {_size_text(options.max_image_bytes)} and "
            f"{options.max_image_pixels} pixels each; URLs fetched from: {fetched})")


def _store_limit(stack: Stack) -> str:
    from stack.provision import bytes_text

    if stack.nats is None:
        return ""
    try:
        limit = stack.nats.jetstream_config().get("max_storage")
    except RollbusError:
        return ""
    return f"; JetStream store limit {bytes_text(limit)}" if isinstance(limit, int) and limit > 0 else ""


def _fsync_summary(stack: Stack) -> str:
    if stack.nats is None:
        return "as the NATS server at --nats is configured (its jetstream sync_interval)"
    if stack.options.fsync == "always":
        return "always (sync_interval: always: every write is on disk before it is acknowledged)"
    return "default (JetStream syncs to disk every 2 min; --fsync always: before every acknowledgement)"


def _write_state(stack: Stack) -> Path | None:
    if not stack.url:
        return None
    path = stack.options.data_dir / STATE_FILE
    info = EdgeInfo(url=stack.url, admin_token=stack.options.admin_token, nats_url=stack.nats_url, pid=os.getpid())
    path.write_bytes(msgspec.json.encode(info))
    path.chmod(0o600)
    return path


async def _serve(options: StackOptions) -> int:
    from rollbus.progress import Stages
    from stack.heap import settle_heap
    from stack.runtime import Stack

    if options.nats_url:  # refuse at once a --nats nothing listens on (connect() would wait 10 s)
        await check_nats(options.nats_url)
    command = "up" if options.components == COMPONENTS else options.components[0]
    stack = Stack(options, stage=Stages(f"rollbus {command}"))  # what it waits on, on stderr, as it starts
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stack.stop_event.set)
    try:
        await stack.start()
    except BaseException:  # a StartupError or RollbusError is the caller's one line; stop what did start
        await stack.stop()
        raise
    try:
        settle_heap()  # startup is done: its heap is never collected again
        state = _write_state(stack)
        _announce(stack)
        await stack.run_until_stopped()
    finally:
        print("rollbus: stopping", flush=True)
        await stack.stop()
        if stack.url and (state := options.data_dir / STATE_FILE).exists():
            state.unlink()
    return 0


def _log_level(name: str) -> int:
    """The logging level ``--log-level`` names (a name in any case, or a number)."""
    if name.isdigit():
        return int(name)
    level = logging.getLevelNamesMapping().get(name.upper())
    if level is None:
        raise UserError(f"--log-level {name}: not a level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return level


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_of(argv)).parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"rollbus {args.command}: {one_line(str(exc))}", file=sys.stderr)
    except RollbusError as exc:  # e.g. no NATS server answered in time, an embedded nats-server that failed
        print(f"rollbus {args.command}: {one_line(exc.message)}", file=sys.stderr)
    return EXIT_ERROR


def _run(args: argparse.Namespace) -> int:
    from edge.tokens.fidelity import load_codec
    from edge.tokens.parsers import make_reasoning
    from stack.runtime import check_options

    level = _log_level(args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))  # (a line per request, at INFO: noise)
    if args.command not in ("up", *COMPONENTS):
        return int(args.run(args))
    components = COMPONENTS if args.command == "up" else (args.command,)
    options = _options(args, components)
    check_options(options)  # a missing --model, --engine sglang without --engine-url, ...
    if "edge" in components:
        try:  # refuse a bad --tokenizer / --tool-format / --reasoning-format before starting anything
            load_codec(options.tokenizer, options.tool_format)
            make_reasoning(options.reasoning_format)
        except ValueError as exc:
            print(f"rollbus: cannot start the edge: {exc}", file=sys.stderr)
            return 2
    _use_uvloop()
    return asyncio.run(_serve(options))


def _use_uvloop() -> None:
    if sys.platform == "win32":
        return
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


if __name__ == "__main__":
    sys.exit(main())
