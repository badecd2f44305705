"""A minimal keep-alive HTTP/1.1 client for load generation.

The load generator must cost far less than the servers it measures: this client writes
pre-encoded requests and parses only the status line and Content-Length (or, for a streamed reply,
the chunks of ``Transfer-Encoding: chunked``).
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
        chunked = False
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if not chunked:
            return status, await self._reader.readexactly(length)
        parts = []  # a streamed reply: chunks (each a hexadecimal size line, the data, CRLF) up to one of size 0
        while size := int((await self._reader.readline()).split(b";", 1)[0], 16):
            parts.append((await self._reader.readexactly(size + 2))[:-2])
        await self._reader.readline()  # the CRLF after the last chunk (no trailers are sent)
        return status, b"".join(parts)

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
