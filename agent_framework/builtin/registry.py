"""Name -> implementation registries for the built-in runner: tasks, agents, tools, sandboxes.

Implementations register themselves when their module is imported::

    @register_task("arithmetic")
    class Arithmetic(Task): ...

and are looked up by the name a task config gives (``TASKS.get("arithmetic")``). An
unknown name is a :class:`ValueError` that lists the known ones. A name is registered
once: a second, different implementation under the same name is refused, so a plugin
cannot silently replace a built-in.

Each kind's registry lives beside the kind (``TASKS`` in :mod:`~agent_framework.builtin.tasks.base`,
``AGENTS`` in :mod:`~agent_framework.builtin.agents`, ``TOOLS`` in :mod:`~agent_framework.builtin.tools`,
``SANDBOXES`` in :mod:`~agent_framework.builtin.sandbox`), so this module imports none of them.

Plugins outside this package register the same way; import their module before the
runner looks them up (``run_task(..., plugins=["my_pkg.tasks"])`` does it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations of one kind (``"task"``, ``"agent"``, ...) by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers what it decorates under ``name`` and returns it unchanged."""

        def add(entry: T) -> T:
            known = self._entries.get(name)
            if known is not None and known is not entry and _qualname(known) != _qualname(entry):
                raise ValueError(f"{self.kind} {name!r} is already registered as {_qualname(known)}")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _qualname(entry: object) -> str:
    """``module.Name`` of a class or function (equal across a module reload)."""
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"
