"""A three-node NATS cluster on one machine: the node configurations, and waiting for it to be ready.

``ops/nats/n1.conf`` .. ``n3.conf`` are :func:`render` of :data:`DEFAULT_NODES` (client ports
4222-4224, cluster routes on 6222-6224, monitoring on 8222-8224); ``ops/nats/cluster.sh`` starts
them, and the cluster tests write the same shape on free ports. Each node keeps its JetStream
store in a directory named after it, relative to the directory it is started in (the cluster's
directory), so a cluster is one folder::

    python -m stack.cluster write /tmp/rb-cluster            # n1.conf n2.conf n3.conf (default ports)
    python -m stack.cluster wait /tmp/rb-cluster              # until every node answers healthy
    python -m stack.cluster urls /tmp/rb-cluster              # nats://127.0.0.1:4222,nats://...
    python -m stack.cluster provision /tmp/rb-cluster         # the log's streams and buckets, on every node

A client given all three URLs (comma-separated ``--nats``) fails over to another node when
its node dies; a stream created with three replicas (``--replicas 3``) keeps every acknowledged
message through the loss of one node (JetStream acknowledges a message once a majority stored it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from schemas.errors import LogUnavailable, RollbusError
from schemas.log import LogConfig
from stack.nats_server import monitor_client
from stack.provision import connect, provision

CLUSTER_NAME = "rollbus"
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Node:
    name: str
    client_port: int
    cluster_port: int
    monitor_port: int

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.client_port}"


DEFAULT_NODES = tuple(Node(f"n{i + 1}", 4222 + i, 6222 + i, 8222 + i) for i in range(3))


def render(node: Node, nodes: Sequence[Node]) -> str:
    """One node's configuration: its ports, routes to every other node, JetStream in ``./<name>``."""
    routes = "\n".join(f"    nats-route://{HOST}:{other.cluster_port}" for other in nodes if other != node)
    return f"""# rollbus NATS cluster, node {node.name} of {len(nodes)} (written by python -m stack.cluster)
# Start it in the cluster's directory: its JetStream store is ./{node.name} (relative to the working directory).
server_name: {node.name}
listen: {HOST}:{node.client_port}
http: {HOST}:{node.monitor_port}

jetstream {{
  store_dir: "{node.name}"
}}

cluster {{
  name: {CLUSTER_NAME}
  listen: {HOST}:{node.cluster_port}
  routes: [
{routes}
  ]
}}
"""


def write(directory: Path, nodes: Sequence[Node] = DEFAULT_NODES) -> list[Path]:
    """``<name>.conf`` for every node in ``directory``; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for node in nodes:
        path = directory / f"{node.name}.conf"
        path.write_text(render(node, nodes))
        paths.append(path)
    return paths


def urls(nodes: Sequence[Node]) -> str:
    """The comma-separated client URLs, as ``--nats`` takes them."""
    return ",".join(node.url for node in nodes)


def _get(node: Node, path: str, timeout_s: float) -> tuple[int, bytes]:
    """The node's monitoring answer to ``path`` (status 0: none)."""
    try:
        response = monitor_client().get(f"http://{HOST}:{node.monitor_port}{path}", timeout=timeout_s)
    except httpx.HTTPError:
        return 0, b""
    return response.status_code, response.content


def healthy(node: Node, timeout_s: float = 1.0) -> bool:
    """The node's JetStream answers (``/healthz``: it has joined the cluster and found a meta leader)."""
    return _get(node, "/healthz", timeout_s)[0] == 200


def meta_complete(node: Node, size: int, timeout_s: float = 1.0) -> bool:
    """The node leads JetStream's meta group and sees every other node current (``/jsz``): only then can
    a stream with ``size`` replicas be placed (before, the server answers "no suitable peers")."""
    status, body = _get(node, "/jsz", timeout_s)
    try:
        meta = json.loads(body).get("meta_cluster", {}) if status == 200 else {}
    except ValueError:
        return False
    replicas = meta.get("replicas") or []
    return (meta.get("leader") == node.name and len(replicas) == size - 1
            and all(r.get("current") for r in replicas))


def wait(nodes: Sequence[Node], timeout_s: float = 30.0) -> list[Node]:
    """Wait until every node is healthy and the meta leader sees them all; returns the nodes that are not
    healthy at the deadline (all of them when no leader sees the whole cluster; none: ready)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [node for node in nodes if not healthy(node)]
        if not pending and any(meta_complete(node, len(nodes)) for node in nodes):
            return []
        if time.monotonic() > deadline:
            return pending or list(nodes)
        time.sleep(0.2)


async def provision_log(nodes: Sequence[Node], cfg: LogConfig = LogConfig(), timeout_s: float = 30.0) -> None:
    """Create (or scale up) the log's streams and buckets with one replica per node, so every component,
    whatever its ``--replicas``, finds them replicated. A cluster restarted on its stores elects a leader
    per stream after it is healthy: until then JetStream does not answer, and provision is tried again."""
    nc = await connect(urls(nodes), name="rollbus-cluster-provision")
    retrying = AsyncRetrying(retry=retry_if_exception_type(LogUnavailable), stop=stop_after_delay(timeout_s),
                             wait=wait_fixed(0.5), reraise=True)
    try:
        await retrying(provision, nc.jetstream(), cfg, replicas=len(nodes))
    finally:
        await nc.close()


def _parse_node(path: Path) -> Node:
    """A node back from its configuration file (the lines :func:`render` writes)."""
    values: dict[str, str] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.endswith("{"):
            section = line.split()[0]
        elif line == "}":
            section = ""
        elif ":" in line and not line.startswith("#"):
            key, value = (part.strip() for part in line.split(":", 1))
            values[f"{section}.{key}" if section else key] = value
    return Node(values["server_name"], int(values["listen"].rsplit(":", 1)[1]),
                int(values["cluster.listen"].rsplit(":", 1)[1]), int(values["http"].rsplit(":", 1)[1]))


def read(directory: Path) -> list[Node]:
    """The nodes whose configurations are in ``directory`` (``n*.conf``)."""
    return [_parse_node(path) for path in sorted(directory.glob("n*.conf"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["write", "wait", "urls", "provision"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--timeout", type=float, default=30.0, help="wait: seconds [30]")
    args = parser.parse_args(argv)
    if args.action == "write":
        for path in write(args.directory):
            print(path)
        return 0
    nodes = read(args.directory)
    if not nodes:
        print(f"{args.directory}: no n*.conf (run: python -m stack.cluster write {args.directory})", file=sys.stderr)
        return 2
    if args.action == "urls":
        print(urls(nodes))
        return 0
    if args.action == "provision":
        try:
            asyncio.run(provision_log(nodes, timeout_s=args.timeout))
        except RollbusError as exc:
            print(f"provision: {exc.message}", file=sys.stderr)
            return 1
        print(f"log provisioned with {len(nodes)} replicas on {urls(nodes)}")
        return 0
    pending = wait(nodes, args.timeout)
    if pending:
        print(f"not healthy after {args.timeout:g}s: {', '.join(n.name for n in pending)}", file=sys.stderr)
        return 1
    print(f"cluster {CLUSTER_NAME} ready: {urls(nodes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
