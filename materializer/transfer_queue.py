"""The TransferQueue sink: verl's data plane, through the real ``transfer_queue`` package and Ray.

TransferQueue keeps its data in memory, in Ray actors (a controller and storage units)
owned by the process that called ``tq.init()`` first. :class:`TransferQueueConnection`
either

- **joins** a Ray cluster whose TransferQueue someone else owns (``--ray-address``: in
  training, verl's trainer; in the chaos test, the test process): the materializer is
  then only a client, and a killed, restarted materializer reconnects to the same data; or
- **hosts** one (no address): it starts a local Ray (with ``num_cpus`` >= storage units
  + 1, or ``tq.init()`` waits forever for CPUs) and owns TransferQueue, which lives as long
  as the process does (``rollbus up --transfer-queue``).

Writes use TransferQueue's async API on the materializer's own event loop (as verl's agent
loop workers do), each bounded by ``timeout``; any failure of TransferQueue, Ray or ZMQ
becomes :class:`SinkUnavailable` here, and the batch is retried.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from typing import Any, TypeVar

# Read when Ray is imported: keep a Ray node this process starts on the loopback interface, and keep
# Ray's crash handler from turning the SIGTERM that stops rollbus into a crash dump and an abort.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray
import transfer_queue as tq
import zmq
from ray.exceptions import RayError
from tensordict import TensorDict

from materializer.tq_fields import grouped, prompt_tag
from schemas.errors import SinkUnavailable
from schemas.records import TrajectoryRecord

log = logging.getLogger(__name__)
# TransferQueue warns on every put of a 2-core machine that it uses fewer threads than it would like.
logging.getLogger("transfer_queue.utils.common").setLevel(logging.ERROR)

T = TypeVar("T")

# ray.init's logging for this process: its driver-side log lines below ERROR ("Started a local Ray instance",
# the SIGTERM handler a thread cannot set, token authentication's notice) are noise to a rollbus user, and
# the workers' output is not forwarded (log_to_driver=False); errors still show.
RAY_QUIET: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}

# For a Ray instance rollbus starts itself: its workers (TransferQueue's controller and storage units,
# verl's tasks) at the priority of the process that starts them. Ray's default niceness for workers is
# 15, so on a busy machine they get a few percent of a core: beside two busy processes on 2 cores a
# TransferQueue put waited minutes and tests starting Ray ran out their 300 s (each passes in about
# 60 s at niceness 0, the same load beside it).
RAY_HOSTED: dict[str, Any] = {"_system_config": {"worker_niceness": 0}}

# transfer_queue registers its controller under this name (see ``transfer_queue.interface.init``).
CONTROLLER_ACTOR = ("TransferQueueController", "transfer_queue")
_FAILURES = (ValueError, RuntimeError, KeyError, OSError, RayError, zmq.ZMQError)


class TransferQueueConnection:
    """Ray and TransferQueue for this process, joined or hosted (see the module docstring)."""

    def __init__(self, address: str | None = None, *, storage_units: int = 2) -> None:
        self.address = address
        self.storage_units = storage_units
        self._owns_ray = False
        self._owns_tq = False

    def open(self) -> None:
        """Blocking (seconds when hosting); call from a thread."""
        try:
            if not ray.is_initialized():
                self._init_ray()
            if self.address is not None and not _controller_exists():
                raise SinkUnavailable(f"no TransferQueue in the Ray cluster at {self.address}: start it first "
                                      "(verl's trainer calls tq.init()), or run without --ray-address to host one")
            self._owns_tq = self._owns_ray and not _controller_exists()
            tq.init(_config(self.storage_units) if self._owns_tq else None)
        except _FAILURES as exc:
            raise SinkUnavailable(f"cannot reach TransferQueue: {exc!r}") from exc

    def _init_ray(self) -> None:
        if self.address is not None:
            ray.init(address=self.address, namespace="rollbus", **RAY_QUIET)
            return
        cpus = max(self.storage_units + 1, os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, namespace="rollbus", _node_ip_address="127.0.0.1",
                 **RAY_QUIET, **RAY_HOSTED)
        self._owns_ray = True

    def close(self) -> None:
        if self._owns_tq:
            tq.close()
        if self._owns_ray:
            ray.shutdown()


def _controller_exists() -> bool:
    try:
        ray.get_actor(CONTROLLER_ACTOR[0], namespace=CONTROLLER_ACTOR[1])
    except ValueError:
        return False
    return True


def _config(storage_units: int) -> dict[str, Any]:
    return {"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": storage_units}}}


class TransferQueueSink:
    """Puts and reads of one TransferQueue; every call takes a ``partition`` (None: the sink's own, the
    ``--tq-partition``), since a session's metadata may name another (``tq_partition``: verl's ``val``)."""

    name = "transfer_queue"

    def __init__(self, partition: str = "train", *, timeout: float = 60.0) -> None:
        self.partition = partition
        self.timeout = timeout

    async def _call(self, call: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(call, self.timeout)
        except TimeoutError as exc:
            raise SinkUnavailable(f"TransferQueue {what}: no answer within {self.timeout}s") from exc
        except _FAILURES as exc:
            raise SinkUnavailable(f"TransferQueue {what} failed: {exc!r}") from exc

    async def put_records(self, records: list[TrajectoryRecord], partition: str | None = None) -> None:
        """Trajectory keys with their fields and tags: one put per field set (usually one)."""
        partition = partition or self.partition
        for keys, fields, tags in grouped(records):
            await self._call(tq.async_kv_batch_put(keys=keys, partition_id=partition, fields=fields,
                                                   tags=tags), "put")

    async def put_prompt_statuses(self, statuses: dict[str, tuple[str, int]], partition: str | None = None) -> None:
        """``uid -> (status, global_steps)``: the prompt keys' tags, in one put (tags merge into existing ones).
        The one writer of prompt statuses: the materializer's, the adapter's ``running``, the CLI's ``pending``
        (:func:`tag_prompts`)."""
        if not statuses:
            return
        uids = list(statuses)
        tags = [prompt_tag(*statuses[uid]) for uid in uids]
        await self._call(tq.async_kv_batch_put(keys=uids, partition_id=partition or self.partition, tags=tags),
                         "prompt status put")


    async def listing(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """Every key of the partition and its tags."""
        partition = partition or self.partition
        listed = await self._call(tq.async_kv_list(partition_id=partition), "list")
        return dict((listed or {}).get(partition, {}))

    async def clear(self, keys: list[str], partition: str | None = None) -> None:
        """Remove keys and their data (keys that are not there are no error)."""
        if keys:
            await self._call(tq.async_kv_clear(keys=keys, partition_id=partition or self.partition), "clear")

    async def get(self, keys: list[str], fields: list[str] | None = None, partition: str | None = None) -> TensorDict:
        return await self._call(tq.async_kv_batch_get(keys=keys, partition_id=partition or self.partition,
                                                      select_fields=fields), "get")


def tag_prompts(statuses: dict[str, tuple[str, int]], partition: str) -> None:
    """:meth:`TransferQueueSink.put_prompt_statuses` for a caller without an event loop, through TransferQueue's
    synchronous API (``rollbus rollout`` tags its prompts ``pending``, as verl's trainer does before
    ``generate_sequences``)."""
    uids = list(statuses)
    try:
        tq.kv_batch_put(keys=uids, partition_id=partition, tags=[prompt_tag(*statuses[uid]) for uid in uids])
    except _FAILURES as exc:
        raise SinkUnavailable(f"TransferQueue prompt status put failed: {exc!r}") from exc
