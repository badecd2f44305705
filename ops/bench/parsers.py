"""The cost of reading one reply: each built-in tool parser against SGLang's parser of the same format.

For hermes, qwen3_coder and llama3, a reply of some text and two tool calls is read whole
(``ReplyParser.parse``) and streamed a token a piece (``ReplyParser.stream``), by the built-in
parser and by ``sglang:NAME``, taking turns in the same run; each prints its best round in
microseconds a reply, and SGLang's ratio to the built-in's.

    python ops/bench/parsers.py --replies 300 --rounds 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from edge.chat.conversation import ToolSpec
from edge.tokens.parsers import make_parser
from edge.tokens.reply import ReplyParser, call_ids
from edge.tokens.tokenizer import load_tokenizer

TOOLS = (ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}),)
TEXT = "Let me look that up for both cities."
REPLIES = {
    "hermes": TEXT + "\n" + "\n".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}", "days": 3}}}}\n</tool_call>'
        for c in ("Oslo", "Zürich")),
    "qwen3_coder": TEXT + "\n\n" + "\n".join(
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{c}\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>" for c in ("Oslo", "Zürich")),
    "llama3": TEXT + "<|python_tag|>" + "; ".join(
        f'{{"name": "get_weather", "parameters": {{"city": "{c}", "days": 3}}}}' for c in ("Oslo", "Zürich")),
}


def _pieces(text: str) -> list[str]:
    """The reply as a stream brings it: a token a piece (Qwen's vocabulary)."""
    tokenizer = load_tokenizer("builtin:qwen2.5")
    return [tokenizer.decode([t]) for t in tokenizer.encode(text)]


def _whole(replies: ReplyParser, text: str) -> Callable[[], object]:
    return lambda: replies.parse(text, call_ids(1), tools=TOOLS)


def _streamed(replies: ReplyParser, pieces: list[str]) -> Callable[[], object]:
    def run() -> object:
        stream = replies.stream(call_ids(1), tools=TOOLS)
        for piece in pieces:
            stream.feed(piece)
        return stream.finish()
    return run


def measure(replies: int, rounds: int) -> dict[tuple[str, str, str], float]:
    """Best seconds a reply of each (format, way, parser), the candidates taking turns within each round."""
    jobs: dict[tuple[str, str, str], Callable[[], object]] = {}
    for name, text in REPLIES.items():
        pieces = _pieces(text)
        for parser in (name, f"sglang:{name}"):
            reply_parser = ReplyParser(make_parser(parser))
            jobs[name, "whole", parser] = _whole(reply_parser, text)
            jobs[name, "streamed", parser] = _streamed(reply_parser, pieces)
    best = dict.fromkeys(jobs, float("inf"))
    for _ in range(rounds + 1):  # the first round warms up, and counts only if it is the best
        for key, job in jobs.items():
            started = time.process_time()
            for _ in range(replies):
                job()
            best[key] = min(best[key], (time.process_time() - started) / replies)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    best = measure(args.replies, args.rounds)
    print(f"CPU per reply, built-in parser vs SGLang's ({args.replies} replies, best of {args.rounds} rounds)")
    for (name, way, parser), seconds in best.items():
        ratio = f"  x{seconds / best[name, way, name]:.1f} vs built-in" if parser != name else ""
        print(f"  {parser:20s} {way:8s} {seconds * 1e6:8.1f} us{ratio}")


if __name__ == "__main__":
    main()
