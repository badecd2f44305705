"""What changed between two record datasets (``rollbus materialize --diff``). Pure over Arrow tables.

Rows are matched by ``key``. Padded datasets are compared on their valid tokens (the last
``prompt_len`` prompt tokens, the first ``response_len`` response tokens), so changing
the layout alone changes nothing; a truncation, a mask or a reward does.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa

from materializer.dataset import layout, valid_tokens
from materializer.padding import Jagged
from schemas.records import SEQUENCE_COLUMNS

SCALAR_COLUMNS = ("uid", "session_index", "trajectory_index", "session_id", "agent_name", "status", "prompt_len",
                  "response_len", "global_steps", "materialization_reason", "num_turns", "reward",
                  "reward_extra_info", "reward_source", "min_global_steps", "max_global_steps", "metadata",
                  "truncated")


class Side(msgspec.Struct, frozen=True, kw_only=True):
    records: int
    duplicate_keys: int
    layout: str  # "unpadded" | "padded P/R"
    mean_prompt_len: float
    mean_response_len: float
    trained_tokens: int  # sum of loss_mask
    mean_reward: float
    truncated: int


class DatasetDiff(msgspec.Struct, frozen=True, kw_only=True):
    old: Side
    new: Side
    common: int
    only_old: list[str]
    only_new: list[str]
    changed: dict[str, int]  # column -> rows (among common keys) whose value differs

    @property
    def identical(self) -> bool:
        return not (self.only_old or self.only_new or any(self.changed.values())
                    or self.old.duplicate_keys or self.new.duplicate_keys)


def _rows_differ(old: Jagged, new: Jagged, oi: np.ndarray, ni: np.ndarray) -> np.ndarray:
    lo, ln = old.lengths[oi], new.lengths[ni]
    differ = lo != ln
    same = np.flatnonzero(~differ & (lo > 0))
    if len(same):
        a = _rows(old, oi[same])
        b = _rows(new, ni[same])
        unequal = (a.values != b.values) & ~(_isnan(a.values) & _isnan(b.values))
        segment = np.repeat(np.arange(len(same)), lo[same])
        differ[same] = np.bincount(segment, weights=unequal, minlength=len(same)) > 0
    return differ


def _rows(rows: Jagged, index: np.ndarray) -> Jagged:
    lengths = rows.lengths[index]
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.repeat(rows.offsets[index] - offsets[:-1], lengths) + np.arange(offsets[-1])
    return Jagged(rows.values[flat], offsets)


def _isnan(values: np.ndarray) -> np.ndarray:
    return np.isnan(values) if values.dtype.kind == "f" else np.zeros(len(values), dtype=bool)


def _scalar_differ(old: pa.Table, new: pa.Table, column: str, oi: np.ndarray, ni: np.ndarray) -> int:
    a = old.column(column).take(pa.array(oi)).to_pylist()
    b = new.column(column).take(pa.array(ni)).to_pylist()
    return sum(x != y for x, y in zip(a, b, strict=True))


def _side(table: pa.Table) -> Side:
    keys = table.column("key").to_pylist()
    pad = layout(table)
    n = max(len(keys), 1)
    return Side(records=len(keys), duplicate_keys=len(keys) - len(set(keys)),
                layout="unpadded" if pad is None else f"padded {pad['prompt_length']}/{pad['response_length']}",
                mean_prompt_len=float(np.sum(table.column("prompt_len").to_numpy())) / n,
                mean_response_len=float(np.sum(table.column("response_len").to_numpy())) / n,
                trained_tokens=int(valid_tokens(table, "loss_mask").values.sum()) if len(keys) else 0,
                mean_reward=float(np.sum(table.column("reward").to_numpy())) / n,
                truncated=int(np.sum(table.column("truncated").to_numpy(zero_copy_only=False))))


def diff_tables(old: pa.Table, new: pa.Table) -> DatasetDiff:
    old_index = {k: i for i, k in enumerate(old.column("key").to_pylist())}
    new_index = {k: i for i, k in enumerate(new.column("key").to_pylist())}
    common = sorted(old_index.keys() & new_index.keys())
    oi = np.array([old_index[k] for k in common], dtype=np.int64)
    ni = np.array([new_index[k] for k in common], dtype=np.int64)
    changed: dict[str, int] = {}
    for column in SEQUENCE_COLUMNS:
        if common:
            changed[column] = int(_rows_differ(valid_tokens(old, column), valid_tokens(new, column), oi, ni).sum())
    for column in SCALAR_COLUMNS:
        if common:
            changed[column] = _scalar_differ(old, new, column, oi, ni)
    return DatasetDiff(old=_side(old), new=_side(new), common=len(common),
                       only_old=sorted(old_index.keys() - new_index.keys()),
                       only_new=sorted(new_index.keys() - old_index.keys()), changed=changed)


def render(diff: DatasetDiff) -> str:
    lines = [f"keys: {diff.common} in both, {len(diff.only_old)} only in the old output, "
             f"{len(diff.only_new)} only in the new one"]
    lines += [f"  only old: {', '.join(diff.only_old[:5])}{' ...' if len(diff.only_old) > 5 else ''}"] * bool(
        diff.only_old)
    lines += [f"  only new: {', '.join(diff.only_new[:5])}{' ...' if len(diff.only_new) > 5 else ''}"] * bool(
        diff.only_new)
    moved = {c: n for c, n in diff.changed.items() if n}
    lines.append("changed rows per column: " + (", ".join(f"{c} {n}" for c, n in moved.items()) or "none"))
    lines.append(f"{'':<18}{'old':>16}{'new':>16}")
    for label, attr, fmt in _SUMMARY:
        lines.append(f"{label:<18}{fmt(getattr(diff.old, attr)):>16}{fmt(getattr(diff.new, attr)):>16}")
    lines.append("identical" if diff.identical else "different")
    return "\n".join(lines)


_SUMMARY = [
    ("records", "records", str), ("duplicate keys", "duplicate_keys", str), ("layout", "layout", str),
    ("mean prompt len", "mean_prompt_len", lambda v: f"{v:.1f}"),
    ("mean response len", "mean_response_len", lambda v: f"{v:.1f}"),
    ("trained tokens", "trained_tokens", str), ("mean reward", "mean_reward", lambda v: f"{v:.4f}"),
    ("truncated", "truncated", str),
]
