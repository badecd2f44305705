"""A Ray cluster with TransferQueue, hosted by the test process for the whole session.

Like verl's trainer, the test process owns TransferQueue (its controller and storage
actors); materializers join it, in process or as subprocesses that may be SIGKILLed and
restarted without losing what was written. Each test uses its own partition.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from materializer.transfer_queue import RAY_HOSTED  # imports Ray the way the sink does (on loopback)

STORAGE_UNITS = 2


@pytest.fixture(scope="session")
def tq_cluster() -> Iterator[str]:
    """The Ray address of the cluster (for ``--ray-address``)."""
    import ray
    import transfer_queue as tq

    # TransferQueue's storage units each hold a CPU: with fewer, tq.init() waits forever.
    ray.init(num_cpus=STORAGE_UNITS + 2, include_dashboard=False, log_to_driver=False, namespace="rollbus-test",
             _node_ip_address="127.0.0.1", **RAY_HOSTED)
    try:
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": STORAGE_UNITS}}})
        yield ray.get_runtime_context().gcs_address
    finally:
        tq.close()
        ray.shutdown()


@pytest.fixture
def partition(tq_cluster: str) -> str:
    return f"p{secrets.token_hex(4)}"
