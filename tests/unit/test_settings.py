"""Settings sections read into typed structs (schemas.settings): every problem named by its dotted key."""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta

from schemas.settings import describe, read


class Inner(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    size: Annotated[int, Meta(ge=1, le=8)] = 1


class Owned(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    mode: Literal["fast", "slow"] = "fast"
    ratio: Annotated[float, Meta(gt=0, lt=1)] = 0.5
    parts: dict[str, Inner] = {}
    tags: tuple[str, ...] = ()
    note: str | None = None


class Shared(msgspec.Struct, kw_only=True):  # another program's section: this one reads `owned` and `level`
    owned: Owned
    level: int = 0


def test_a_valid_section_converts_and_null_is_the_default():
    section, problems = read({"owned": {"name": "a", "parts": {"p": {"size": 2}}, "note": None, "mode": None},
                              "theirs": 1}, Shared, "top")
    assert problems == ()
    assert section == Shared(owned=Owned(name="a", parts={"p": Inner(size=2)}))


def test_every_problem_is_named_by_its_dotted_key():
    value = {"owned": {"nme": "a", "ratio": 1, "mode": "quick", "parts": {"p": {"size": 9, "colour": 1}},
                       "tags": ["x", 2]}, "level": "high"}
    assert read(value, Shared, "top") == (None, (
        "top.owned.nme: unknown key (did you mean name?)",
        "top.owned.name is missing",
        "top.owned.mode must be one of fast, slow, got 'quick'",
        "top.owned.ratio must be in (0, 1), got 1",
        "top.owned.parts.p.colour: unknown key",
        "top.owned.parts.p.size must be in [1, 8], got 9",
        "top.owned.tags[1] must be str, got int",
        "top.level must be int, got 'high'",
    ))


def test_a_shared_sections_other_keys_are_checked_against_what_the_other_program_knows():
    def known(struct: type[msgspec.Struct]) -> Collection[str] | None:
        return {"levels", "theirs"} if struct is Shared else None

    section, problems = read({"owned": {"name": "a"}, "theirs": 1, "levl": 2}, Shared, extra_keys=known)
    assert section is None and problems == ("levl: unknown key (did you mean level?)",)
    assert read([], Shared, "top") == (None, ("top must be a mapping, got []",))


@pytest.mark.parametrize(("kind", "value", "words"), [
    (Annotated[int, Meta(ge=0)], msgspec.UNSET, "int >= 0"),
    (Annotated[int, Meta(ge=0)], -1, ">= 0"),
    (Annotated[int, Meta(ge=0)], "x", "int >= 0"),
    (Annotated[float, Meta(gt=0)], msgspec.UNSET, "float > 0"),
    (Annotated[float, Meta(le=2)], 3, "<= 2"),
    (Literal["b", "a"], msgspec.UNSET, "one of b, a"),
    (str | None, msgspec.UNSET, "str or null"),
    (Annotated[str, Meta(pattern="^x", description="an x-name")], "y", "an x-name"),
    (tuple[int, ...], msgspec.UNSET, "a list of int"),
    (bool, msgspec.UNSET, "bool"),
])
def test_describe_says_what_a_value_must_be(kind, value, words):
    assert describe(kind, value) == words


class Checked(msgspec.Struct, kw_only=True):
    low: int = 0
    high: int = 1

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low must not exceed high")


def test_a_structs_own_check_is_a_problem_too():
    assert read({"low": 2}, Checked, "range") == (None, ("range: low must not exceed high",))
