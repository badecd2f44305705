"""The append path's failures against real nats-servers: what each one does to an append.

A dead (half-open) link is found by the client's pings and the append goes out on a new
connection, or fails in bounded time while none can be made; refused credentials, a subject
the user may not publish to, a reply subscription it may not make and an envelope over the
server's ``max_payload`` fail at once, with what to fix; a reply that is not an
acknowledgement is a 503, not a 500; a restarted server is used again, with the same
``Nats-Msg-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from eventlog.publisher import JetStreamLog, refusal
from schemas.errors import LogUnavailable, PayloadTooLarge
from schemas.events import Event, SessionFinalized
from schemas.log import HDR_MSG_ID, LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, connect, provision
from tests.helpers import SessionScript

SESSION = "0123456789abcdef0123456789abcdef"
DEAD_LINK_FOUND_S = PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1)  # at the latest, after the link died


class SilentProxy:
    """A TCP relay to a nats-server whose links can go silent: :meth:`go_silent` stops relaying on
    every link it has, both ways, and closes nothing (a link gone dead: no FIN, no RST), and, with
    ``new_links_too``, on the links made afterwards; :meth:`resume` relays new links again (a dead
    one stays dead, as a dropped NAT entry does)."""

    def __init__(self, upstream_url: str) -> None:
        host, port = upstream_url.removeprefix("nats://").split(":")
        self._upstream = (host, int(port))
        self._dead: list[list[bool]] = []  # per link, one flag: dead
        self._silent_new = False
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> SilentProxy:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def go_silent(self, *, new_links_too: bool = False) -> None:
        for dead in self._dead:
            dead[0] = True
        self._silent_new = new_links_too

    def resume(self) -> None:
        self._silent_new = False

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dead = [self._silent_new]
        self._dead.append(dead)
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pump(reader, up_writer, dead), self._pump(up_reader, writer, dead))

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, dead: list[bool]) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if not dead[0]:  # a dead link swallows what it is sent
                    sink.write(data)
                    await sink.drain()
        if not dead[0]:
            sink.close()

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


class ConfiguredNats(EmbeddedNats):
    """An embedded nats-server with extra arguments (credentials, a configuration file)."""

    def __init__(self, store_dir: Path, extra: list[str], *, port: int = -1) -> None:
        super().__init__(store_dir, name="append-path", port=port)
        self.extra = extra

    def _command(self, binary: Path) -> list[str]:
        return [*super()._command(binary), *self.extra]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_file(path: Path, text: str) -> list[str]:
    path.write_text(text)
    return ["-c", str(path)]


async def until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


def later(script: SessionScript) -> Event:
    return SessionFinalized(session_id=script.session_id, seq=len(script.events) + 1, time=9.0)


async def stored_ids(js: JetStreamContext, cfg: LogConfig) -> list[str]:
    info = await js.stream_info(cfg.stream)
    return [(await js.get_msg(cfg.stream, seq)).headers[HDR_MSG_ID] for seq in range(1, info.state.last_seq + 1)]


@contextlib.asynccontextmanager
async def through_proxy(nats_server: EmbeddedNats):
    proxy = await SilentProxy(nats_server.url).start()
    nc = await connect(proxy.url, name="half-open")  # the edge's ping settings
    try:
        yield proxy, nc
    finally:
        await nc.close()
        await proxy.close()


async def test_a_half_open_link_is_found_by_pings_and_the_append_goes_out_on_a_new_connection(
        nats_server: EmbeddedNats, js: JetStreamContext, log_config: LogConfig) -> None:
    script = SessionScript(session_id=SESSION)
    async with through_proxy(nats_server) as (proxy, nc):
        log = JetStreamLog(nc, log_config, timeout=30.0, attempts=2)
        first = await log.append(SESSION, script.events, 0)
        proxy.go_silent()  # the link dies; a new connection would work
        started = time.monotonic()
        appended = await log.append(SESSION, [later(script)], first.stream_seq)
        # The attempt on the dead link fails once the client's pings find it, not at its 30 s
        # deadline, and the retry goes out on the new connection.
        assert time.monotonic() - started < DEAD_LINK_FOUND_S + 1.5
        assert nc.stats["reconnects"] == 1 and (appended.stream_seq, appended.duplicate) == (2, False)
    assert await stored_ids(js, log_config) == [f"{SESSION}:1", f"{SESSION}:2"]


async def test_while_no_link_works_appends_fail_in_bounded_time_and_succeed_once_one_does(
        nats_server: EmbeddedNats, js: JetStreamContext, log_config: LogConfig) -> None:
    script = SessionScript(session_id=SESSION)
    async with through_proxy(nats_server) as (proxy, nc):
        first = await JetStreamLog(nc, log_config).append(SESSION, script.events, 0)
        proxy.go_silent(new_links_too=True)
        cut = started = time.monotonic()
        with pytest.raises(LogUnavailable, match="did not acknowledge"):  # 3 attempts of 1 s, not a hang
            await JetStreamLog(nc, log_config, timeout=1.0, attempts=3).append(SESSION, [later(script)], 1)
        assert time.monotonic() - started < 3 * 1.0 + 1
        await until(lambda: not nc.is_connected, DEAD_LINK_FOUND_S + 2 - (time.monotonic() - cut))  # pings
        proxy.resume()
        started = time.monotonic()
        appended = await JetStreamLog(nc, log_config).append(SESSION, [later(script)], first.stream_seq)
        assert appended.stream_seq == 2 and time.monotonic() - started < 5.0 + 3  # (its first attempt, mostly)
    assert await stored_ids(js, log_config) == [f"{SESSION}:1", f"{SESSION}:2"]


@pytest.mark.parametrize(("before", "after", "credentials"), [
    (["--user", "bob", "--pass", "s3cret"], ["--user", "bob", "--pass", "changed"], "bob:s3cret@"),
    (["--auth", "t0ken"], ["--auth", "changed"], "t0ken@"),
])
async def test_credentials_the_server_refuses_fail_an_append_at_once(tmp_path: Path, before: list[str],
                                                                      after: list[str], credentials: str) -> None:
    cfg = LogConfig()
    server = ConfiguredNats(tmp_path / "store", before, port=free_port()).start()
    nc = await connect(server.url.replace("nats://", "nats://" + credentials), name="refused")
    try:
        await provision(nc.jetstream(), cfg)
        log = JetStreamLog(nc, cfg)
        script = SessionScript(session_id=SESSION)
        await log.append(SESSION, script.events, 0)
        await asyncio.to_thread(server.stop)
        server.extra = after  # the credentials changed: the client's reconnects are refused
        await asyncio.to_thread(server.start)
        await until(lambda: refusal(nc.last_error) is not None, 10)
        started = time.monotonic()
        with pytest.raises(LogUnavailable, match=r"refused the edge's credentials \(nats: 'Authorization Violation'\)"):
            await log.append(SESSION, [later(script)], 1)
        assert time.monotonic() - started < 0.5  # not after 4 attempts of 5 s
    finally:
        await nc.close()
        server.stop()


@pytest.mark.parametrize("credentials", ["bob:wrong@", "nobody@", ""])
async def test_credentials_refused_at_the_first_connect_fail_it_at_once(tmp_path: Path, credentials: str) -> None:
    """nats-py retries a refused first connect until the caller's timeout; connect fails at once, saying why
    (`rollbus sessions --nats` with a wrong password, an edge started with stale credentials)."""
    with ConfiguredNats(tmp_path / "store", ["--user", "bob", "--pass", "s3cret"]) as server:
        started = time.monotonic()
        with pytest.raises(LogUnavailable, match=r"refused the edge's credentials \(nats: 'Authorization Violation'\)"):
            await connect(server.url.replace("nats://", "nats://" + credentials), name="refused", timeout_s=10)
        assert time.monotonic() - started < 3  # not after the 10 s timeout
        good = await connect(server.url.replace("nats://", "nats://bob:s3cret@"), name="good")
        assert good.is_connected
        await good.close()


USERS = """
authorization {
  users = [
    {user: admin, password: a}
    {user: edge, password: e, permissions: {publish: {deny: ["rollbus.>"]}}}
    {user: deaf, password: d, permissions: {subscribe: {deny: ["_INBOX.>"]}}}
  ]
}
"""


@pytest.mark.parametrize(("user", "refused", "stored"), [
    ("edge", 'may not publish to the subject .*for publish to "rollbus.0123456789abcdef0123456789abcdef.opened"', 0),
    ("deaf", r"may not subscribe to its reply inbox .*for subscription to", 1),  # stored, but no ack can come
])
async def test_a_permissions_violation_fails_the_append_at_once(tmp_path: Path, user: str, refused: str,
                                                                stored: int) -> None:
    cfg = LogConfig()
    with ConfiguredNats(tmp_path / "store", config_file(tmp_path / "users.conf", USERS)) as server:
        admin = await connect(server.url.replace("nats://", "nats://admin:a@"), name="admin")
        nc = await connect(server.url.replace("nats://", f"nats://{user}:{user[0]}@"), name=user)
        try:
            await provision(admin.jetstream(), cfg)
            started = time.monotonic()
            with pytest.raises(LogUnavailable, match=f"NATS refused the append: this NATS user {refused}"):
                await JetStreamLog(nc, cfg).append(SESSION, SessionScript(session_id=SESSION).events, 0)
            assert time.monotonic() - started < 1.0  # not at the 5 s deadline, and not retried
            assert nc.is_connected and (await admin.jetstream().stream_info(cfg.stream)).state.messages == stored
        finally:
            await nc.close()
            await admin.close()


@pytest.mark.parametrize("over", ["with its headers", "alone"])
async def test_an_envelope_over_the_servers_max_payload_is_too_large_and_the_connection_lives_on(
        tmp_path: Path, over: str) -> None:
    cfg = LogConfig()
    with ConfiguredNats(tmp_path / "store", config_file(tmp_path / "small.conf", "max_payload: 4096")) as server:
        nc = await connect(server.url, name="small")
        try:
            await provision(nc.jetstream(), cfg)
            log = JetStreamLog(nc, cfg)
            pad = 3900 if over == "with its headers" else 5000  # the payload alone under 4096 (what nats-py checks)
            big = SessionScript(session_id=SESSION, metadata={"pad": "x" * pad})
            with pytest.raises(PayloadTooLarge, match="max_payload"):
                await log.append(SESSION, big.events, 0)
            assert nc.is_connected  # nothing was sent that the server would drop the connection for
            assert (await log.append(SESSION, SessionScript(session_id=SESSION).events, 0)).stream_seq == 1
        finally:
            await nc.close()


async def test_a_reply_that_is_not_an_acknowledgement_is_log_unavailable(nats_server: EmbeddedNats) -> None:
    cfg = LogConfig.namespaced("garbled")  # no stream: a plain responder answers instead

    async def answer(msg: Msg) -> None:
        await msg.respond(b"<html>502 Bad Gateway</html>")

    nc = await connect(nats_server.url, name="garbled")
    try:
        await nc.subscribe(cfg.subjects, cb=answer)
        await nc.flush()
        with pytest.raises(LogUnavailable, match="not an acknowledgement"):
            await JetStreamLog(nc, cfg).append(SESSION, SessionScript(session_id=SESSION).events, 0)
    finally:
        await nc.close()


async def test_a_log_that_no_stream_takes_fails_after_quick_retries_saying_so(nats_server: EmbeddedNats) -> None:
    nc = await connect(nats_server.url, name="no-stream")
    try:
        started = time.monotonic()
        with pytest.raises(LogUnavailable, match="no stream takes the subject"):
            await JetStreamLog(nc, LogConfig.namespaced("nostream")).append(
                SESSION, SessionScript(session_id=SESSION).events, 0)
        assert time.monotonic() - started < 2.0  # no responders is answered at once; only the backoff waits
    finally:
        await nc.close()


async def test_an_append_while_the_server_restarts_is_stored_once_when_it_is_back(tmp_path: Path) -> None:
    cfg = LogConfig()
    server = EmbeddedNats(tmp_path / "store", name="restarting", port=free_port()).start()
    nc: Client = await connect(server.url, name="restarting")
    try:
        await provision(nc.jetstream(), cfg)
        log = JetStreamLog(nc, cfg, timeout=2.0, attempts=5)
        script = SessionScript(session_id=SESSION)
        await log.append(SESSION, script.events, 0)
        await asyncio.to_thread(server.stop)
        appending = asyncio.ensure_future(log.append(SESSION, [later(script)], 1))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(server.start)
        appended = await asyncio.wait_for(appending, 10)
        assert appended.stream_seq == 2
        assert await stored_ids(nc.jetstream(), cfg) == [f"{SESSION}:1", f"{SESSION}:2"]
    finally:
        await nc.close()
        server.stop()
