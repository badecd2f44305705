"""The edge's own cost per model turn, per wire and mode, through the real ASGI app.

Every turn goes through the whole edge (HTTP decode, chain selection, incremental
encoding, reply parsing, drafting and envelope encoding, the wire's answer) with the
two pieces of I/O replaced by instant in-process stand-ins: an engine that replays
scripted tokens (in chunks of 4 when streaming) and the in-memory log
(:class:`rollbus.testing.memory_log.InMemoryLog`: the real envelope codec and JetStream's
append rules, without NATS). So the numbers are the edge's CPU per turn, not the engine's or
NATS'; they are process CPU time (``time.process_time``), which a machine busy with other
work disturbs far less than the wall clock.

Modes: ``openai`` (plain, the baseline), ``openai-stream``, ``anthropic``,
``anthropic-stream``, ``responses``, ``responses-stream`` (the OpenAI Responses API, its
history sent back item by item, as Codex does); ``sglang`` and ``sglang-stream``: ``openai`` and
``openai-stream`` with SGLang's hermes parser (``--tool-format sglang:hermes``) in place of the
built-in one. Each session is a 3-turn tool conversation.
``image`` and ``image-text`` (issue 29): a GUI agent's 3-turn session (``--processor builtin:qwen2.5-vl``)
whose every user turn carries a screenshot (the same 640x480 PNG each time, as an agent resends an unchanged
screen), against the same session with text of the same token count in place of each image; the ratio
compares an image turn with a text turn of the same tokens, and the log bytes each turn adds (envelopes plus
the object store's pieces) are printed for both: the image's bytes are stored once a session, so a turn
that resends it adds its digest, not its bytes.
Ratios are against ``openai`` measured in the same run (a streamed mode's also against its plain
mode, an ``sglang`` mode's also against the same mode with the built-in parser). The Responses
API's budget: a turn at most 1.2x a chat turn's CPU, a streamed turn at
most 1.5x a plain one.
``--baseline-tree PATH`` also runs ``openai`` with the code at PATH (e.g. main's checkout)
in a subprocess, and prints this tree's ratio to it. The modes (each with an edge of its own)
take turns session by session, so that a round of each ran on the same machine; each prints
its best round, the least disturbed by whatever else the machine is doing.

    python ops/bench/wire_turns.py --sessions 100 --rounds 5 --baseline-tree ../main
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import msgspec
from PIL import Image, ImageDraw

from edge.app import create_app
from edge.engines.base import GenerateChunk, GenerateRequest, GenerateResult
from edge.service import EdgeService, OpenedSession, OpenSession
from edge.settings import EdgeSettings
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers import make_parser
from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.memory_log import InMemoryLog, in_memory_service

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
REPLIES = ['Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
           '<tool_call>\n{"name": "calculator", "arguments": {"expression": "42+0"}}\n</tool_call>',
           "The answer is 42. " * 8]
MODES = ("openai", "openai-stream", "anthropic", "anthropic-stream", "responses", "responses-stream", "sglang",
         "sglang-stream", "image", "image-text")
IMAGE_MODES = ("image", "image-text")
PROCESSOR = "builtin:qwen2.5-vl"
SGLANG = {"sglang": "openai", "sglang-stream": "openai-stream"}  # the mode with the built-in parser


class ReplayEngine:
    """Answers each request with the reply for its turn, at once (results and chunks made up front,
    so that neither mode pays for the stand-in)."""

    name = "replay"

    def __init__(self, replies: list[list[int]]) -> None:
        self._results = [GenerateResult(token_ids=tuple(ids), logprobs=tuple(-0.1 for _ in ids), finish_reason="stop")
                         for ids in replies]
        self._chunks = [[GenerateChunk(token_ids=r.token_ids[i:i + 4], logprobs=r.logprobs[i:i + 4])
                         for i in range(0, len(r.token_ids), 4)] for r in self._results]
        self._turn: dict[str, int] = {}

    def _index(self, request: GenerateRequest) -> int:
        session = request.request_id.rsplit(":", 1)[0]
        turn = self._turn.get(session, 0)
        self._turn[session] = turn + 1
        return turn % len(self._results)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return self._results[self._index(request)]

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        index = self._index(request)
        for chunk in self._chunks[index]:
            yield chunk
        yield self._results[index]

    async def aclose(self) -> None:
        return None


def _build(tool_format: str, processor: str = "", log: InMemoryLog | None = None) -> tuple[EdgeService, Any]:
    tokenizer = load_tokenizer("builtin:qwen2.5")
    replies = [[*tokenizer.encode(text), tokenizer.eos_token_id] for text in REPLIES]
    service = in_memory_service(ReplayEngine(replies), codec=(TemplateCodec(tokenizer), make_parser(tool_format)),
                                settings=EdgeSettings(processor=processor), log=log)
    return service, create_app(service)


def screenshot() -> bytes:
    """A 640x480 PNG that looks like a screen: a title bar, panels, lines of 'text' and a photo (noise, which PNG
    cannot shrink much: a screenshot of about 100 KB, as real ones with pictures are)."""
    image = Image.new("RGB", (640, 480), (246, 247, 249))
    noise = random.Random(29)
    image.paste(Image.frombytes("RGB", (200, 150), bytes(noise.getrandbits(8) for _ in range(200 * 150 * 3))),
                (420, 300))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 640, 28), fill=(32, 36, 48))
    draw.rectangle((0, 28, 150, 480), fill=(228, 231, 236))
    for row in range(40, 470, 14):
        draw.rectangle((170, row, 170 + (row * 37) % 420 + 40, row + 6), fill=(90, 96, 110))
        draw.rectangle((12, row, 12 + (row * 13) % 110 + 16, row + 5), fill=(120, 126, 140))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


SCREEN = screenshot()
SCREEN_URL = "data:image/png;base64," + base64.b64encode(SCREEN).decode()


def _filler() -> str:
    """Text of as many tokens as the screenshot's placeholder (start, pads, end), after ``Screen:``."""
    from vision.images import ImageLimits, inspect
    from vision.processor import load_processor

    tokenizer = load_tokenizer("builtin:qwen2.5")
    count = len(load_processor(PROCESSOR, tokenizer).placeholder_ids(inspect(SCREEN, ImageLimits())))
    text = " x" * count
    assert len(tokenizer.encode("Screen:" + text)) - len(tokenizer.encode("Screen:")) == count
    return text


async def _gui_session(client: httpx.AsyncClient, base: str, key: str, image: bool,
                       after_turn: Any = None) -> None:
    """Each user turn sends the screen (the same screenshot, or text of its token count) with the task or the
    tool's result; ``after_turn``: called after each turn (the log-bytes count)."""
    screen = {"type": "image_url", "image_url": {"url": SCREEN_URL}} if image else {"type": "text", "text": FILLER}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "What is 6*7? Screen:"},
                                                                   screen]}]
    for _ in REPLIES:
        body = msgspec.json.encode({"model": "m", "messages": messages, "tools": TOOLS})  # (stdlib json would
        # spend more on the base64 than the edge does)
        response = await client.post(f"{base}/v1/chat/completions", content=body,
                                     headers={"x-api-key": key, "content-type": "application/json"})
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
        message = _assistant_openai(response.json())
        messages.append(message)
        for call in message.get("tool_calls", ()):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
        messages.append({"role": "user", "content": [{"type": "text", "text": "Screen:"}, screen]})
        if after_turn is not None:
            after_turn()


FILLER = ""  # set by main when an image mode runs (the processor loads then)


def _log_bytes(log: InMemoryLog) -> tuple[int, int]:
    """(envelope payload bytes, object-store bytes) of the log."""
    return sum(len(m.data) for m in log.messages), sum(len(v) for v in log.pieces.values())


async def log_bytes_per_turn(image: bool) -> list[tuple[int, int]]:
    """The log bytes (envelope payloads, object-store pieces) each turn of one session adds."""
    log = InMemoryLog()
    service, app = _build("hermes", PROCESSOR, log)
    added: list[tuple[int, int]] = []
    before = [_log_bytes(log)]

    def count() -> None:
        now = _log_bytes(log)
        added.append((now[0] - before[0][0], now[1] - before[0][1]))
        before[0] = now

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as client:
        session = await service.open_session(OpenSession())
        before[0] = _log_bytes(log)
        await _gui_session(client, f"/sessions/{session.session_id}", session.api_key, image, count)
    return added


def _assistant_openai(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body["choices"][0]["message"].items() if v is not None}


async def _openai_session(client: httpx.AsyncClient, base: str, key: str, stream: bool) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
    for _ in REPLIES:
        body = {"model": "m", "messages": messages, "tools": TOOLS, "stream": stream}
        response = await client.post(f"{base}/v1/chat/completions", json=body, headers={"x-api-key": key})
        message = _accumulate_openai(response.content) if stream else _assistant_openai(response.json())
        messages.append(message)
        for call in message.get("tool_calls", ()):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})


def _accumulate_openai(body: bytes) -> dict[str, Any]:
    """The assistant message of a streamed reply (its bytes parsed as the plain reply's are: no text decoding)."""
    content, calls = [], {}
    for line in body.splitlines():
        if not line.startswith(b"data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls", ()):
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call["function"].get("name") or ""
                entry["function"]["arguments"] += call["function"].get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


async def _anthropic_session(client: httpx.AsyncClient, base: str, key: str, stream: bool) -> None:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
    for _ in REPLIES:
        body = {"model": "m", "max_tokens": 1024, "messages": messages, "tools": tools, "stream": stream}
        response = await client.post(f"{base}/v1/messages", json=body, headers={"x-api-key": key})
        blocks = _accumulate_anthropic(response.content) if stream else response.json()["content"]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in blocks if b["type"] == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u["id"], "content": "42"} for u in uses]})


def _accumulate_anthropic(body: bytes) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for line in body.splitlines():
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
    return blocks


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


async def _responses_session(client: httpx.AsyncClient, base: str, key: str, stream: bool) -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
    for _ in REPLIES:
        body = {"model": "m", "input": items, "tools": RESPONSES_TOOLS, "stream": stream}
        response = await client.post(f"{base}/v1/responses", json=body, headers={"x-api-key": key})
        output = _accumulate_responses(response.content) if stream else response.json()["output"]
        items += output
        items += [{"type": "function_call_output", "call_id": item["call_id"], "output": "42"}
                  for item in output if item["type"] == "function_call"]


def _accumulate_responses(body: bytes) -> list[dict[str, Any]]:
    """A streamed reply's output items, from its ``response.output_item.done`` events (as Codex builds them)."""
    items = []
    for line in body.splitlines():
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if event["type"] == "response.output_item.done":
                items.append(event["item"])
    return items


async def _drive(mode: str, client: httpx.AsyncClient, session: OpenedSession) -> None:
    if mode in IMAGE_MODES:
        await _gui_session(client, f"/sessions/{session.session_id}", session.api_key, mode == "image")
        return
    mode = SGLANG.get(mode, mode)
    drive = {"openai": _openai_session, "anthropic": _anthropic_session,
             "responses": _responses_session}[mode.removesuffix("-stream")]
    await drive(client, f"/sessions/{session.session_id}", session.api_key, mode.endswith("stream"))


async def measure(modes: Sequence[str], sessions: int, rounds: int) -> dict[str, list[float]]:
    """CPU seconds per turn of each mode (each with an edge of its own), per round of ``sessions``
    3-turn sessions. The modes take turns session by session, so that the same round of every mode
    ran on the same machine, whatever else it was doing meanwhile."""
    async with contextlib.AsyncExitStack() as stack:
        edges = []
        for mode in modes:
            service, app = _build("sglang:hermes" if mode in SGLANG else "hermes",
                                  PROCESSOR if mode in IMAGE_MODES else "")
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge")
            edges.append((mode, service, await stack.enter_async_context(client)))
        spent: dict[str, list[float]] = {mode: [] for mode in modes}
        for round_no in range(-1, rounds):  # round -1 warms up
            totals = dict.fromkeys(modes, 0.0)
            for _ in range(sessions if round_no >= 0 else 5):
                for mode, service, client in edges:
                    session = await service.open_session(OpenSession())
                    started = time.process_time()
                    await _drive(mode, client, session)
                    await asyncio.sleep(0)  # what the session's last turn left to the loop counts as its own
                    totals[mode] += time.process_time() - started
            if round_no >= 0:
                for mode in modes:
                    spent[mode].append(totals[mode] / (sessions * len(REPLIES)))
        return spent


def _baseline(tree: str, sessions: int) -> float:
    """``openai``'s CPU a turn with the code at ``tree``, measured by that tree's own copy of this script (its
    modules may have other names than this tree's)."""
    root = os.path.abspath(tree)
    script = os.path.join(root, "ops", "bench", "wire_turns.py")
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, script, "--sessions", str(sessions), "--modes", "openai", "--raw"],
                         env=env, capture_output=True, text=True, check=True, cwd=root)
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--baseline-tree", help="also time 'openai' with the code in this tree")
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        print(asyncio.run(measure(args.modes[:1], args.sessions, 1))[args.modes[0]][0])
        return
    global FILLER
    if any(mode in IMAGE_MODES for mode in args.modes):
        FILLER = _filler()
    rounds = asyncio.run(measure(args.modes, args.sessions, args.rounds))
    baseline = [_baseline(args.baseline_tree, args.sessions) for _ in range(args.rounds if args.baseline_tree else 0)]
    best = {mode: min(times) for mode, times in rounds.items()}
    base = best.get("openai")
    print(f"edge CPU per turn ({args.sessions} sessions x {len(REPLIES)} turns, instant engine and log, "
          f"best of {args.rounds} rounds)")
    for mode, seconds in best.items():
        ratio = f"  x{seconds / base:.2f} vs openai" if base else ""
        plain = mode.removesuffix("-stream")
        if mode != plain and plain != "openai" and plain in best:
            ratio += f"  x{seconds / best[plain]:.2f} vs {plain}"
        if SGLANG.get(mode, "openai") != "openai" and SGLANG[mode] in best:
            ratio += f"  x{seconds / best[SGLANG[mode]]:.2f} vs {SGLANG[mode]} (built-in hermes)"
        if mode == "image" and "image-text" in best:
            ratio += f"  x{seconds / best['image-text']:.2f} vs image-text (the same tokens as text)"
        print(f"  {mode:18s} {seconds * 1e6:8.0f} us{ratio}")
    if any(mode in IMAGE_MODES for mode in best):
        image, text = (asyncio.run(log_bytes_per_turn(kind)) for kind in (True, False))
        print(f"log bytes added per turn (envelopes + object store; a {len(SCREEN)}-byte {640}x{480} PNG screenshot "
              f"sent with every user turn, or text of its {len(FILLER) // 2} tokens)")
        shown = {kind: ", ".join(f"{a + b}" + (f" ({b} in the object store)" if b else "") for a, b in turns)
                 for kind, turns in (("image", image), ("image-text", text))}
        print(f"  image       {shown['image']}  (a turn resending it: {sum(image[-1]) - sum(text[-1]):+d} bytes "
              "against text)")
        print(f"  image-text  {shown['image-text']}")
    if baseline and base:
        other = min(baseline)
        print(f"  openai @ {args.baseline_tree}: {other * 1e6:.0f} us; this tree x{base / other:.2f}")


if __name__ == "__main__":
    main()
