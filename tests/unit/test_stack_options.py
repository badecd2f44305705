"""``StackOptions`` hands the edge its settings by field name (``StackOptions.edge_settings``): nothing is mapped by
hand, so a setting added to both reaches the edge, and one spelled differently in the two is caught here."""

from __future__ import annotations

from typing import Any

import msgspec

from edge.settings import EdgeSettings
from schemas.log import LogConfig
from stack.options import EDGE_FIELDS, StackOptions


def _other(value: Any) -> Any:
    """A value of ``value``'s type that is not it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 7
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, tuple):
        return (*value, "other.example")
    if isinstance(value, LogConfig):
        return LogConfig(prefix="other")
    raise AssertionError(f"no other value for {value!r}")


def test_every_setting_the_two_share_reaches_the_edge() -> None:
    defaults = StackOptions()
    options = msgspec.structs.replace(defaults, **{name: _other(getattr(defaults, name)) for name in EDGE_FIELDS})
    settings = options.edge_settings(public_url="http://edge.example:9000", edge_id="host:9000")
    for name in EDGE_FIELDS:
        assert getattr(settings, name) == getattr(options, name) != getattr(EdgeSettings(), name), name
    assert settings.public_url == "http://edge.example:9000"


def test_the_edge_id_is_the_options_own_when_set_else_the_one_given() -> None:
    assert StackOptions().edge_settings(public_url="u", edge_id="host:8000").edge_id == "host:8000"
    assert StackOptions(edge_id="e1").edge_settings(public_url="u", edge_id="host:8000").edge_id == "e1"


def test_no_option_is_an_edge_setting_under_another_spelling() -> None:
    def stem(name: str) -> str:
        return name.removesuffix("_s")

    edge = {stem(name): name for name in EdgeSettings.__struct_fields__}
    misspelt = {name: edge[stem(name)] for name in StackOptions.__struct_fields__
                if stem(name) in edge and name != edge[stem(name)]}
    assert misspelt == {}
    assert {"lease_ttl_s", "idle_timeout_s", "disconnect_grace_s", "image_fetch_timeout_s"} <= set(EDGE_FIELDS)
