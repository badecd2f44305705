"""``python -m rollbus.testing --protocol sglang --port 30000 --replies replies.json``: a scripted
engine server on a port (a JSON list of replies, e.g. ``[{"token_ids": [1, 2, 3]}]``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import uvicorn

from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, ScriptedServer
from rollbus.testing.scripted_vllm import ScriptedVLLMServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollbus.testing",
                                     description="a scripted SGLang or vLLM engine server, for trying rollbus by hand")
    parser.add_argument("--protocol", choices=["sglang", "vllm"], default="sglang", help="the API it speaks [sglang]")
    parser.add_argument("--host", default="127.0.0.1", help="address it listens on [127.0.0.1]")
    parser.add_argument("--port", type=int, default=30000, help="port it listens on [30000]")
    parser.add_argument("--replies", type=Path, required=True, help="JSON list of ScriptedReply objects")
    parser.add_argument("--chunk-size", type=int, default=4, help="tokens per streamed event [4]")
    args = parser.parse_args(argv)
    replies = msgspec.json.decode(args.replies.read_bytes(), type=list[ScriptedReply])
    server: ScriptedServer = (ScriptedVLLMServer if args.protocol == "vllm" else ScriptedEngineServer)(
        replies, chunk_size=args.chunk_size)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
