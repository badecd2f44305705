"""Materializer sink throughput against TransferQueue's own bulk put, in the same run.

Builds R trajectory records from synthetic agent sessions (folded from events, as the
materializer derives them: a ~600-token prompt, then turns of a ~60-token tool result and
~250 sampled tokens with log probs), then measures, alternating, best of ``--repeat``:

- **baseline**: TransferQueue's ``kv_batch_put`` of all R records at once, fields already
  built as a TensorDict (the cost of TransferQueue alone);
- **sink**: :class:`TransferQueueSink` as the materializer drives it, from records: per
  batch of ``--batch`` sessions the prompt keys registered (``running``), the trajectory
  fields built and put, the terminal prompt statuses put;
- **parquet**: :class:`ParquetSink` staging and committing the same records per batch
  (unpadded, and padded to fixed lengths).

Baseline and sink alternate (in swapped order every other round, each into a fresh
partition), so a busy machine slows both alike; prints records/s (best and median) and the
ratio sink / baseline of the bests (target >= 0.8) and of the medians. Most of what the sink
pays beyond the baseline is TransferQueue's fixed cost per call (controller round trips,
per-field work), paid per materializer batch: one trajectory put and two prompt-status puts
where the baseline makes one put for all records, so the ratio rises with the batch size. It
is reported for the materializer's default batch size (``rollbus materializer --batch-size``)
and for 256.

The process is set up as a rollbus process runs: the sink's puts are awaited on one
long-lived event loop (the materializer's), and once setup is done the heap is settled
(:func:`stack.heap.settle_heap`, as ``rollbus`` does once started). Each timed section
starts after a collection, so none pays for the garbage another left (the baseline's
TensorDict is built untimed, and a full collection of the unsettled heap took ~0.25 s).

    python ops/bench/materializer_throughput.py [--records 1024] [--batches DEFAULT,256] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from materializer.padding import Padding
from materializer.parquet import ParquetSink
from materializer.records import derive_records
from materializer.service import MaterializerOptions
from materializer.tq_fields import fields_of, to_tensordict
from materializer.transfer_queue import TransferQueueConnection, TransferQueueSink, tq
from schemas.records import MaterializedMarker, TrajectoryRecord
from session.fold import fold
from stack.heap import settle_heap
from tests.helpers import SessionScript

PROMPT, CONTEXT, SAMPLED = 600, 60, 250


def build_records(count: int, turns: int) -> list[TrajectoryRecord]:
    rng = random.Random(0)
    records = []
    for i in range(count):
        script = SessionScript(session_id=f"{i:032x}", uid=f"b{i // 4}", session_index=i % 4,
                               metadata={"global_steps": 1, "rollout_n": 4})
        for turn in range(turns):
            context = [rng.randrange(151643) for _ in range(PROMPT if turn == 0 else CONTEXT)]
            sampled = [rng.randrange(151643) for _ in range(SAMPLED)]
            script.turn(0, context, sampled, new_chain=turn == 0, logprobs=[-rng.random() for _ in sampled],
                        n_messages=2 + 2 * turn, tip=f"t{turn}")
        script.reward(1.0, acc=1.0)
        script.finalize()
        records += derive_records(fold(script.events))
    return records


def batches(records: list[TrajectoryRecord], size: int) -> list[list[TrajectoryRecord]]:
    return [records[i:i + size] for i in range(0, len(records), size)]


def baseline(records: list[TrajectoryRecord], partition: str) -> float:
    fields = to_tensordict(records, fields_of(records[0]))
    tags = [r.tags() for r in records]
    gc.collect()
    started = time.perf_counter()
    tq.kv_batch_put(keys=[r.key for r in records], partition_id=partition, fields=fields, tags=tags)
    return time.perf_counter() - started


async def sink(records: list[TrajectoryRecord], partition: str, batch: int) -> float:
    writer = TransferQueueSink(partition)
    gc.collect()
    started = time.perf_counter()
    for chunk in batches(records, batch):
        uids = sorted({r.uid for r in chunk})
        await writer.put_prompt_statuses({uid: ("running", 1) for uid in uids})
        await writer.put_records(chunk)
        await writer.put_prompt_statuses({uid: ("finished", 1) for uid in uids})
    return time.perf_counter() - started


def parquet(records: list[TrajectoryRecord], batch: int, padding: Padding | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = ParquetSink(Path(tmp) / "trajectories", padding=padding)
        started = time.perf_counter()
        for chunk in batches(records, batch):
            markers = [MaterializedMarker(session_id=r.session_id, stream_seq=1, digests={}) for r in chunk]
            out.commit(out.stage(chunk, markers).name)
        return time.perf_counter() - started


def clear(partition: str) -> None:
    keys = list(tq.kv_list(partition_id=partition).get(partition, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=partition)


def main() -> None:
    default_batch = MaterializerOptions().max_batch
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1024)
    parser.add_argument("--batches", default=f"{default_batch},256",
                        help=f"materializer batch sizes to measure (the default is {default_batch})")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]

    records = build_records(args.records, args.turns)
    tokens = sum(r.seq_len for r in records)
    print(f"{len(records)} records, {tokens / len(records):.0f} tokens each on average; "
          f"materializer batches of {' and '.join(map(str, sizes))} (default {default_batch})")
    connection = TransferQueueConnection(None, storage_units=2)
    connection.open()
    loop = asyncio.new_event_loop()
    settle_heap()
    results: dict[int, tuple[list[float], list[float]]] = {}
    try:
        for size in sizes:
            base, ours = results.setdefault(size, ([], []))
            for rep in range(args.repeat):
                if rep % 2:
                    ours.append(loop.run_until_complete(sink(records, f"sink{size}_{rep}", size)))
                base.append(baseline(records, f"base{size}_{rep}"))
                if not rep % 2:
                    ours.append(loop.run_until_complete(sink(records, f"sink{size}_{rep}", size)))
                clear(f"base{size}_{rep}")
                clear(f"sink{size}_{rep}")
    finally:
        loop.close()
        connection.close()
    flat = min(parquet(records, sizes[0], None) for _ in range(args.repeat))
    padded = min(parquet(records, sizes[0], Padding(prompt_length=1024, response_length=2048))
                 for _ in range(args.repeat))
    n = len(records)
    print(f"{'':<46}{'best':>10}{'median':>10}  (records/s, {args.repeat} rounds)")
    for size, (base, ours) in results.items():
        print(f"{f'batches of {size}:':<46}")
        print(f"{'  transferqueue bulk kv_batch_put (baseline)':<46}{n / min(base):>10.0f}{n / median(base):>10.0f}")
        print(f"{'  transferqueue sink, batched':<46}{n / min(ours):>10.0f}{n / median(ours):>10.0f}")
        print(f"{'  ratio sink / bulk put (target >= 0.8)':<46}{min(base) / min(ours):>10.2f}"
              f"{median(base) / median(ours):>10.2f}")
    print(f"{f'parquet sink, unpadded, batches of {sizes[0]}':<46}{n / flat:>10.0f}")
    print(f"{f'parquet sink, padded 1024/2048, batches of {sizes[0]}':<46}{n / padded:>10.0f}")


if __name__ == "__main__":
    main()
