"""Replay speed, against a bare nats-py read of the same stream in the same run.

Writes a log of agent sessions into a private nats-server (file storage), the way the
edge appends them (one envelope per turn: the request with its whole message history,
the context tokens, ~120 sampled tokens with log probs, the reply), then measures:

* whole-log replay (``session_projector.replay.replay_all``: read, decode, fold every
  session) in events/s, and the same stream read by a bare nats-py ordered consumer that
  only counts messages; the ratio is replay events/s over bare-read events/s (target >= 0.5);
* one 100-turn session rebuilt from the log (``eventlog.reader.load_state``, what
  the edge does on takeover and ``rollbus replay`` on one session), in ms (target <= 50).

Each figure is the best of ``--repeat`` runs.

    python ops/bench/replay_speed.py [--sessions 300] [--turns 10] [--long-turns 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nats.aio.client import Client
from nats.js.api import DeliverPolicy
from nats.js.client import JetStreamContext

from eventlog.publisher import JetStreamLog
from eventlog.reader import load_state, read_session
from schemas import tokens
from schemas.bodies import literal
from schemas.events import (
    ChainStarted,
    ContextAppended,
    Event,
    RequestReceived,
    RewardReported,
    SessionFinalized,
    SessionOpened,
    TokensGenerated,
    ToolCall,
    TurnCompleted,
    body_digest,
)
from schemas.log import LogConfig
from session_projector.replay import ReplayStats, replay_all
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision

PROMPT, CONTEXT, SAMPLED, MESSAGE_CHARS = 600, 60, 120, 400


class SessionWriter:
    """One agent session's events, as the edge would append them."""

    def __init__(self, index: int, rng: random.Random) -> None:
        self.session_id = f"{index:032x}"
        self.rng = rng
        self.seq = 0
        self.messages: list[dict[str, str]] = [{"role": "system", "content": "x" * MESSAGE_CHARS}]

    def _event(self, cls: type[Event], **fields: object) -> Event:
        self.seq += 1
        return cls(session_id=self.session_id, seq=self.seq, time=time.time(), **fields)

    def _ids(self, n: int) -> bytes:
        return tokens.pack_ids([self.rng.randrange(151643) for _ in range(n)])

    def opened(self) -> list[Event]:
        return [self._event(SessionOpened, uid="u" + self.session_id[-8:], session_index=0, api_key_digest="0" * 64,
                            max_trajectory_length=1 << 20, tokenizer="builtin:qwen2.5", tool_format="hermes")]

    def turn(self, n: int) -> list[Event]:
        self.messages.append({"role": "user" if n == 1 else "tool", "content": "y" * MESSAGE_CHARS})
        body = json.dumps({"model": "m", "messages": self.messages}).encode()
        common = {"request_no": n, "chain": 0}
        received = self._event(RequestReceived, request_no=n, wire="openai", parts=literal(body), body_size=len(body),
                               body_digest=body_digest(body))
        context = (self._event(ChainStarted, prompt_ids=self._ids(PROMPT), prefix_digest="d" * 32, n_messages=n * 2,
                               chat_turns=1, **common) if n == 1 else
                   self._event(ContextAppended, token_ids=self._ids(CONTEXT), prefix_digest="d" * 32,
                               n_messages=n * 2, chat_turns=0, **common))
        events = [received, context,
                  self._event(TokensGenerated, token_ids=self._ids(SAMPLED),
                              logprobs=tokens.pack_logprobs([-0.5] * SAMPLED), **common),
                  self._event(TurnCompleted, finish_reason="stop", text="z" * 3 * SAMPLED, tip_digest="t" * 32,
                              n_messages=n * 2 + 1,
                              tool_calls=(ToolCall(id=f"call_{n}_0", name="run", arguments='{"cmd": "ls"}'),),
                              **common)]
        self.messages.append({"role": "assistant", "content": "z" * 3 * SAMPLED})
        return events

    def close(self) -> list[Event]:
        return [self._event(RewardReported, reward=1.0), self._event(SessionFinalized)]


async def write_session(log: JetStreamLog, index: int, turns: int) -> tuple[str, int]:
    writer = SessionWriter(index, random.Random(index))
    after = 0
    for batch in [writer.opened(), *(writer.turn(n) for n in range(1, turns + 1)), writer.close()]:
        after = (await log.append(writer.session_id, batch, after)).stream_seq
    return writer.session_id, writer.seq


async def write_log(nc: Client, cfg: LogConfig, sessions: int, turns: int, long_turns: int) -> tuple[str, int]:
    log = JetStreamLog(nc, cfg, timeout=30)
    rng = random.Random(0)
    jobs = [write_session(log, i, rng.randint(max(1, turns // 2), turns * 3 // 2)) for i in range(1, sessions + 1)]
    for start in range(0, len(jobs), 32):
        await asyncio.gather(*jobs[start:start + 32])
    return await write_session(log, 0, long_turns)


async def bare_read(js: JetStreamContext, cfg: LogConfig, total: int) -> int:
    """A bare nats-py ordered consumer over the whole stream: count the messages, look at nothing."""
    sub = await js.subscribe(cfg.subjects, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, stream=cfg.stream)
    count = 0
    while count < total:
        await sub.next_msg(timeout=5)
        count += 1
    await sub.unsubscribe()
    return count


async def bare_read_callback(js: JetStreamContext, cfg: LogConfig, total: int) -> int:
    """The same, delivering through a subscription callback (nats-py's cheaper path)."""
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    count = 0

    async def on_msg(msg) -> None:
        nonlocal count
        count += 1
        if count == total and not done.done():
            done.set_result(count)

    sub = await js.subscribe(cfg.subjects, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
                             stream=cfg.stream, cb=on_msg)
    result = await asyncio.wait_for(done, 60)
    await sub.unsubscribe()
    return result


async def replay(js: JetStreamContext, cfg: LogConfig) -> ReplayStats:
    stats = ReplayStats()
    sessions = 0
    async for replayed in replay_all(js, cfg, stats):
        assert replayed.state is not None, replayed.error
        sessions += 1
    return stats


async def whole_log(js: JetStreamContext, cfg: LogConfig, total: int, repeat: int) -> None:
    """The three reads alternate, round after round (fair under a changing load); best of each."""
    best = {"next_msg": float("inf"), "callback": float("inf"), "replay": float("inf")}
    stats = ReplayStats()
    for _ in range(repeat):
        for name in best:
            started = time.perf_counter()
            if name == "replay":
                stats = await replay(js, cfg)
            else:
                count = await (bare_read if name == "next_msg" else bare_read_callback)(js, cfg, total)
                assert count == total
            best[name] = min(best[name], time.perf_counter() - started)
    assert stats.envelopes == total
    rate = {name: stats.events / seconds for name, seconds in best.items()}
    for name, label in (("next_msg", "bare nats-py ordered-consumer read, next_msg:"),
                        ("callback", "bare nats-py ordered-consumer read, callback:"),
                        ("replay", "replay (read + decode + fold):               ")):
        print(f"{label} {stats.events} events ({total} envelopes) in {best[name] * 1000:.0f} ms "
              f"= {rate[name]:,.0f} events/s")
    print(f"ratio replay / bare read: {rate['replay'] / rate['next_msg']:.2f} against next_msg, "
          f"{rate['replay'] / rate['callback']:.2f} against callback (target >= 0.5)")


async def one_session(js: JetStreamContext, cfg: LogConfig, session_id: str, events: int, turns: int,
                      repeat: int) -> None:
    replays, reads = [], []
    for _ in range(max(repeat, 5)):
        started = time.perf_counter()
        state, _ = await load_state(js, cfg, session_id)
        replays.append(time.perf_counter() - started)
        started = time.perf_counter()
        await read_session(js, cfg, session_id)
        reads.append(time.perf_counter() - started)
    assert state.turns == turns and state.seq == events
    print(f"one {turns}-turn session ({events} events): replay {min(replays) * 1000:.1f} ms best, "
          f"{statistics.median(replays) * 1000:.1f} ms median (target <= 50); "
          f"of which read + decode {min(reads) * 1000:.1f} ms best")


async def measure(args: argparse.Namespace, url: str) -> None:
    nc = await connect(url, name="bench")
    js = nc.jetstream()
    cfg = LogConfig()
    await provision(js, cfg)
    started = time.perf_counter()
    long_id, long_events = await write_log(nc, cfg, args.sessions, args.turns, args.long_turns)
    info = await js.stream_info(cfg.stream)
    print(f"log: {args.sessions + 1} sessions, {info.state.messages} envelopes, {info.state.bytes / 2**20:.1f} MiB "
          f"(written in {time.perf_counter() - started:.1f}s)")
    await whole_log(js, cfg, info.state.messages, args.repeat)
    await one_session(js, cfg, long_id, long_events, args.long_turns, args.repeat)
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--turns", type=int, default=10, help="mean turns per session")
    parser.add_argument("--long-turns", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench") as server:
        asyncio.run(measure(args, server.url))


if __name__ == "__main__":
    main()
