"""Memory the edge holds: per stored token (the default), or after big requests (``--big-requests``).

Per stored token, against the raw token arrays, in the same run:

Builds N live sessions of ~T tokens each exactly as the edge holds them (the fold state a
``LiveSession`` keeps: a 560-token prompt, then turns of a ~50-token tool result and ~120
sampled tokens with log probs and reply text), and measures the Python heap they hold
with ``tracemalloc``. The baseline is the same tokens as bare ``uint32`` ids plus
``float32`` log probs for the sampled ones (8 bytes per sampled token, 4 otherwise).

    python ops/bench/edge_memory.py [--sessions 1000] [--tokens 4000]

After big requests (:mod:`_big_requests`: ``rollbus up`` as its own process, its RSS before, at the
peak and after N requests of M MB each and the finalize of their sessions; the target is after/before
<= 1.25x):

    python ops/bench/edge_memory.py --big-requests [--requests 4] [--mb 16] [--text latin|ascii]
                                    [--settle 30] [--compare]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edge.live import LiveSession
from schemas import tokens
from schemas.events import (
    ChainStarted,
    ContextAppended,
    RequestReceived,
    SessionOpened,
    TokensGenerated,
    ToolCall,
    TurnCompleted,
)
from session.fold import SessionState, apply

PROMPT, CONTEXT, SAMPLED = 560, 50, 120


class Builder:
    def __init__(self, session_id: str, rng: random.Random) -> None:
        self.session_id = session_id
        self.rng = rng
        self.state: SessionState = apply(None, SessionOpened(
            session_id=session_id, seq=1, time=0.0, uid="u", session_index=0, api_key_digest="0" * 64,
            max_trajectory_length=1 << 20, tokenizer="builtin:qwen2.5", tool_format="hermes"))
        self.stored = PROMPT

    def _apply(self, event_type: type, **fields: object) -> None:
        self.state = apply(self.state, event_type(session_id=self.session_id, seq=self.state.seq + 1, time=0.0,
                                                  **fields))

    def _ids(self, n: int) -> bytes:
        return tokens.pack_ids([self.rng.randrange(151643) for _ in range(n)])

    def turn(self, request_no: int) -> None:
        self._apply(RequestReceived, request_no=request_no, wire="openai", parts=(), body_size=0, body_digest="")
        if request_no == 1:
            self._apply(ChainStarted, chain=0, request_no=1, prompt_ids=self._ids(PROMPT), prefix_digest="d" * 32,
                        n_messages=2, chat_turns=1)
        else:
            self._apply(ContextAppended, chain=0, request_no=request_no, token_ids=self._ids(CONTEXT),
                        prefix_digest="d" * 32, n_messages=2 * request_no, chat_turns=0)
            self.stored += CONTEXT
        self._apply(TokensGenerated, chain=0, request_no=request_no, token_ids=self._ids(SAMPLED),
                    logprobs=tokens.pack_logprobs([-0.5] * SAMPLED))
        call = ToolCall(id=f"call_{request_no}_0", name="read_file", arguments='{"path": "src/app/main.py"}')
        self._apply(TurnCompleted, chain=0, request_no=request_no, finish_reason="stop",
                    text="x" * (SAMPLED * 3), tool_calls=(call,), tip_digest="t" * 32, n_messages=2 * request_no + 1)
        self.stored += SAMPLED


def build(sessions: int, target: int) -> tuple[list[LiveSession], int, int]:
    rng = random.Random(0)
    live, stored, sampled = [], 0, 0
    for index in range(sessions):
        builder = Builder(f"{index:032x}", rng)
        request = 0
        while builder.stored < target:
            request += 1
            builder.turn(request)
        live.append(LiveSession(builder.state, stream_seq=builder.state.seq))
        stored += builder.stored
        sampled += request * SAMPLED
    return live, stored, sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--big-requests", action="store_true", help="RSS of rollbus up around big requests")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--mb", type=float, default=16.0, help="MB of text in each request's tool result")
    parser.add_argument("--text", choices=["latin", "ascii"], default="latin")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds after the finalizes")
    parser.add_argument("--compare", action="store_true", help="also run with malloc as glibc leaves it")
    args = parser.parse_args()
    if args.big_requests:
        import _big_requests

        sys.exit(_big_requests.main(args.requests, args.mb, args.text, args.settle, args.compare))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    live, stored, sampled = build(args.sessions, args.tokens)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    raw = 4 * stored + 4 * sampled
    print(f"{args.sessions} sessions, {stored} stored tokens ({sampled} sampled with log probs)")
    print(f"edge holds {held / 2**20:.1f} MiB = {held / stored:.2f} bytes/token "
          f"(target <= 16; the reference holds ~60)")
    print(f"raw arrays {raw / 2**20:.1f} MiB = {raw / stored:.2f} bytes/token; "
          f"overhead {held / raw:.2f}x the raw arrays")
    assert live  # keep the sessions alive until measured


if __name__ == "__main__":
    main()
