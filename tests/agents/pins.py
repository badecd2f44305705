"""The agent programs the compatibility suite runs, each pinned: the one place their versions are.

To move one, change its ``version`` (and the packages naming it) here, run its tests
(``pytest tests/agents/test_NAME.py``: the new version installs on first use, beside the old one
in the cache), and update the README's table. Python agents go into a virtualenv of their own each
(their pins clash with each other and with rollbus's); npm agents into an npm prefix of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Pin:
    """An agent program: what to install from which registry, and the executable it runs with."""

    name: str
    version: str
    registry: Literal["pypi", "npm"]
    packages: tuple[str, ...]
    executable: str  # inside its install directory

    @property
    def key(self) -> str:
        """The install directory's name."""
        return f"{self.name}-{self.version}"


def _pypi(name: str, version: str, *packages: str) -> Pin:
    return Pin(name, version, "pypi", packages, "bin/python")


def _npm(name: str, version: str, package: str, binary: str) -> Pin:
    return Pin(name, version, "npm", (f"{package}@{version}",), f"node_modules/.bin/{binary}")


PINS: dict[str, Pin] = {pin.name: pin for pin in (
    _npm("claude-code", "2.1.332", "@anthropic-ai/claude-code", "claude"),
    _npm("codex", "0.171.0", "@openai/codex", "codex"),
    _pypi("openai-agents", "0.24.0", "openai-agents==0.24.0"),
    _pypi("langgraph", "1.2.24", "langgraph==1.2.24", "langchain-openai==1.7.4"),
    _pypi("mini-swe-agent", "2.4.6", "mini-swe-agent==2.4.6"),
    _pypi("smolagents", "1.26.0", "smolagents[openai]==1.26.0"),
)}
