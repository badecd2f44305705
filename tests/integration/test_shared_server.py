"""The shared test server stays clean and says why it fails (``tests/conftest.py``; issue 26).

The full suite once failed at setup, under load, with ``ProvisionError: cannot create stream
...: error creating store for stream`` (nats 500, err_code 10049). nats-server answers that
one sentence whenever it cannot make a new stream's files, and logs the cause only to its own
log: a full disk (``no space left on device``) or no free file descriptor (``too many open
files``; a stream holds one while it exists). So: a test's streams are dropped even when the
server stalls (they were left for the rest of the session when it stalled for 6 s), a create
the server refuses is a ProvisionError whatever the stream (a KV bucket's was a raw
``ServerError``), and the embedded server's own cause is at hand (``store_failure``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from tests.conftest import drop, stream_names

STALL_S = 6.0  # longer than the drop's old 2 s bounds, far under its new ones


async def _streams(url: str) -> list[str]:
    client = await connect(url, name="count")
    try:
        return [info.config.name for info in await client.jetstream().streams_info()]
    finally:
        await client.close()


async def test_a_drop_that_meets_a_stalled_server_still_removes_every_stream(tmp_path: Path, log_config: LogConfig):
    with EmbeddedNats(tmp_path / "store", name="stalled") as server:
        client = await connect(server.url, name="provision")
        await provision(client.jetstream(), log_config)
        await client.close()
        assert sorted(await _streams(server.url)) == sorted(stream_names(log_config))
        os.kill(server.pid, signal.SIGSTOP)  # a loaded machine: the server does not run for a while
        asyncio.get_running_loop().call_later(STALL_S, os.kill, server.pid, signal.SIGCONT)
        left = await drop(server.url, log_config)
        assert left == []
        assert await _streams(server.url) == []


# Runs in a process of its own whose file descriptor limit the embedded server inherits (so the test's own
# process keeps its limit): sets are provisioned until the server cannot create a store.
EXHAUST = textwrap.dedent("""
    import asyncio, resource, secrets, sys
    from schemas.log import LogConfig
    from stack.nats_server import EmbeddedNats
    from stack.provision import ProvisionError, connect, provision

    async def main() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
        with EmbeddedNats(sys.argv[1], name="exhausted") as server:
            client = await connect(server.url, name="exhaust")
            try:
                for _ in range(100):
                    await provision(client.jetstream(), LogConfig.namespaced("t" + secrets.token_hex(6)))
            except ProvisionError as exc:
                print(exc.message)
                print(server.store_failure())
            await client.close()

    asyncio.run(main())
""")


def test_a_store_the_server_cannot_create_is_a_provision_error_and_its_log_says_why(tmp_path: Path):
    done = subprocess.run([sys.executable, "-c", EXHAUST, str(tmp_path / "store"), "160"], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    refused, cause = done.stdout.splitlines()[-2:]
    assert refused.startswith("cannot create ") and "error creating store for stream" in refused, done.stdout
    assert "the NATS server's log says why" in refused
    assert "too many open files" in cause  # what the server logged, and told its client only as 10049
