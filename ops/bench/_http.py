"""A minimal keep-alive HTTP/1.1 client for load generation.

The load generator must cost far less than the servers it measures: this client writes
pre-encoded requests and parses only the status line and Content-Length.
"""

from __future__ import annotations

import asyncio


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self._reader = reader
        self._writer = writer
        self._host = host

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"POST {path} HTTP/1.1", f"Host: {self._host}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        self._writer.write(raw)
        status_line = await self._reader.readline()
        status = int(status_line.split(b" ", 2)[1])
        length = 0
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await self._reader.readexactly(length)
        return status, body

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
