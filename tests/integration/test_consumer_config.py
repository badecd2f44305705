"""A durable consumer runs with the configuration of the process that consumes, not the one it was
created with: a stack killed while it held messages under a long ``ack_wait`` (or an ``--ack-wait``
changed between runs) must not leave the next process waiting that long for them."""

from __future__ import annotations

import asyncio
import time

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from eventlog.consumer import JetStreamConsumers, consume_batches


async def test_messages_held_by_a_dead_consumer_come_back_by_the_new_ack_wait(js, log_config):
    subject = log_config.ready_subject("a" * 32)
    for i in range(5):
        await js.publish(subject, str(i).encode(), stream=log_config.ready_stream)
    held = ConsumerConfig(durable_name="d", ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                          ack_wait=3600, filter_subject=log_config.ready_subjects, max_ack_pending=256)
    dead = await js.pull_subscribe(log_config.ready_subjects, durable="d", stream=log_config.ready_stream,
                                   config=held)
    assert len(await dead.fetch(5, timeout=5)) == 5  # delivered, never acknowledged: its process died
    await dead.unsubscribe()

    got: list[bytes] = []
    stop = asyncio.Event()

    async def handler(msgs):
        got.extend(m.data for m in msgs)
        if len(got) >= 5:
            stop.set()
        return []

    started = time.monotonic()
    await asyncio.wait_for(consume_batches(JetStreamConsumers(js), stream=log_config.ready_stream, durable="d",
                                           subject=log_config.ready_subjects, handler=handler, stop=stop,
                                           max_delay=0.1, ack_wait=1.0), 60)
    assert sorted(got) == [str(i).encode() for i in range(5)]
    assert time.monotonic() - started < 30
    assert (await js.consumer_info(log_config.ready_stream, "d")).config.ack_wait == 1.0
