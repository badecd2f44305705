"""Flooding clients for test_unauthenticated_flood, run in a process of their own (spawned: this module
imports nothing heavy), so that the attacker's CPU is not the edge's."""

from __future__ import annotations

import asyncio
import time
from multiprocessing.connection import Connection


async def one(port: int, head: bytes, until: float) -> tuple[bytes, float]:
    """One client: ``head``, then a body byte every 0.5 s until the server closes or ``until``. What it got
    back (then ``<reset>`` if the server reset the connection: it closed it with body bytes unread; or
    ``<no answer>`` if it was still open 10 s after the trickle ended) and the seconds from its head to
    the first byte of the answer."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    sent = loop.time()
    got: list[bytes] = []
    first = [0.0]

    async def read_all() -> None:
        while chunk := await reader.read(65536):
            if not got:
                first[0] = loop.time() - sent
            got.append(chunk)

    answer = asyncio.ensure_future(read_all())
    try:
        while not answer.done() and loop.time() < until:
            try:
                writer.write(b" ")
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait([answer], timeout=0.5)
        await asyncio.wait_for(answer, 10)
    except ConnectionError:
        got.append(b"<reset>")
    except TimeoutError:
        answer.cancel()
        got.append(b"<no answer>")
    finally:
        writer.close()
    return b"".join(got), first[0]


def run(port: int, heads: list[bytes], hold_s: float, report: Connection) -> None:
    """All the clients at once; sends ``"connecting"``, then (answers, seconds to each answer, seconds
    until the last connection ended)."""

    async def flood() -> tuple[list[bytes], list[float], float]:
        started = time.perf_counter()
        until = asyncio.get_running_loop().time() + hold_s
        report.send("connecting")
        done = await asyncio.gather(*(one(port, head, until) for head in heads))
        return [answer for answer, _ in done], [seconds for _, seconds in done], time.perf_counter() - started

    report.send(asyncio.run(flood()))
