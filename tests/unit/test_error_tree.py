"""Every exception rollbus defines is in ``schemas/errors.py``, in the one tree rooted at ``RollbusError``
that its docstring draws. The production packages are read from their source (as the import graph's test
reads them): a class whose base is an exception, found at any depth, counts wherever it is defined."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

import schemas.errors as errors
from schemas.errors import RollbusError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "vision", "session", "eventlog", "observability", "session_projector", "edge", "materializer",
            "reward", "stack", "agent_framework", "viewer", "rollbus")
HOME = "schemas.errors"
# Private control flow, raised and caught inside one class: no error, and no RollbusError (a comment where each
# is defined says why).
ALLOWED = {"eventlog.publisher._Again"}


class Scan:
    """The exception classes of a set of modules, read from their source: a base is resolved through the
    module's own classes and imports (followed into the other scanned modules, re-exports too), the
    built-ins, and, for a third-party name, the imported object itself."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.trees = {module: ast.parse(source) for module, source in sources.items()}
        self.imports = {module: dict(self._imports(module, tree)) for module, tree in self.trees.items()}
        self.classes = {module: {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
                        for module, tree in self.trees.items()}
        self._exception = cache(self._is_exception)

    def _imports(self, module: str, tree: ast.Module) -> list[tuple[str, str]]:
        """(the name bound, what it names) for every import of ``module``, at any depth."""
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    found.append((bound, alias.name if alias.asname else bound))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module if self._is_package(module) else module.rpartition(".")[0]
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                found += [(alias.asname or alias.name, f"{base}.{alias.name}") for alias in node.names]
        return found

    def _is_package(self, module: str) -> bool:
        return any(other.startswith(module + ".") for other in self.trees)

    def defined(self) -> list[str]:
        """``module.Class`` (``module.outer.Class`` when nested) for every exception class defined."""
        return sorted(f"{module}.{qualified}" for module, tree in self.trees.items()
                      for qualified, node in _class_defs(tree, "")
                      if any(self.is_exception(module, ast.unparse(base)) for base in node.bases))

    def is_exception(self, module: str, dotted: str) -> bool:
        return self._exception(module, dotted)

    def _is_exception(self, module: str, dotted: str) -> bool:
        if not re.fullmatch(r"[\w.]+", dotted):  # Generic[T], a call: not an exception's name
            return False
        head, _, rest = dotted.partition(".")
        if not rest and head in self.classes.get(module, {}):
            node = self.classes[module][head]
            return any(self.is_exception(module, ast.unparse(base)) for base in node.bases)
        if head in self.imports.get(module, {}):
            return self._is_target(".".join(filter(None, [self.imports[module][head], rest])))
        found = getattr(builtins, head, None) if not rest else None
        return inspect.isclass(found) and issubclass(found, BaseException)

    def _is_target(self, target: str) -> bool:
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module, name = ".".join(parts[:cut]), ".".join(parts[cut:])
            if module in self.trees:
                return self.is_exception(module, name)
        return _external_exception(target)


def _class_defs(node: ast.AST, prefix: str) -> list[tuple[str, ast.ClassDef]]:
    """Every class defined in ``node``, at any depth, with its qualified name."""
    found: list[tuple[str, ast.ClassDef]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            found.append((prefix + child.name, child))
        inner = f"{prefix}{child.name}." if isinstance(child, (ast.ClassDef, ast.FunctionDef,
                                                                ast.AsyncFunctionDef)) else prefix
        found += _class_defs(child, inner)
    return found


def _external_exception(target: str) -> bool:
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name, None)
        return inspect.isclass(found) and issubclass(found, BaseException)
    return False


def _sources() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text(encoding="utf-8")
    return found


SCAN = Scan(_sources())
DEFINED = SCAN.defined()
TREE = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == HOME]


def test_the_scan_finds_exceptions_however_they_derive() -> None:
    scan = Scan({
        "schemas.errors": "class RollbusError(Exception): ...\nclass Sub(RollbusError): ...\n",
        "pkg": "",
        "pkg.a": ("from schemas.errors import Sub as Renamed\nimport nats.errors\nfrom nats.errors import Error\n"
                  "from typing import Generic, TypeVar\nT = TypeVar('T')\n"
                  "class Direct(ValueError): ...\nclass Imported(Renamed): ...\nclass Local(Direct): ...\n"
                  "class ThirdParty(Error): ...\nclass Dotted(nats.errors.TimeoutError): ...\n"
                  "class Plain(Generic[T]): ...\n"
                  "def f() -> None:\n    class Nested(KeyError): ...\n"),
        "pkg.b": "from . import a\nfrom .a import Local\nclass Relative(a.Direct): ...\nclass Again(Local): ...\n",
    })
    assert scan.defined() == ["pkg.a.Direct", "pkg.a.Dotted", "pkg.a.Imported", "pkg.a.Local", "pkg.a.ThirdParty",
                              "pkg.a.f.Nested", "pkg.b.Again", "pkg.b.Relative", "schemas.errors.RollbusError",
                              "schemas.errors.Sub"]


def test_the_scan_reads_the_project() -> None:
    """The check below means something only if the scan sees what is defined."""
    assert len(SCAN.trees) > 120
    assert sorted(f"{HOME}.{cls.__name__}" for cls in TREE) == [d for d in DEFINED if d.startswith(HOME + ".")]
    assert "eventlog.publisher._Again" in DEFINED
    assert not any(d.startswith("schemas.wire_openai.") for d in DEFINED)  # ErrorResponse is a wire shape


def test_every_exception_is_defined_in_schemas_errors() -> None:
    elsewhere = [d for d in DEFINED if not d.startswith(HOME + ".") and d not in ALLOWED]
    assert elsewhere == [], "define exceptions in schemas/errors.py, in its tree"


def test_the_allowed_exceptions_still_exist_and_stay_private() -> None:
    for name in ALLOWED:
        assert name in DEFINED
        assert name.rpartition(".")[2].startswith("_")


@pytest.mark.parametrize("cls", TREE, ids=lambda cls: cls.__name__)
def test_every_exception_is_a_rollbus_error(cls: type[BaseException]) -> None:
    assert issubclass(cls, RollbusError)


def _drawn() -> dict[str, tuple[str | None, list[str]]]:
    """The tree drawn in schemas/errors.py's docstring: each class's parent and its extra bases."""
    drawn: dict[str, tuple[str | None, list[str]]] = {"RollbusError": (None, [])}
    parents = ["RollbusError"]
    for line in (errors.__doc__ or "").splitlines():
        found = re.match(r"    ([│ ]*)[├└]── (\w+)( \(\+(\w+)\))?", line)  # (the block is indented 4)
        if found is None:
            continue
        depth = len(found.group(1)) // 4 + 1
        name = found.group(2)
        parents[depth:] = [name]
        drawn[name] = (parents[depth - 1], [found.group(4)] if found.group(4) else [])
    return drawn


def test_the_tree_drawn_in_the_docstring_is_the_tree() -> None:
    drawn = _drawn()
    built = {cls.__name__: (cls.__bases__[0].__name__ if cls is not RollbusError else None,
                            [base.__name__ for base in cls.__bases__[1:]]) for cls in TREE}
    assert drawn == built
