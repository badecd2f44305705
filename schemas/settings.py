"""Settings read from a nested mapping (a YAML file, verl's config) into typed structs, every problem named.

A settings section is a ``msgspec.Struct``: its fields are the keys, their types and
``msgspec.Meta`` constraints say what each value must be, their defaults are the defaults.
``msgspec.convert`` alone stops at the first problem and names it by a JSON path; :func:`read`
walks the mapping along the struct's fields instead, so that every unknown, mistyped or
out-of-range key is named, each in one line by its full dotted key::

    actor_rollout_ref.rollout.nn: unknown key (did you mean n?)
    actor_rollout_ref.rollout.top_p must be in (0, 1], got 1.5
    actor_rollout_ref.rollout.custom.agent_framework.num_workers must be int >= 0, got 'two'

Which keys a section may hold: a struct with ``forbid_unknown_fields=True`` (a section this
program owns) its fields only; any other (a section it shares with another program and reads
some keys of) its fields and the keys ``extra_keys`` returns for it, or any key where that
returns ``None``. ``null`` for a field that cannot be null reads as absent: its default applies.
:func:`describe` says in words what a type must be.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

import msgspec
import msgspec.inspect as mi

S = TypeVar("S", bound=msgspec.Struct)
ExtraKeys = Callable[[type[msgspec.Struct]], Collection[str] | None]


def any_key(struct: type[msgspec.Struct]) -> Collection[str] | None:
    """Every key is allowed beside the fields of a section that is not the program's own."""
    return None


def read(value: Any, struct: type[S], path: str = "", *,
         extra_keys: ExtraKeys = any_key) -> tuple[S | None, tuple[str, ...]]:
    """``value`` as ``struct`` and no problems, or ``None`` and every problem, one line each."""
    cleaned, problems = _section(value, struct, path, extra_keys)
    if problems:
        return None, tuple(problems)
    try:
        return msgspec.convert(cleaned, struct), ()
    except msgspec.ValidationError as exc:  # a check of the struct's own (__post_init__), at msgspec's path
        where = re.fullmatch(r"(.*) - at `\$(.*)`", str(exc))
        words, inner = (where.group(1), where.group(2)) if where else (str(exc), "")
        return None, (f"{path or 'the config'}{inner}: {words}",)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _section(value: Any, struct: type[msgspec.Struct], path: str, extra_keys: ExtraKeys) -> tuple[Any, list[str]]:
    if not isinstance(value, Mapping):
        return None, [f"{path or 'the config'} must be a mapping, got {value!r}"]
    fields = {field.encode_name: field for field in msgspec.structs.fields(struct)}
    problems = _unknown(value, struct, fields, path, extra_keys)
    cleaned: dict[str, Any] = {}
    for key, field in fields.items():
        if key not in value or (value[key] is None and not _nullable(field.type)):
            if field.required:
                problems.append(f"{_join(path, key)} is missing")
            continue
        cleaned[key], found = _value(value[key], field.type, _join(path, key), extra_keys)
        problems += found
    return cleaned, problems


def _unknown(value: Mapping[Any, Any], struct: type[msgspec.Struct], fields: Mapping[str, Any], path: str,
             extra_keys: ExtraKeys) -> list[str]:
    unknown = [key for key in value if key not in fields]
    if not unknown:
        return []
    extra = () if struct.__struct_config__.forbid_unknown_fields else extra_keys(struct)
    if extra is None:
        return []
    known = [*fields, *extra]
    problems = []
    for key in unknown:
        if key not in extra:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            problems.append(f"{_join(path, key)}: unknown key" + (f" (did you mean {close[0]}?)" if close else ""))
    return problems


def _value(value: Any, kind: Any, path: str, extra_keys: ExtraKeys) -> tuple[Any, list[str]]:
    info = _bare(mi.type_info(kind))
    if isinstance(info, mi.StructType):
        return _section(value, info.cls, path, extra_keys)
    if isinstance(info, mi.DictType) and isinstance(_bare(info.value_type), mi.StructType):
        if not isinstance(value, Mapping) or len(value) < (info.min_length or 0):
            return None, [f"{path} must be {describe(kind)}, got {value!r}"]
        struct = _bare(info.value_type).cls
        items = {key: _section(item, struct, _join(path, key), extra_keys) for key, item in value.items()}
        return {key: item for key, (item, _) in items.items()}, [p for _, found in items.values() for p in found]
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        return None, [_wrong(path, value, kind, str(exc))]
    return value, []


def _wrong(path: str, value: Any, kind: Any, message: str) -> str:
    inner = re.fullmatch(r"(.*) - at `\$(.+)`", message)
    if inner:  # inside a container: msgspec's words, at the item's key
        where, words = f"{path}{inner.group(2)}", inner.group(1)
        expected = re.fullmatch(r"Expected `(.+)`, got `(.+)`", words)
        return f"{where} must be {expected.group(1)}, got {expected.group(2)}" if expected else f"{where}: {words}"
    return f"{path} must be {describe(kind, value)}, got {value!r}"


def _nullable(kind: Any) -> bool:
    info = _bare(mi.type_info(kind))
    types = info.types if isinstance(info, mi.UnionType) else (info,)
    return any(isinstance(_bare(t), mi.NoneType | mi.AnyType) for t in types)


def _bare(info: mi.Type) -> mi.Type:
    return info.type if isinstance(info, mi.Metadata) else info


def describe(kind: Any, value: Any = msgspec.UNSET) -> str:
    """What a value of type ``kind`` must be, in words (``int >= 1``, ``one of local, sglang``); given
    the ``value`` that failed, only the constraint when the value has the right type."""
    if get_origin(kind) is Literal:  # in the order written (msgspec's type info sorts them)
        return "one of " + ", ".join(str(v) for v in get_args(kind))
    return _words(mi.type_info(kind), value)


def _words(info: mi.Type, value: Any = msgspec.UNSET) -> str:
    if isinstance(info, mi.Metadata):
        description = (info.extra_json_schema or {}).get("description")
        return str(description) if description else _words(info.type, value)
    if isinstance(info, mi.IntType | mi.FloatType):
        bounds = _bounds(info)
        if bounds and _number(value, int if isinstance(info, mi.IntType) else (int, float)):
            return bounds
        return " ".join(filter(None, ("int" if isinstance(info, mi.IntType) else "float", bounds)))
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(str(v) for v in info.values)
    if isinstance(info, mi.UnionType):
        return " or ".join(_words(t) for t in info.types)
    if isinstance(info, mi.StrType):
        return "a non-empty str" if info.min_length == 1 else "str"
    if isinstance(info, mi.DictType | mi.StructType):
        return "a mapping"
    if isinstance(info, mi.ListType | mi.VarTupleType):
        return f"a list of {_words(info.item_type)}"
    names = {mi.BoolType: "bool", mi.NoneType: "null", mi.AnyType: "anything"}
    return names.get(type(info), type(info).__name__)


def _number(value: Any, kinds: type | tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _bounds(info: mi.IntType | mi.FloatType) -> str:
    low = ("(", info.gt) if info.gt is not None else ("[", info.ge) if info.ge is not None else None
    high = (")", info.lt) if info.lt is not None else ("]", info.le) if info.le is not None else None
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {low[1]}"
    if high:
        return f"{'<' if high[0] == ')' else '<='} {high[1]}"
    return ""
