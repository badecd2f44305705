"""What the adapter runs: NATS, the edge pool and the consumers as Ray actors, runner workers.

- **NATS**: the configured ``nats_url``, else an embedded nats-server in ``<data_dir>/nats``
  (on 127.0.0.1: a single-node Ray cluster; give ``nats_url`` on more nodes).
- **TransferQueue**: verl's trainer has called ``tq.init`` (this process joins it); without a
  trainer (``rollbus rollout``) the adapter hosts Ray and TransferQueue itself.
- **Edges**: ``gateway_count`` :class:`~agent_framework.actors.StackActor` s with the edge
  component, each on its own port, calling verl's ``llm_client`` (or the configured engine).
- **Consumers**: one actor with the projector and the materializer, writing TransferQueue
  (the partition each session names) and Parquet under ``<data_dir>/trajectories``.
- **Runner workers**: ``num_workers`` :class:`~agent_framework.actors.RunnerWorker` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from pathlib import Path
from typing import Any

from agent_framework.actors import RunnerWorker, StackActor
from agent_framework.config import AgentFrameworkConfig
from agent_framework.export import write_session
from agent_framework.samples import Prompt
from eventlog.kv import KvStore
from eventlog.reader import read_session
from materializer.ledger import PromptLedger
from materializer.prompts import TERMINAL, PromptProgress
from materializer.records import RecordOptions
from materializer.service import MaterializerOptions
from schemas.errors import ConfigError, RollbusError, SinkUnavailable
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from stack.runtime import StackOptions

log = logging.getLogger(__name__)


class FrameworkStack:
    def __init__(self, config: AgentFrameworkConfig, *, llm_client: Any = None,
                 reward_workers: Any = None) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir).expanduser().resolve()
        self.log_dir = Path(config.log_dir).expanduser().resolve() if config.log_dir else None
        self.log = LogConfig.namespaced(config.log_namespace) if config.log_namespace else LogConfig()
        self._llm_client = llm_client
        self._reward_workers = list(reward_workers or [])
        self._nats: EmbeddedNats | None = None
        self._nc: Any = None
        self._tq: Any = None  # a TransferQueueConnection this process hosts (standalone)
        self._edges: list[Any] = []
        self._consumers: Any = None
        self._ledger: PromptLedger | None = None
        self.runner_workers: list[Any] = []

    @property
    def nats_url(self) -> str:
        return self.config.nats_url or (self._nats.url if self._nats is not None else "")

    async def start(self, *, admin_token: str) -> list[str]:
        """Start everything; returns the edges' URLs."""
        import ray

        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.config.nats_url is None:
            self._nats = await asyncio.to_thread(EmbeddedNats(self.data_dir / "nats", name="rollbus-af").start)
        self._nc = await connect(self.nats_url, name="rollbus-agent-framework")
        await provision(self._nc.jetstream(), self.log)
        await asyncio.to_thread(self._join_transfer_queue)
        actor = ray.remote(StackActor)
        self._consumers = actor.options(num_cpus=0).remote(self._options(("projector", "materializer"), admin_token),
                                                             None, self._reward_workers)
        self._edges = [actor.options(num_cpus=self.config.actor_num_cpus).remote(
            self._options(("edge",), admin_token, edge_id=f"af-{i}-{secrets.token_hex(3)}"), self._llm_client)
            for i in range(self.config.gateway_count)]
        urls = await asyncio.gather(*(edge.start.remote() for edge in self._edges), self._consumers.start.remote())
        worker = ray.remote(RunnerWorker)
        self.runner_workers = [worker.options(num_cpus=self.config.actor_num_cpus, max_concurrency=100_000).remote()
                               for _ in range(self.config.num_workers)]
        return list(urls[:-1])

    def _join_transfer_queue(self) -> None:
        import ray

        from materializer.transfer_queue import TransferQueueConnection, _controller_exists

        if not ray.is_initialized():  # no trainer: host Ray and TransferQueue here (one storage unit)
            self._tq = TransferQueueConnection(None, storage_units=1)
            self._tq.open()
            return
        if not _controller_exists():
            raise ConfigError("Ray is running without TransferQueue: call tq.init(config.transfer_queue) first "
                              "(verl's trainer does)")
        import transfer_queue as tq

        tq.init()

    def _options(self, components: tuple[str, ...], admin_token: str, *, edge_id: str = "") -> StackOptions:
        c = self.config
        materializer = MaterializerOptions(
            records=RecordOptions(mask_unfinished_episode=c.mask_unfinished_episode), transfer_queue=True,
            tq_partition="train", tq_storage_units=1)
        return StackOptions(
            host="127.0.0.1", port=0, data_dir=self.data_dir, nats_url=self.nats_url, engine=c.engine,
            engine_urls=c.engine_urls, model=c.engine_model, tokenizer=c.tokenizer, tool_format=c.tool_format,
            admin_token=admin_token, max_trajectory_length=c.max_trajectory_length, components=components,
            log=self.log, edge_id=edge_id, idle_timeout_s=max(3600.0, 2 * c.session_timeout),
            rollback_rewritten_turns=c.enable_last_assistant_rollback, materializer=materializer,
            processor=c.processor or "")

    async def stop(self) -> None:
        import ray

        for handle in [*self._edges, self._consumers]:
            if handle is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(handle.stop.remote(), 30)
                with contextlib.suppress(Exception):
                    ray.kill(handle)
        for worker in self.runner_workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), 5)
        if self._nats is not None:
            await asyncio.to_thread(self._nats.stop)
        if self._tq is not None:
            await asyncio.to_thread(self._tq.close)

    # ------------------------------------------------------------------ TransferQueue

    async def start_attempt(self, prompt: Prompt, *, attempt: int, n: int) -> None:
        """Before any session of a (re-)dispatched prompt opens: its new attempt in the materializer's
        ledger, so a late session of an earlier attempt stays out of TransferQueue; then the prompt key
        ``{uid}`` tagged ``running`` (verl tagged it ``pending``)."""
        from materializer.transfer_queue import TransferQueueSink  # (loads Ray and TransferQueue)

        try:
            if self._ledger is None:
                prompts = KvStore(self._nc.jetstream(), self.log.prompts_bucket, timeout=10.0)
                self._ledger = await PromptLedger(prompts).bind()
            await self._ledger.start_attempt(PromptProgress(
                uid=prompt.uid, expected=n, global_steps=prompt.global_steps, attempt=attempt,
                rule=self.config.prompt_status_rule, partition=prompt.partition))
        except RollbusError as exc:  # the materializer still starts the attempt at its first session
            log.error("prompt %s: recording attempt %d failed: %s", prompt.uid, attempt, exc)
        try:
            await TransferQueueSink(prompt.partition).put_prompt_statuses(
                {prompt.uid: ("running", prompt.global_steps)})
        except SinkUnavailable as exc:  # the materializer tags it running again
            log.error("prompt %s: tagging it running failed: %s", prompt.uid, exc)

    async def wait_terminal(self, prompts: list[Prompt], *, poll: float = 0.2) -> None:
        """Until every prompt's key has a terminal status, or is gone after it was seen (a trainer took it)."""
        import transfer_queue as tq

        waiting = {(p.partition, p.uid) for p in prompts}
        seen: set[tuple[str, str]] = set()
        while waiting:
            for partition in {part for part, _ in waiting}:
                listed = (await tq.async_kv_list(partition_id=partition) or {}).get(partition, {})
                for key in [k for k in waiting if k[0] == partition]:
                    tag = listed.get(key[1])
                    if tag is not None:
                        seen.add(key)
                    if (tag is not None and tag.get("status") in TERMINAL) or (tag is None and key in seen):
                        waiting.discard(key)
            if waiting:
                await asyncio.sleep(poll)

    # ------------------------------------------------------------------ log_dir

    async def export(self, session_id: str, global_steps: int) -> None:
        if self.log_dir is None:
            return
        try:
            session_log = await read_session(self._nc.jetstream(), self.log, session_id)
            await asyncio.to_thread(write_session, self.log_dir / f"step_{global_steps}", session_id,
                                    session_log.events)
        except Exception as exc:  # an export is for people; it never fails a rollout
            log.warning("session %s: exporting it to %s failed: %r", session_id, self.config.log_dir, exc)
