"""The production modules' imports, read from their source: no circles, one direction between
the packages, and no test doubles in a production package.

The packages, from the bottom: ``schemas`` (the contracts); ``vision`` (images: limits, headers, the
processor that turns them into placeholder counts and model inputs; it imports ``schemas`` only) and ``session``
(the session domain, pure: the fold, chain selection, summaries, views); ``eventlog`` (the log: appending, reading,
consuming) and ``observability`` (the metrics registry every component shares; each component's metrics
live beside it); ``session_projector``, ``edge``, ``materializer`` and ``reward`` (peers: they may use
one another only without a circle); ``stack`` (the parts composed into one process,
the embedded NATS server, provisioning); ``agent_framework`` (the verl side); ``rollbus`` (the
CLI). ``rollbus.testing`` holds the scripted engines: only tests and benchmarks import it.

Three more rules, read from the source too: only ``eventlog`` reaches JetStream (publishes, binds or creates a
bucket, reads a message; ``stack.provision`` creates the streams and buckets), neither the edge nor the
materializer imports the projector, and inside the edge the layers run one way (:data:`EDGE_LAYERS`, from the
bottom: ``edge.engines``; ``edge.chat``, the wire-neutral conversation; ``edge.tokens``; the wires,
``edge.wires`` with ``edge.http_errors``; the edge's core modules; ``edge.routes``; the app assembled,
``edge.app``, ``edge.openapi``, ``edge.assemble``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"schemas": 0, "vision": 1, "session": 1, "eventlog": 2, "observability": 2, "session_projector": 3, "edge": 3,
          "materializer": 3, "reward": 3, "stack": 4, "agent_framework": 5, "viewer": 5, "rollbus": 6}
TEST_DOUBLES = "rollbus.testing"


def _modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imported(module: str, path: Path) -> Iterator[str]:
    """The production modules ``module`` imports, at any depth of its code (deferred imports too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # ``from a.b import c``: c may be a name, not a module
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


GRAPH = {module: sorted(set(_imported(module, path))) for module, path in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def _circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_reader_sees_the_imports_it_must() -> None:
    """The checks below mean something only if the graph holds what the code imports."""
    assert "schemas.events" in GRAPH["edge.turns"]
    assert "edge.tokens.parsers.base" in GRAPH["edge.tokens.parsers.hermes"]
    assert len(MODULES) > 120 and sum(map(len, GRAPH.values())) > 400


def test_a_circle_is_found() -> None:
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _circles({"a": ["b"], "b": []}) == []


def test_no_module_imports_itself_back() -> None:
    assert _circles(GRAPH) == []


def test_no_package_imports_itself_back() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(module.split(".")[0], set()).update(t.split(".")[0] for t in targets)
    assert _circles({p: sorted(t - {p}) for p, t in packages.items()}) == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_run_one_way(package: str) -> None:
    upward = [f"{module} -> {target}" for module, targets in GRAPH.items() if module.split(".")[0] == package
              for target in targets if _layer(target) > _layer(module)]
    assert upward == []


def test_no_test_double_in_a_production_package() -> None:
    users = [f"{module} -> {target}" for module, targets in GRAPH.items() if not module.startswith(TEST_DOUBLES)
             for target in targets if target.startswith(TEST_DOUBLES)]
    assert users == []
    scripted = [module for module, path in MODULES.items() if not module.startswith(TEST_DOUBLES)
                and "class Scripted" in path.read_text(encoding="utf-8")]
    assert scripted == []


def test_the_edge_and_the_materializer_do_not_import_the_projector() -> None:
    """What they share with it (the ready signal, a projection's head) is a contract in ``schemas``."""
    arrows = [f"{module} -> {target}" for module, targets in GRAPH.items()
              if module.split(".")[0] in ("edge", "materializer")
              for target in targets if target.startswith("session_projector")]
    assert arrows == []


# What reaches JetStream itself, read from the source. Outside ``eventlog`` no module calls JetStream's API (binds,
# creates or deletes a KV bucket, an object store or a stream; looks up, gets or deletes a message; makes a consumer),
# and nothing publishes, subscribes or sends a request but through the log port: a ``publish``/``subscribe`` whose
# receiver is the port (named, by this code's convention, ``log``, ``_log``, ``writer`` or ``port``; any other
# receiver, a nats-py client ``nc`` or JetStream context ``js`` among them, is refused). The edge uses no core NATS
# of its own. ``stack.provision`` creates and reconciles the streams and buckets (its one job; the design puts
# provisioning in ``stack``): it may call the provisioning calls and nothing else. ``rollbus.testing`` is held to
# the rule too; ``tests/`` and ``ops/`` (whose benchmarks time raw JetStream calls on purpose) are not scanned.
_JETSTREAM_API = frozenset({
    "key_value", "create_key_value", "delete_key_value", "object_store", "create_object_store", "delete_object_store",
    "add_stream", "update_stream", "delete_stream", "purge_stream", "stream_info", "streams_info",
    "find_stream_name_by_subject", "get_msg", "get_last_msg", "delete_msg", "add_consumer", "delete_consumer",
    "consumer_info", "consumers_info", "pull_subscribe", "pull_subscribe_bind", "subscribe_bind",
})
_MESSAGING = frozenset({"publish", "publish_async", "subscribe", "request"})
_PORT_RECEIVERS = ("log", "_log", "writer", "port")
_PROVISIONING = frozenset({"add_stream", "update_stream", "stream_info", "create_key_value", "create_object_store"})
_MAY_PROVISION = "stack.provision"


def _jetstream_calls(source: str) -> Iterator[tuple[str, str]]:
    """(the call's name, ``receiver.name (line n)``) of each call that reaches JetStream itself."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver, name = ast.unparse(node.func.value), node.func.attr
        through_port = receiver.split(".")[-1] in _PORT_RECEIVERS
        if name in _JETSTREAM_API or (name in _MESSAGING and not through_port):
            yield name, f"{receiver}.{name} (line {node.lineno})"


def _jetstream_writes(module: str, source: str) -> list[str]:
    """What ``module`` may not call of JetStream (see above)."""
    return [call for name, call in _jetstream_calls(source)
            if not (module == _MAY_PROVISION and name in _PROVISIONING)]


def test_the_write_check_sees_a_write() -> None:
    source = """
async def f(nc, js, self, writer):
    await nc.publish("s", b"")
    await self._js.publish("s", b"")
    await nc.request("s", b"")
    await js.key_value("b")
    await self._js.get_last_msg("stream", "s")
    await js.create_key_value(bucket="b")
    await writer.publish("s", b"", {})
    await self._log.publish("s", b"", {})
    await self._log.subscribe("stream", "s", "durable", ack_wait=1.0, max_ack_pending=1)
"""
    found = [call.split(" ")[0] for call in _jetstream_writes("edge.x", source)]
    assert found == ["nc.publish", "self._js.publish", "nc.request", "js.key_value", "self._js.get_last_msg",
                     "js.create_key_value"]
    assert [c.split(" ")[0] for c in _jetstream_writes(_MAY_PROVISION, source)] == found[:5]  # creating: its job
    assert _jetstream_writes("eventlog.kv", (ROOT / "eventlog" / "kv.py").read_text(encoding="utf-8"))  # binds
    assert _jetstream_writes("eventlog.acks", (ROOT / "eventlog" / "acks.py").read_text(encoding="utf-8"))  # publish
    provision = (ROOT / "stack" / "provision.py").read_text(encoding="utf-8")
    assert {name for name, _ in _jetstream_calls(provision)} == _PROVISIONING  # what the exception is for


def test_only_the_eventlog_reaches_jetstream() -> None:
    """Every append, quarantine event, imported envelope and ready signal goes through
    ``eventlog.publisher.JetStreamLog`` (the port), every KV bucket through ``eventlog.kv.KvStore``, the object
    store's pieces through ``eventlog.pieces``, every read through ``eventlog.reader``: NATS's errors are mapped
    there, once."""
    writes = [f"{module}: {write}" for module, path in MODULES.items()
              if module.split(".")[0] != "eventlog"
              for write in _jetstream_writes(module, path.read_text(encoding="utf-8"))]
    assert writes == []


# Inside the edge, from the bottom: each layer imports only its own and the ones below it.
#   0 edge.engines: the engine protocol (GenerateRequest, Constraint, ...) and its clients, the local models
#   1 edge.chat: the wire-neutral conversation every wire decodes into, stream deltas, history digests
#   2 edge.tokens: tokenizers, chat templates, incremental encoding and its probes, reply and tool-call parsing
#   3 the wires: edge.wires (the OpenAI, Anthropic and Responses adapters) and edge.http_errors, the error table
#     the wire adapters encode errors with
#   4 the edge's core: settings, live sessions and turns, ownership, the session index, streaming, the service
#   5 edge.routes: one router module per wire, over the service
#   6 the app assembled: edge.app, edge.openapi, edge.assemble
EDGE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("edge.engines",),
    ("edge.chat",),
    ("edge.tokens",),
    ("edge.wires", "edge.http_errors"),
    ("edge", "edge.settings", "edge.metrics", "edge.engine_input", "edge.forks", "edge.idempotency", "edge.stored",
     "edge.images",
     "edge.ownership", "edge.session_index", "edge.live", "edge.turns", "edge.streaming", "edge.service",
     "edge.keeper"),
    ("edge.routes",),
    ("edge.app", "edge.openapi", "edge.assemble"),
)


def _edge_layer(module: str) -> int | None:
    """The layer of an edge module: the one whose unit is the module or a package above it (None: in none)."""
    for level, units in enumerate(EDGE_LAYERS):
        if any(module == unit or (unit != "edge" and module.startswith(unit + ".")) for unit in units):
            return level
    return None


def _edge_upward(graph: dict[str, list[str]]) -> list[str]:
    return [f"{module} -> {target}" for module, targets in graph.items() if module.split(".")[0] == "edge"
            for target in targets if target.split(".")[0] == "edge"
            and (_edge_layer(target) or 0) > (_edge_layer(module) or 0)]


def test_every_edge_module_has_a_layer() -> None:
    assert [module for module in GRAPH if module.split(".")[0] == "edge" and _edge_layer(module) is None] == []
    assert _edge_layer("edge.tokens.parsers.hermes") == 2 and _edge_layer("edge.routes.sse") == 5


def test_the_edge_check_sees_an_arrow_back_up() -> None:
    assert _edge_upward({"edge.wires.openai": ["edge.service", "edge.engines.base", "schemas.errors"],
                         "edge.routes.model": ["edge.service", "edge.app"], "edge.service": ["edge.chat.digest"]}) \
        == ["edge.wires.openai -> edge.service", "edge.routes.model -> edge.app"]


def test_imports_inside_the_edge_run_one_way() -> None:
    assert _edge_upward(GRAPH) == []


def test_vision_imports_only_the_contracts() -> None:
    """``vision`` sits beside ``session``, under everything that meets images: of rollbus it imports ``schemas``."""
    assert "vision.images" in GRAPH["vision.processor"]
    arrows = [f"{module} -> {target}" for module, targets in GRAPH.items() if module.split(".")[0] == "vision"
              for target in targets if target.split(".")[0] not in ("vision", "schemas")]
    assert arrows == []
