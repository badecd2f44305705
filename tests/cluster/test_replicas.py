"""``provision(replicas=...)`` on a single server: R1 is kept, more replicas than nodes is a clear refusal."""

import time

import msgspec
import pytest

from schemas.errors import ProvisionError
from stack.provision import provision


async def test_replicas_one_is_applied_and_none_leaves_them_as_they_are(js, log_config):
    await provision(js, log_config, replicas=1)
    await provision(js, log_config)  # a component without --replicas: nothing changes
    for name in (log_config.stream, log_config.ready_stream, f"KV_{log_config.markers_bucket}",
                 f"OBJ_{log_config.pieces_bucket}"):
        assert (await js.stream_info(name)).config.num_replicas == 1, name


async def test_more_replicas_than_the_server_has_nodes_is_refused_in_one_line(nc, log_config):
    fresh = msgspec.structs.replace(log_config, stream=log_config.stream + "X", prefix=log_config.prefix + "x")
    started = time.monotonic()
    with pytest.raises(ProvisionError) as refused:
        await provision(nc.jetstream(), fresh, replicas=3, timeout_s=3)
    assert time.monotonic() - started < 10
    assert fresh.stream in str(refused.value) and "\n" not in str(refused.value)
