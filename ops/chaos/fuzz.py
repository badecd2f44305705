"""Schemathesis over every route of ``rollbus up``, for as long as you like (:mod:`rollbus.testing.api_fuzz`).

``rollbus up`` runs as its own process in front of a scripted SGLang engine in this process (as
``ops/bench/edge_memory.py --big-requests`` runs it). After a warm-up its RSS is the baseline; then
``--cases`` cases go through, every session they touched is finalized, and after ``--settle`` seconds
the RSS is read again and ``rollbus replay --verify --all`` runs over the log. Prints the cases, the
status codes, the 5xx and check failures (the first few in full, with their curl commands), the replay's
result and the RSS before and after; exits 1 on a 5xx, a check failure, a failed verify, or an RSS
after more than 1.25x the baseline.

    python ops/chaos/fuzz.py [--cases 10000] [--seed N] [--settle 10]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import httpx
from _big_requests import ADMIN, MIB, TARGET, Up, rss

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.api_fuzz import ApiFuzz
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs

WARM_UP = 100
REPLIES = ["Hi.", "<think>a moment</think>Done.",
           '<tool_call>\n{"name": "f", "arguments": {"path": "a.txt"}}\n</tool_call>']


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10000, help="cases after the warm-up (default 10000)")
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis' seed (default: a new one)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before the RSS is read again")
    args = parser.parse_args()
    if args.cases < 1:
        parser.error("--cases must be at least 1")
    tokenizer = load_tokenizer("builtin:qwen2.5")
    replies = [[*tokenizer.encode(text), tokenizer.eos_token_id] for text in REPLIES]

    def reply(input_ids: list[int], body: dict[str, object]) -> ScriptedReply:
        ids = replies[sum(input_ids[-16:]) % len(replies)]
        return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))

    with ScriptedEngineServer(responder=reply, keep_requests=0) as engine, \
            tempfile.TemporaryDirectory(prefix="rb-fuzz-") as data:
        up = Up(Path(data), engine.url, {})
        try:
            return drive(up, args)
        finally:
            up.stop()


def drive(up: Up, args: argparse.Namespace) -> int:
    print(f"api fuzz: {args.cases} schemathesis cases over {up.url}/openapi.json (rollbus up, scripted engine)",
          flush=True)
    fuzz = ApiFuzz(up.url, ADMIN, seed_value=args.seed)
    fuzz.examples()
    fuzz.run(WARM_UP, seed_value=1)
    time.sleep(1)
    before = rss(up.proc.pid)
    report = fuzz.run(args.cases, seed_value=args.seed)
    for session_id in sorted(report.sessions):
        httpx.post(f"{up.url}/sessions/{session_id}/finalize", headers={"Authorization": f"Bearer {ADMIN}"},
                   timeout=30)
    time.sleep(args.settle)
    after = rss(up.proc.pid)
    verify = subprocess.run([sys.executable, "-m", "rollbus.cli", "replay", "--verify", "--all", "--nats",
                             up.nats_url, "--log-level", "WARNING"], capture_output=True, text=True, timeout=1800)
    for line in report.lines():
        print(line)
    for failure in report.failures[:5]:
        print("\n" + failure)
    tail = (verify.stdout.strip().splitlines() or [verify.stderr.strip()[-300:]])[-1]
    print(f"replay --verify --all: {'ok' if verify.returncode == 0 else f'FAILED (exit {verify.returncode})'}: "
          f"{tail}")
    ratio = after / before
    print(f"edge RSS: before {before / MIB:.0f} MiB  after {after / MIB:.0f} MiB  after/before {ratio:.2f}x "
          f"(target {TARGET}x)")
    ok = report.server_errors == 0 and not report.failures and verify.returncode == 0 and ratio <= TARGET
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
