"""Chaos run: seeded agent sessions through nats-server, ``rollbus edge``, ``rollbus projector`` and
``rollbus materializer`` (each a process) while they are SIGKILLed and SIGSTOPped at seeded moments
(:mod:`rollbus.testing.chaos`); then checks that nothing was lost or duplicated and that every finalized
session's records equal a fault-free run's.

    python ops/chaos/run.py --seed 7 --minutes 10 [--sessions 2000] [--faults 40] [--concurrency 32]

Prints the report (sessions, faults by part and kind, turns acknowledged/lost/duplicated, records,
every non-2xx by status and error type) and exits 1 on any loss, duplicate, difference or 500.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.burst import tool_responder
from rollbus.testing.chaos import run
from rollbus.testing.scripted import ScriptedEngineServer


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
        return value
    return parse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="the faults' and the sessions' seed")
    parser.add_argument("--minutes", type=_positive(float), default=10.0, help="the faulted window [10]")
    parser.add_argument("--sessions", type=_positive(int), default=None,
                        help="sessions per phase, started over the window [200 a minute]")
    parser.add_argument("--faults", type=_positive(int), default=None, help="faults in the window [4 a minute]")
    parser.add_argument("--pause", type=_positive(float), nargs=2, default=(2.0, 6.0), metavar=("MIN", "MAX"),
                        help="seconds a SIGSTOP lasts, drawn between MIN and MAX [2 6]; past 20 on nats-server, "
                             "appends are answered 503 log_unavailable")
    parser.add_argument("--concurrency", type=_positive(int), default=32, help="sessions in flight [32]")
    parser.add_argument("--keep", type=Path, default=None, help="run in this directory and keep it (logs, store)")
    args = parser.parse_args()
    window = args.minutes * 60
    tokenizer = load_tokenizer("builtin:qwen2.5")
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    with ScriptedEngineServer(responder=responder, keep_requests=4) as engine, \
            tempfile.TemporaryDirectory(prefix="rollbus-chaos-") as tmp:
        root = args.keep or Path(tmp)
        report = run(root, engine.url, seed=args.seed, sessions=args.sessions or int(200 * args.minutes),
                     window_s=window, faults=args.faults or max(1, int(4 * args.minutes)),
                     concurrency=args.concurrency, pause_s=tuple(args.pause), log=lambda line: print(line, flush=True))
    print(report.render())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
