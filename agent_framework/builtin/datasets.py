"""The shipped example datasets, as rows ``run_task`` takes, and as a prompts Parquet file.

A row::

    {"raw_prompt": [{"role": "user", "content": "..."}],
     "tools_kwargs": {"task": "arithmetic", "answer": 84},
     "data_source": "rollbus/arithmetic", "uid": "arithmetic-000", "index": 0}

(``agent_name`` too, when one is given: it picks the framework's agent runner.)

The Parquet layout :func:`write_parquet` writes (what ``rollbus rollout --data`` reads),
one row per prompt, schema :data:`ROW_SCHEMA`:

- ``raw_prompt``: ``list<struct<role: string, content: string>>``, the chat messages;
- ``tools_kwargs``: ``string``, the row's tools_kwargs as JSON (its shape differs from
  task to task, so it is not a struct);
- ``data_source``: ``string``, ``rollbus/<task>``;
- ``uid``: ``string``, ``<task>-<nnn>`` (``_`` in the task name as ``-``: training keys
  use ``_`` as their separator);
- ``index``: ``int64``, the row's number within its task;
- ``agent_name``: ``string``, only when every row has one (it picks the agent runner).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from agent_framework.builtin.tasks.base import TASKS

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
ROW_SCHEMA = pa.schema([("raw_prompt", pa.list_(MESSAGE)), ("tools_kwargs", pa.string()),
                        ("data_source", pa.string()), ("uid", pa.string()), ("index", pa.int64())])
AGENT_NAME = pa.field("agent_name", pa.string())
EXAMPLE_TASKS = ("arithmetic", "python_function")


def records(task_name: str) -> list[dict[str, Any]]:
    """The task's shipped JSONL records, as they are in the file."""
    task = TASKS.get(task_name)
    if not task.dataset:
        raise ValueError(f"task {task_name!r} ships no example dataset")
    text = resources.files("agent_framework.builtin.data").joinpath(task.dataset).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def example_rows(task_name: str, *, agent_name: str | None = None) -> list[dict[str, Any]]:
    """The task's shipped examples as dataset rows (see the module docstring)."""
    task = TASKS.get(task_name)
    rows = []
    for index, record in enumerate(records(task_name)):
        prompt, tools_kwargs = task.example(record)
        uid = f"{task_name.replace('_', '-')}-{index:03d}"
        row: dict[str, Any] = {"raw_prompt": [{"role": "user", "content": prompt}], "tools_kwargs": tools_kwargs,
                               "data_source": f"rollbus/{task_name}", "uid": uid, "index": index}
        if agent_name is not None:
            row["agent_name"] = agent_name
        rows.append(row)
    return rows


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Rows as a prompts Parquet file with :data:`ROW_SCHEMA` (plus ``agent_name`` when every row has one)."""
    with_agent = bool(rows) and all("agent_name" in row for row in rows)
    schema = ROW_SCHEMA.append(AGENT_NAME) if with_agent else ROW_SCHEMA
    columns = {name: [_cell(name, row) for row in rows] for name in schema.names}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(columns, schema=schema), target)
    return target


def write_examples(path: str | Path, tasks: Iterable[str] = EXAMPLE_TASKS, *, agent_name: str | None = None) -> Path:
    """Every shipped example of ``tasks`` in one prompts Parquet file."""
    rows = [row for name in tasks for row in example_rows(name, agent_name=agent_name)]
    return write_parquet(rows, path)


def _cell(name: str, row: Mapping[str, Any]) -> Any:
    value = row.get(name)
    if name == "tools_kwargs" and not isinstance(value, str):
        return json.dumps(value or {})
    if name == "raw_prompt":
        return [{"role": m["role"], "content": m["content"]} for m in value or ()]
    return value
