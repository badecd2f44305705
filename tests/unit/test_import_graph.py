"""The production modules' imports, read from their source: no circles, one direction between
the packages, and no test doubles in a production package.

The packages, from the bottom: ``schemas`` (the contracts); ``session`` (the session domain,
pure: the fold, chain selection, summaries, views); ``eventlog`` (the log: appending, reading,
consuming) and ``observability`` (the metrics registry every component shares; each component's metrics
live beside it); ``session_projector``, ``edge``, ``materializer`` and ``reward`` (peers: they may use
one another only without a circle); ``stack`` (the parts composed into one process,
the embedded NATS server, provisioning); ``agent_framework`` (the verl side); ``rollbus`` (the
CLI). ``rollbus.testing`` holds the scripted engines: only tests and benchmarks import it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"schemas": 0, "session": 1, "eventlog": 2, "observability": 2, "session_projector": 3, "edge": 3,
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
    assert "edge.codec.parsers.base" in GRAPH["edge.codec.parsers.hermes"]
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


# What writes to JetStream or binds a KV bucket, read from the source: a ``publish`` (or ``publish_async``) called on
# a NATS client or JetStream context (named, by this code's convention, ``nc``/``js`` or ``....jetstream()``), or
# any ``key_value``/``create_key_value`` call. Only ``eventlog`` may (and ``stack.provision``, which creates buckets).
_NATS_RECEIVERS = ("nc", "_nc", "js", "_js", "jetstream()", "client")
_KV_CALLS = ("key_value", "create_key_value")
_MAY_CREATE_BUCKETS = ("stack.provision",)


def _jetstream_writes(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        publish = node.func.attr in ("publish", "publish_async") and receiver.split(".")[-1] in _NATS_RECEIVERS
        if publish or node.func.attr in _KV_CALLS:
            yield f"{receiver}.{node.func.attr} (line {node.lineno})"


def test_the_write_check_sees_a_write() -> None:
    assert list(_jetstream_writes(ROOT / "eventlog" / "acks.py"))  # AckedPublisher: nc.publish
    assert list(_jetstream_writes(ROOT / "eventlog" / "kv.py"))  # KvStore binds its bucket


def test_only_the_eventlog_writes_to_jetstream() -> None:
    """Every append, quarantine event, imported envelope and ready signal goes through
    ``eventlog.publisher.JetStreamLog``, every KV bucket through ``eventlog.kv.KvStore``: NATS's errors are
    mapped in one place."""
    writes = [f"{module}: {write}" for module, path in MODULES.items()
              if not module.startswith(("eventlog", TEST_DOUBLES))
              for write in _jetstream_writes(path)
              if not (module in _MAY_CREATE_BUCKETS and ".create_key_value" in write)]
    assert writes == []
