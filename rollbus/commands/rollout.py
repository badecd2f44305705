"""``rollbus rollout``: the verl adapter over a prompts dataset, without a trainer.

::

    rollbus rollout [--config CFG.yaml] --data PROMPTS.parquet|builtin:TASK[,TASK]
                    [--batch-size 64] [--limit N] [--validate] [--global-steps S]
                    [--data-dir DIR] [--ray-address ADDR]
    rollbus rollout --eval-url URL --data ...   the runner against any OpenAI-compatible URL (no records)

The config is verl's (``actor_rollout_ref.rollout.custom.agent_framework``, see
:mod:`agent_framework.config`); without ``--config`` the built-in one runs ``run_task`` on
the local CPU engine. Each dataset row is a prompt (``raw_prompt``, ``tools_kwargs`` as JSON
or a struct, optional ``agent_name``, ``data_source``, ``reward_model``, ``extra_info``,
``index``); each gets a fresh uid, as verl's dataloader gives it, and ``rollout.n`` sessions.
The records land in Parquet under ``<data-dir>/trajectories/`` and in TransferQueue (the
one this process hosts, or the Ray cluster's at ``--ray-address``). A progress bar (plain
lines when not on a terminal), then a summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollbus.progress import Progress
from schemas.errors import ConfigError, RunnerLoadError

if TYPE_CHECKING:
    from agent_framework.config import AgentFrameworkConfig

DEFAULT_CONFIG = "builtin"


def register(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Flags and defaults of the commands this module runs, on the parsers the CLI made for them."""
    parser = parsers["rollout"]
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="verl-style YAML (actor_rollout_ref.rollout.custom.agent_framework ...) [built-in: "
                             "run_task on the local engine]")
    parser.add_argument("--data", required=True, metavar="PROMPTS.parquet|builtin:TASK[,TASK]",
                        help="prompts: a Parquet file, or the shipped examples of built-in tasks")
    parser.add_argument("--data-dir", type=Path, default=None, help="NATS store and Parquet records [config's]")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generate_sequences call [64]")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--validate", action="store_true", help="a validation batch (val_kwargs, partition val)")
    parser.add_argument("--global-steps", type=int, default=0, metavar="S",
                        help="the trainer step recorded in each session's metadata [0]")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster's TransferQueue [host one]")
    parser.add_argument("--eval-url", default=None, metavar="URL",
                        help="run the runner against this OpenAI-compatible URL instead of sessions (no records)")
    parser.add_argument("--eval-api-key", default="EMPTY", metavar="KEY",
                        help="the API key sent to --eval-url [EMPTY]")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a batch may take [no limit]")
    parser.add_argument("--log-level", default="WARNING", metavar="LEVEL",
                        help="Python logging level: DEBUG, INFO, WARNING, ERROR [WARNING]")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from agent_framework.config import load_config

    try:
        settings = load_config(_config(args))
        rows = _rows(args.data, args.limit)
        for name, value in (("--batch-size", args.batch_size), ("--limit", args.limit or 1)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1")
    except (ConfigError, OSError, ValueError) as exc:
        print(f"rollbus rollout: {exc}", file=sys.stderr)
        return 2
    if args.eval_url:
        return _evaluate(args, settings, rows)
    return _rollout(args, settings, rows)


# ---------------------------------------------------------------------- inputs


def _config(args: argparse.Namespace) -> Any:
    from omegaconf import OmegaConf

    if args.config == DEFAULT_CONFIG:
        from importlib import resources

        text = resources.files("agent_framework.builtin.data").joinpath("rollout.yaml").read_text()
        config = OmegaConf.create(text)
    else:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            config = OmegaConf.load(path)
        except Exception as exc:  # OmegaConf's and YAML's many errors: the file is not usable
            raise ConfigError(f"--config {path}: {exc}") from exc
    if args.data_dir is not None:
        OmegaConf.update(config, "actor_rollout_ref.rollout.custom.agent_framework.data_dir", str(args.data_dir),
                         force_add=True)
    return config


def _rows(data: str, limit: int | None) -> list[dict[str, Any]]:
    if data.startswith("builtin:"):
        from agent_framework.builtin import example_rows

        rows = [row for name in data.removeprefix("builtin:").split(",") for row in example_rows(name.strip())]
    else:
        import pyarrow.parquet as pq

        path = Path(data)
        if not path.exists():
            raise ValueError(f"--data {path}: no such file")
        rows = pq.read_table(path).to_pylist()
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"--data {data}: no prompts")
    return [_prompt_row(i, row) for i, row in enumerate(rows)]


def _prompt_row(i: int, row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row as a batch row: a fresh uid, decoded JSON columns, the dataset's index kept."""
    out = dict(row)
    for name in ("raw_prompt", "tools_kwargs", "reward_model", "extra_info"):
        if isinstance(out.get(name), str):
            try:
                out[name] = json.loads(out[name])
            except ValueError as exc:
                raise ValueError(f"--data row {i}: {name} is not JSON: {exc}") from exc
    if not isinstance(out.get("raw_prompt"), list):
        raise ValueError(f"--data row {i}: no raw_prompt (a list of chat messages)")
    out.pop("uid", None)
    out["uid"] = str(uuid.uuid4())
    out.setdefault("index", i)
    out["tools_kwargs"] = out.get("tools_kwargs") or {}
    return out


def _batches(rows: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    for start in range(0, len(rows), size):
        yield rows[start:start + size]


def to_batch(rows: list[dict[str, Any]], *, global_steps: int, validate: bool) -> Any:
    """Rows as the TensorDict verl hands ``generate_sequences``."""
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    columns: dict[str, Any] = {}
    for name in dict.fromkeys(k for row in rows for k in row):
        values = [row.get(name) for row in rows]
        if name == "index":
            columns[name] = torch.tensor([int(v) for v in values])
        else:
            columns[name] = NonTensorStack.from_list(values)
    batch = TensorDict(columns, batch_size=[len(rows)])
    batch["global_steps"] = NonTensorData(global_steps)
    if validate:
        batch["validate"] = NonTensorData(True)
    return batch


# ---------------------------------------------------------------------- rollouts


def _rollout(args: argparse.Namespace, settings: AgentFrameworkConfig, rows: list[dict[str, Any]]) -> int:
    from agent_framework import AgentFrameworkRolloutAdapter

    _join_ray(args.ray_address)
    started = time.monotonic()
    adapter = AgentFrameworkRolloutAdapter(settings)
    try:
        try:
            adapter.start()
        except (RunnerLoadError, ConfigError) as exc:
            print(f"rollbus rollout: {exc}", file=sys.stderr)
            return 2
        print(f"rollbus rollout: {len(rows)} prompts x n={settings.val.n if args.validate else settings.train.n}; "
              f"edges {' '.join(adapter.edge_urls)}; records in {Path(settings.data_dir).resolve() / 'trajectories'}",
              file=sys.stderr, flush=True)
        results = []
        with _progress(len(rows) * (settings.val.n if args.validate else settings.train.n)) as progress:
            for chunk in _batches(rows, args.batch_size):
                batch = to_batch(chunk, global_steps=args.global_steps, validate=args.validate)
                partition = "val" if args.validate else "train"
                _tag_pending([r["uid"] for r in chunk], partition, args.global_steps)
                future = adapter.submit(batch)
                while not future.done():
                    progress.update(adapter.metrics["sessions_ended"],
                                    detail=f"{adapter.metrics['sessions_failed']} failed")
                    time.sleep(0.2)
                results.append(future.result(args.timeout))
                adapter.wait_records(batch, args.timeout)
                progress.update(adapter.metrics["sessions_ended"],
                                detail=f"{adapter.metrics['sessions_failed']} failed")
    finally:
        adapter.close()
    _summary(results, rows, Path(settings.data_dir).resolve() / "trajectories", time.monotonic() - started)
    return 0 if any(r.succeeded for r in results) else 1


def _join_ray(address: str | None) -> None:
    if address is None:
        return  # the adapter hosts Ray and TransferQueue itself
    import ray
    import transfer_queue as tq

    from materializer.transfer_queue import RAY_QUIET  # (and Ray on loopback, as the sink sets it up)

    ray.init(address=address, namespace="rollbus", **RAY_QUIET)
    tq.init()


def _tag_pending(uids: list[str], partition: str, global_steps: int) -> None:
    """What verl's trainer does before generate_sequences."""
    from materializer.transfer_queue import tag_prompts

    tag_prompts({uid: ("pending", global_steps) for uid in uids}, partition)


def _progress(total: int) -> Progress:
    """Sessions ended so far (its detail: how many failed): a bar on a terminal, otherwise a plain line every
    few seconds and at the end."""
    shown = Progress("rollouts", unit="sessions", total=total,
                     line=lambda: f"rollouts: {shown.done}/{total} sessions ended ({shown.detail or '0 failed'})")
    return shown


def _summary(results: list[Any], rows: list[dict[str, Any]], records: Path, seconds: float) -> None:
    sessions = [s for r in results for s in r.sessions]
    rewards = _rewards(records, {row["uid"] for row in rows})
    by_uid: dict[str, list[Any]] = {}
    for s in sessions:
        by_uid.setdefault(s.uid, []).append(s)
    print(f"{'prompt':<38} {'index':>5} {'ok':>3} {'failed':>6} {'reward':>7}  error")
    print("-" * 80)
    for row in rows:
        group = by_uid.get(row["uid"], [])
        ok = sum(s.succeeded for s in group)
        got = rewards.get(row["uid"], [])
        mean = f"{sum(got) / len(got):.2f}" if got else "-"
        error = next((s.error for s in group if s.error), "")
        print(f"{row['uid']:<38} {row['index']:>5} {ok:>3} {len(group) - ok:>6} {mean:>7}  {error[:60]}")
    ok = sum(s.succeeded for s in sessions)
    print(f"{len(rows)} prompts, {len(sessions)} sessions: {ok} succeeded, {len(sessions) - ok} failed in "
          f"{seconds:.1f}s ({len(sessions) / seconds:.2f} rollouts/s); {sum(map(len, rewards.values()))} "
          f"trajectories in {records}/")


def _rewards(records: Path, uids: set[str]) -> dict[str, list[float]]:
    """Each prompt's trajectory rewards, from the Parquet records."""
    import pyarrow.dataset as ds

    if not records.exists():
        return {}
    table = ds.dataset(records).to_table(columns=["uid", "reward"], filter=ds.field("uid").isin(sorted(uids)))
    out: dict[str, list[float]] = {}
    for uid, reward in zip(table["uid"].to_pylist(), table["reward"].to_pylist(), strict=True):
        out.setdefault(uid, []).append(reward)
    return out


# ---------------------------------------------------------------------- evaluation


def _evaluate(args: argparse.Namespace, settings: AgentFrameworkConfig, rows: list[dict[str, Any]]) -> int:
    """The runner against an external OpenAI-compatible URL: no sessions, no records, rewards printed."""
    from agent_framework import SessionHandle
    from agent_framework.dispatch import load_runner

    async def one(row: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        runner = settings.runner_for(row.get("agent_name"))
        handle = SessionHandle.external(args.eval_url, args.eval_api_key, session_id=row["uid"].replace("-", ""))
        try:
            return row, await load_runner(runner)(session=handle, raw_prompt=row["raw_prompt"], sample_index=0,
                                                  tools_kwargs=row["tools_kwargs"])
        except Exception as exc:  # one prompt's failure is reported in its line
            return row, exc

    async def main() -> list[tuple[dict[str, Any], Any]]:
        return list(await asyncio.gather(*(one(row) for row in rows)))

    results = asyncio.run(main())
    print(f"{'index':>5} {'reward':>7}  answer")
    for row, result in results:
        if isinstance(result, Exception):
            print(f"{row['index']:>5} {'-':>7}  error: {type(result).__name__}: {result}")
        else:
            reward = result.get("reward") if isinstance(result, dict) else None
            print(f"{row['index']:>5} {reward if reward is not None else '-':>7}  "
                  f"{str(result.get('answer', ''))[:60] if isinstance(result, dict) else ''}")
    scored = [r.get("reward") for _, r in results if isinstance(r, dict) and r.get("reward") is not None]
    print(f"{len(rows)} prompts evaluated against {args.eval_url}: mean reward "
          f"{sum(scored) / len(scored):.3f}" if scored else f"{len(rows)} prompts: no rewards")
    return 0 if scored else 1
