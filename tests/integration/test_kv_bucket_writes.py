"""``eventlog.kv.bucket_writes`` reads a bucket's writes by stream sequence on a real nats-server: each write once,
in order, a delete as None, onwards from where the last read ended (what ``wait_marked`` polls)."""

from __future__ import annotations

from nats.js.client import JetStreamContext

from eventlog.kv import KvStore, bucket_writes
from schemas.log import LogConfig


async def test_writes_are_read_once_each_in_order_from_where_the_last_read_ended(js: JetStreamContext,
                                                                                  log_config: LogConfig) -> None:
    bucket = log_config.markers_bucket
    kv = await KvStore(js, bucket).bind()
    start = (await js.stream_info(f"KV_{bucket}")).state.last_seq
    for i in range(5):
        await kv.put(f"s{i}", f"v{i}".encode())
    writes, upto = await bucket_writes(js, bucket, start, batch=2)  # batches smaller than what is there
    assert writes == [(f"s{i}", f"v{i}".encode()) for i in range(5)] and upto == start + 5

    assert await bucket_writes(js, bucket, upto) == ([], upto)  # nothing new: nothing read
    await kv.delete("s1")
    await kv.put("s5", b"v5")
    assert await bucket_writes(js, bucket, upto) == ([("s1", None), ("s5", b"v5")], upto + 2)
