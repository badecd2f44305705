"""DirectPublisher: the edge's own publish connection, against real nats-servers."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from edge.nats_direct import DirectPublisher, _Connection, direct_publisher
from edge.publisher import JetStreamLog
from rollbus.nats_server import EmbeddedNats
from rollbus.provision import connect, provision
from schemas.log import HDR_MSG_ID, LogConfig
from tests.helpers import SessionScript

SESSION = "0123456789abcdef0123456789abcdef"


def test_a_plain_url_gets_a_direct_publisher_and_credentials_are_read_from_it() -> None:
    def client(url: str, **options: object) -> Client:
        return SimpleNamespace(connected_url=urlparse(url), options={"tls": None, **options})  # type: ignore[return-value]

    plain = direct_publisher(client("nats://127.0.0.1:4333"))
    assert plain is not None and plain._address == ("127.0.0.1", 4333) and plain._auth == {}

    def auth(url: str, **options: object) -> dict[str, str]:
        publisher = direct_publisher(client(url, **{"user": None, "password": None, "token": None, **options}))
        assert publisher is not None
        return publisher._auth

    # what nats-py's CONNECT sends: the URL's credentials as written (it does not percent-decode)...
    assert auth("nats://bob:s%40cret@h:1") == {"user": "bob", "pass": "s%40cret"}
    assert auth("nats://tok@h:1") == {"auth_token": "tok"}
    # ...unless given as options: user and password first, then a token
    assert auth("nats://tok@h:1", user="ann", password="pw", token="t") == {"user": "ann", "pass": "pw"}
    assert auth("nats://bob:x@h:1", token="t") == {"auth_token": "t"}
    assert direct_publisher(client("nats://h:1", token=lambda: "fresh")) is None  # asked anew per connect
    assert direct_publisher(client("tls://h:1")) is None
    assert direct_publisher(client("nats://h:1", tls=object())) is None


def test_a_new_connection_goes_where_the_main_connection_is_now() -> None:
    nc = SimpleNamespace(connected_url=urlparse("nats://10.0.0.1:4222"), options={"tls": None}, is_connected=True)
    publisher = direct_publisher(nc)  # type: ignore[arg-type]
    assert publisher is not None and publisher._follow is not None
    nc.connected_url = urlparse("nats://10.0.0.2:4223")  # the cluster client moved
    assert publisher._follow() == ("10.0.0.2", 4223)
    nc.is_connected = False  # reconnecting: keep the last known server
    assert publisher._follow() is None


def test_the_parser_answers_pings_and_reassembles_messages_cut_anywhere() -> None:
    stream = (b'INFO {"server_id":"x"}\r\nPING\r\n+OK\r\n'
              b'MSG _INBOX.a.1 1 9\r\n{"seq":1}\r\n'
              b"HMSG _INBOX.a.2 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
              b'HMSG _INBOX.a.3 1 12 21\r\nNATS/1.0\r\n\r\n{"seq":3}\r\n')

    async def run() -> None:
        for cut in range(1, len(stream)):  # every split point of the byte stream
            delivered: list[tuple[str, bytes | None, bytes]] = []
            written: list[bytes] = []
            conn = _Connection(lambda *message, into=delivered: into.append(message))
            conn.connection_made(SimpleNamespace(write=written.append, close=lambda: None))  # type: ignore[arg-type]
            conn.data_received(stream[:cut])
            conn.data_received(stream[cut:])
            await asyncio.sleep(0)  # writes go out at the loop's next pass
            assert delivered == [("_INBOX.a.1", None, b'{"seq":1}'), ("_INBOX.a.2", b"NATS/1.0 503\r\n\r\n", b""),
                                 ("_INBOX.a.3", b"NATS/1.0\r\n\r\n", b'{"seq":3}')], cut
            assert written == [b"PONG\r\n"] and (await conn.info) == {"server_id": "x"}, cut

    asyncio.run(run())


def test_writes_of_one_loop_pass_go_out_together_and_a_lone_publish_at_once() -> None:
    async def run() -> None:
        written: list[bytes] = []
        conn = _Connection(lambda *message: None)
        conn.connection_made(SimpleNamespace(write=written.append, close=lambda: None))  # type: ignore[arg-type]
        for command in (b"HPUB a 1\r\n", b"HPUB b 2\r\n", b"PONG\r\n"):
            conn.write(command)
        assert written == []
        await asyncio.sleep(0)
        assert written == [b"HPUB a 1\r\nHPUB b 2\r\nPONG\r\n"]
        conn.write(b"PING\r\n")
        await asyncio.sleep(0)
        assert written[1:] == [b"PING\r\n"]
        conn.write(b"HPUB lone 3\r\n", alone=True)  # nothing to share a write with: out at once
        assert written[2:] == [b"HPUB lone 3\r\n"]
        conn.write(b"PONG\r\n")
        conn.write(b"HPUB after 4\r\n", alone=True)  # but never ahead of what is queued
        assert written[3:] == []
        await asyncio.sleep(0)
        assert written[3:] == [b"PONG\r\nHPUB after 4\r\n"]

    asyncio.run(run())


async def test_the_log_appends_through_its_own_connection(js: JetStreamContext, log_config: LogConfig) -> None:
    log = JetStreamLog(js, log_config, direct=True)
    assert isinstance(log._publisher, DirectPublisher)
    script = SessionScript(session_id=SESSION)
    appended = await log.append(SESSION, script.events, 0)
    stored = await js.get_msg(log_config.stream, appended.stream_seq)
    assert stored.headers is not None and stored.headers[HDR_MSG_ID] == f"{SESSION}:1"
    await log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_lost_server_fails_fast_and_a_restarted_one_is_used_again(tmp_path: Path) -> None:
    cfg = LogConfig()
    server = EmbeddedNats(tmp_path / "store", name="direct-test", port=free_port()).start()
    nc = await connect(server.url, name="direct-test")
    try:
        await provision(nc.jetstream(), cfg)
        publisher = direct_publisher(nc)
        assert publisher is not None
        subject = cfg.subject(SESSION, "turn")
        assert (await publisher.publish(subject, b"a", {HDR_MSG_ID: "m1"}, 5)).seq == 1
        await nc.subscribe("silent.listener")  # a responder that never answers: the publish stays pending
        await nc.flush()
        waiting = asyncio.ensure_future(publisher.publish("silent.listener", b"x", {HDR_MSG_ID: "m"}, 30))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(server.stop)
        with pytest.raises(ConnectionResetError):  # the pending publish fails at once, not after 30 s
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(ConnectionResetError):  # refused while the server is down: retryable
            await publisher.publish(subject, b"b", {HDR_MSG_ID: "m2"}, 5)
        await asyncio.to_thread(server.start)
        ack = await publisher.publish(subject, b"b", {HDR_MSG_ID: "m2"}, 5)
        assert (ack.seq, ack.duplicate) == (2, False)
        await publisher.close()
    finally:
        await nc.close()
        server.stop()


async def test_what_the_server_would_refuse_is_refused_before_it_is_sent(js: JetStreamContext,
                                                                          log_config: LogConfig) -> None:
    from nats.errors import MaxPayloadError

    log = JetStreamLog(js, log_config, direct=True)
    publisher = log._publisher
    assert isinstance(publisher, DirectPublisher)
    await publisher.publish(log_config.subject(SESSION, "turn"), b"x", {HDR_MSG_ID: "small"}, 5)
    assert publisher._conn is not None and publisher._conn.max_payload == 1024 * 1024  # from the server's INFO
    publisher._conn.max_payload = 100  # as a server configured with max_payload: 100 would say
    with pytest.raises(MaxPayloadError):
        await publisher.publish(log_config.subject(SESSION, "turn"), b"y" * 200, {HDR_MSG_ID: "big"}, 5)
    assert not publisher._conn.closed  # nothing was sent: the connection (and others' publishes) live on
    with pytest.raises(ValueError):  # a header it would have to sanitize: refused, not sent
        await publisher.publish(log_config.subject(SESSION, "turn"), b"z", {HDR_MSG_ID: "a\r\nb"}, 5)
    assert not publisher._conn.closed
    await log.close()


class AuthNats(EmbeddedNats):
    """A nats-server that requires the given credentials (``--user/--pass`` or ``--auth``)."""

    def __init__(self, store_dir: Path, auth: list[str]) -> None:
        super().__init__(store_dir, name="direct-auth")
        self._auth = auth

    def _command(self, binary: Path) -> list[str]:
        return [*super()._command(binary), *self._auth]


@pytest.mark.parametrize(("auth", "credentials", "wrong"), [
    (["--user", "bob", "--pass", "s3cret"], "bob:s3cret@", {"user": "bob", "password": "nope"}),
    (["--auth", "t0ken"], "t0ken@", {"token": "nope"}),
])
async def test_the_direct_connection_logs_in_as_the_main_connection_does(tmp_path: Path, auth: list[str],
                                                                           credentials: str,
                                                                           wrong: dict[str, str]) -> None:
    cfg = LogConfig()
    with AuthNats(tmp_path / "store", auth) as server:
        nc = await connect(server.url.replace("nats://", "nats://" + credentials), name="direct-auth")
        try:
            await provision(nc.jetstream(), cfg)
            log = JetStreamLog(nc.jetstream(), cfg, direct=True)
            assert isinstance(log._publisher, DirectPublisher)
            appended = await log.append(SESSION, SessionScript(session_id=SESSION).events, 0)
            stored = await nc.jetstream().get_msg(cfg.stream, appended.stream_seq)
            assert stored.headers is not None and stored.headers[HDR_MSG_ID] == f"{SESSION}:1"
            await log.close()
            host, port = server.url.removeprefix("nats://").split(":")
            refused = DirectPublisher(host, int(port), **wrong)
            with pytest.raises(ConnectionResetError, match="Authorization Violation"):
                await refused.publish(cfg.subject(SESSION, "turn"), b"x", {HDR_MSG_ID: "m"}, 5)
            await refused.close()
        finally:
            await nc.close()
