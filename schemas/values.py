"""What the log and the records can hold, for values that come from outside: integers within
64 bits (MessagePack in the log, Parquet and TransferQueue in the records; 32 bits where a
record column is ``int32``), and free-form values (session metadata, reward info, tool
schemas and arguments) nested at most :data:`MAX_DEPTH` levels, so that what handles them later
(the MessagePack encoder, the chat template, the materializer, each with its own stack) never
meets a value nested near the interpreter's limit. Refusals are 400s naming the field.
"""

from __future__ import annotations

from typing import Any

from schemas.errors import MalformedRequest

MAX_DEPTH = 64  # levels of arrays and objects in a kept free-form value
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a logged (MessagePack) and recorded (Parquet) integer holds
INT32_MAX = 2**31 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_free_form(value: Any, where: str, *, ints: bool = True) -> None:
    """Refuse (400) ``value`` when it nests deeper than :data:`MAX_DEPTH` (naming ``where``) or, with
    ``ints``, holds an integer outside 64 bits (naming its path under ``where``). Iterative: the walk
    itself never recurses, and it touches only the value's containers and numbers."""
    if not isinstance(value, (dict, list)):
        if ints and is_int(value) and not INT64_MIN <= value <= INT64_MAX:
            raise MalformedRequest(f"{where}: integers must fit in 64 bits (signed)", param=where)
        return
    pending: list[tuple[Any, int]] = [(value, 1)]
    bad_int = False
    while pending:
        item, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise MalformedRequest(f"{where} is nested more than {MAX_DEPTH} levels deep", param=where)
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                pending.append((child, depth + 1))
            elif ints and type(child) is int and not INT64_MIN <= child <= INT64_MAX:
                bad_int = True
    if bad_int:
        path = _bad_int_path(value, where)
        raise MalformedRequest(f"{path}: integers must fit in 64 bits (signed)", param=path)


def _bad_int_path(value: Any, where: str) -> str:
    """The path of the first integer outside 64 bits in ``value`` (nested at most MAX_DEPTH levels)."""
    if isinstance(value, dict):
        items: Any = ((f"{where}.{k}", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return where if is_int(value) and not INT64_MIN <= value <= INT64_MAX else ""
    for path, child in items:
        found = _bad_int_path(child, path)
        if found:
            return found
    return ""
