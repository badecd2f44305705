"""Cost of the edge's encoding hot path, against the tokenizer alone (the baseline).

    python ops/bench/codec_encode.py [--tokenizer builtin:qwen2.5] [--repeat 500]

Prints, per operation, microseconds per call and the ratio to encoding the same text
with the bare tokenizer (so the ratio is the chat-template rendering overhead):

- ``encode_prompt``: a chain's first request, ~560 tokens with three tools (the edge's cache of
  first prompts is off here: each call renders and encodes);
- ``encode_increment``: the typical continuation, one tool result after a tool call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from edge.chat.conversation import Message, ToolSpec
from edge.tokens.incremental import TemplateCodec
from edge.tokens.tokenizer import load_tokenizer

_TOOLS = tuple(
    ToolSpec(name=name, description=f"{what} Returns JSON; use it before answering questions about {what.lower()}",
             parameters={"type": "object", "required": ["query"],
                         "properties": {"query": {"type": "string", "description": "what to look up"},
                                        "limit": {"type": "integer", "description": "at most this many results"}}})
    for name, what in [("search_web", "Searches the web for pages."), ("read_page", "Reads a page by URL."),
                       ("python", "Runs Python code in a sandbox.")]
)
_PROMPT = (
    Message(role="system", content="You are a careful research agent. Cite every source you use. " * 6),
    Message(role="user", content="Find the population of Zürich in 2020 and compare it with Geneva and Basel. " * 4),
)
_RESULT = (Message(role="tool", tool_call_id="call_0",
                   content='{"population": 421878, "year": 2020, "source": "https://www.stadt-zuerich.ch"}'),)


def per_call_us(call: Callable[[], object], repeat: int) -> float:
    call()  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="builtin:qwen2.5")
    parser.add_argument("--repeat", type=int, default=500)
    args = parser.parse_args()
    codec = TemplateCodec(load_tokenizer(args.tokenizer), prompt_cache=0)  # every prompt rendered and encoded
    encode = codec.tokenizer.encode
    eos = codec.tokenizer.eos_token_id
    prompt_text = codec.prompt_text(_PROMPT, _TOOLS)
    increment_text = codec.increment_text(_RESULT, ended_with_eos=True)
    rows = [
        ("encode_prompt", len(encode(prompt_text)),
         per_call_us(lambda: codec.encode_prompt(_PROMPT, _TOOLS), args.repeat),
         per_call_us(lambda: encode(prompt_text), args.repeat)),
        ("encode_increment", len(encode(increment_text)),
         per_call_us(lambda: codec.encode_increment(_RESULT, last_token=eos), args.repeat),
         per_call_us(lambda: encode(increment_text), args.repeat)),
    ]
    print(f"{'operation':<18}{'tokens':>7}{'us/call':>10}{'tokenizer us':>14}{'ratio':>8}")
    for name, tokens, us, baseline in rows:
        print(f"{name:<18}{tokens:>7}{us:>10.0f}{baseline:>14.0f}{us / baseline:>8.2f}")


if __name__ == "__main__":
    main()
