"""The load half of ``gpu_smoke.sh``: one multi-turn agent workload, sent to SGLang directly and
through the rollbus edge in front of it, in the same run.

Each of ``--sessions`` concurrent agents holds a ``--turns``-turn conversation (greedy, at
most ``--max-tokens`` per reply). *Direct*: the agent renders its conversation with the
edge's own chat template and tokenizer and posts ``input_ids`` to SGLang's ``/generate``.
*Edge*: the agent speaks OpenAI chat completions to a rollbus session. SGLang's prefix
cache is flushed before each phase (``POST /flush_cache``, when the server has it).

Prints, per phase, turns, completion tokens, wall time, tokens/s and turn latency p50/p99,
then the edge's added latency per turn (edge p50 minus direct p50, and the same at p99)
and the throughput ratio edge/direct (tokens/s).

    python ops/bench/gpu_smoke.py --edge URL --admin-token T --sglang URL [--tokenizer SPEC]
        [--sessions 16] [--turns 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from edge.chat.conversation import Message
from edge.tokens.incremental import TemplateCodec
from edge.tokens.tokenizer import load_tokenizer

SYSTEM = "You are a concise assistant. Answer in two or three sentences."
TOPICS = ["the Moon", "honeybees", "volcanoes", "the Roman Empire", "prime numbers", "glaciers", "octopuses",
          "the printing press", "black holes", "coral reefs", "the Silk Road", "photosynthesis"]
FOLLOW_UPS = ["Tell me one more fact about it.", "Why does that matter?", "Summarize it in one sentence.",
              "What is a common misconception about it?", "Give an example."]


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0

    def ms(self, q: float) -> float:
        """The ``q`` quantile of the turn latencies, in milliseconds."""
        ordered = sorted(self.latencies)
        return 1000 * ordered[round(q * (len(ordered) - 1))] if ordered else 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    def row(self) -> str:
        return (f"{self.name:<22}{len(self.latencies):>6}{self.tokens:>8}{self.wall:>8.1f}{self.rate:>10.1f}"
                f"{self.ms(0.5):>9.1f}{self.ms(0.99):>9.1f}")


def script(agent: int, turns: int) -> list[str]:
    first = f"Tell me something interesting about {TOPICS[agent % len(TOPICS)]}."
    return [first, *(FOLLOW_UPS[(agent + t) % len(FOLLOW_UPS)] for t in range(turns - 1))]


async def direct_agent(client: httpx.AsyncClient, sglang: str, codec: TemplateCodec, agent: int,
                       args: argparse.Namespace, phase: Phase) -> None:
    messages = [Message(role="system", content=SYSTEM)]
    stops = list(codec.tokenizer.stop_token_ids)
    for text in script(agent, args.turns):
        messages.append(Message(role="user", content=text))
        body = {"input_ids": codec.encode_prompt(messages, ()), "rid": f"direct-{agent}-{len(messages)}",
                "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0.0, "stop_token_ids": stops,
                                    "skip_special_tokens": False, "no_stop_trim": True},
                "return_logprob": True}
        started = time.perf_counter()
        response = await client.post(f"{sglang}/generate", json=body)
        phase.latencies.append(time.perf_counter() - started)
        response.raise_for_status()
        ids = response.json()["output_ids"]
        phase.tokens += len(ids)
        messages.append(Message(role="assistant", content=codec.reply_text(ids)))


async def edge_agent(client: httpx.AsyncClient, edge: str, token: str, agent: int, args: argparse.Namespace,
                     phase: Phase) -> None:
    admin = {"Authorization": f"Bearer {token}"}
    created = (await client.post(f"{edge}/sessions", json={"uid": f"smoke{agent}"}, headers=admin)).json()
    auth = {"Authorization": f"Bearer {created['api_key']}"}
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for text in script(agent, args.turns):
        messages.append({"role": "user", "content": text})
        body = {"model": "smoke", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0}
        started = time.perf_counter()
        response = await client.post(f"{created['base_url']}/chat/completions", json=body, headers=auth)
        phase.latencies.append(time.perf_counter() - started)
        response.raise_for_status()
        answer = response.json()
        phase.tokens += answer["usage"]["completion_tokens"]
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
    await client.post(f"{edge}/sessions/{created['session_id']}/finalize", headers=admin)


async def run_phase(name: str, agents: list[Callable[[Phase], Awaitable[None]]]) -> Phase:
    phase = Phase(name)
    started = time.perf_counter()
    await asyncio.gather(*(agent(phase) for agent in agents))
    phase.wall = time.perf_counter() - started
    return phase


async def flush(client: httpx.AsyncClient, sglang: str) -> None:
    response = await client.post(f"{sglang}/flush_cache")
    if response.status_code not in (200, 404):
        print(f"note: /flush_cache answered {response.status_code}", file=sys.stderr)


async def main(args: argparse.Namespace) -> int:
    codec = TemplateCodec(load_tokenizer(args.tokenizer))
    limits = httpx.Limits(max_connections=4 * args.sessions + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        def direct(i: int) -> Callable[[Phase], Awaitable[None]]:
            return lambda phase: direct_agent(client, args.sglang, codec, i, args, phase)

        def through_edge(i: int) -> Callable[[Phase], Awaitable[None]]:
            return lambda phase: edge_agent(client, args.edge, args.admin_token, i, args, phase)

        warm = await run_phase("warm-up", [direct(i) for i in range(min(2, args.sessions))])
        print(f"warm-up: {len(warm.latencies)} turns in {warm.wall:.1f}s", flush=True)
        await flush(client, args.sglang)
        bare = await run_phase("direct SGLang", [direct(i) for i in range(args.sessions)])
        await flush(client, args.sglang)
        edge = await run_phase("through rollbus edge", [through_edge(i) for i in range(args.sessions)])
    print(f"{'':<22}{'turns':>6}{'tokens':>8}{'wall_s':>8}{'tokens/s':>10}{'p50_ms':>9}{'p99_ms':>9}")
    print(bare.row())
    print(edge.row())
    ratio = edge.rate / bare.rate if bare.rate else 0.0
    print(f"edge added latency per turn: p50 {edge.ms(0.5) - bare.ms(0.5):+.1f} ms, "
          f"p99 {edge.ms(0.99) - bare.ms(0.99):+.1f} ms; throughput ratio edge/direct {ratio:.3f}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge", required=True, help="the rollbus edge's base URL")
    parser.add_argument("--admin-token", required=True)
    parser.add_argument("--sglang", required=True, help="the SGLang server's base URL")
    parser.add_argument("--tokenizer", default="builtin:qwen2.5", help="the edge's --tokenizer (must match the model)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
