"""The Parquet dataset: staged then committed batches, readers (pyarrow, polars, torch), and the diff."""

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import polars as pl
import pyarrow.dataset as ds
import pytest

from materializer.dataset import iter_padded_batches, read_dataset
from materializer.diff import diff_tables, render
from materializer.padding import Padding
from materializer.parquet import ParquetSink, batch_name
from materializer.records import RecordOptions, derive_records
from schemas.errors import RecordTooLong
from schemas.records import TRAJECTORY_SCHEMA, MaterializedMarker
from session.fold import fold
from tests.helpers import SessionScript


def _session(n: int, *, finished: bool | None = None):
    script = SessionScript(session_id=f"{n:032x}", uid=f"u{n // 2}", session_index=n % 2)
    script.turn(0, [1, 2, 3 + n], [10 + n, 11], new_chain=True, logprobs=[-0.5, -0.25])
    script.turn(0, [4], [20 + n], logprobs=[-1.0], n_messages=4, tip="t2")
    if n % 3 == 0:
        script.turn(1, [7], [30, 31, 32], new_chain=True, logprobs=[-0.1, -0.2, -0.3])
    extra = {} if finished is None else {"finished": finished}
    script.reward(float(n), acc=n % 2, **extra)
    script.finalize()
    return fold(script.events)


def _stage(sink, states, options=RecordOptions()):
    records = [r for s in states for r in derive_records(s, options)]
    markers = [MaterializedMarker(session_id=s.session_id, stream_seq=i + 1, digests={}) for i, s in enumerate(states)]
    return sink.stage(records, markers), records


def test_a_batch_is_invisible_until_committed_then_read_by_pyarrow_and_polars(tmp_path):
    sink = ParquetSink(tmp_path / "trajectories", row_group_rows=2)
    staged, records = _stage(sink, [_session(n) for n in range(4)])
    assert staged.name == batch_name((f"{n:032x}" for n in range(4)), sink.owner) and staged.name.startswith("part-")
    assert read_dataset(sink.directory).num_rows == 0
    assert [b.name for b in sink.staged()] == [staged.name]
    assert all(m.parquet_file == staged.name for m in sink.staged()[0].markers)
    sink.commit(staged.name)
    sink.commit(staged.name)  # idempotent
    assert sink.staged() == []
    table = read_dataset(sink.directory)
    assert table.schema.equals(TRAJECTORY_SCHEMA) and table.num_rows == len(records) == 6
    assert ds.dataset(str(sink.directory)).count_rows() == 6
    frame = pl.read_parquet(sink.directory / "*.parquet")
    assert sorted(frame["key"].to_list()) == sorted(r.key for r in records)
    row = frame.filter(pl.col("key") == "u0_0_1").row(0, named=True)
    assert row["responses"] == [30, 31, 32] and row["rm_scores"] == [0.0, 0.0, 0.0]
    assert json.loads(row["reward_extra_info"]) == {"acc": 0} and json.loads(row["metadata"]) == {"global_steps": 3}
    assert len(list((sink.directory).glob("*.parquet"))) == 1  # one file for the batch, in row groups
    import pyarrow.parquet as pq

    assert pq.ParquetFile(sink.directory / staged.name).num_row_groups == 3


def test_discard_and_a_cut_short_write_leave_nothing(tmp_path):
    sink = ParquetSink(tmp_path / "t")
    _stage(sink, [_session(1)])
    (sink.staging / ".part-x.parquet.tmp").write_bytes(b"partial")
    (sink.staging / "part-broken.parquet").write_bytes(b"not parquet")
    found = {b.name: b for b in sink.staged()}
    assert found["part-broken.parquet"].markers == [] and not (sink.staging / ".part-x.parquet.tmp").exists()
    for name in found:
        sink.discard(name)
    assert sink.staged() == [] and read_dataset(sink.directory).num_rows == 0


def test_padded_dataset_and_torch_batches_equal_the_records(tmp_path):
    states = [_session(n) for n in range(5)]
    unpadded = ParquetSink(tmp_path / "a")
    unpadded.commit(_stage(unpadded, states)[0].name)
    padded = ParquetSink(tmp_path / "b", padding=Padding(prompt_length=4, response_length=8, pad_token_id=7))
    staged, records = _stage(padded, states)
    padded.commit(staged.name)
    batches = list(iter_padded_batches(tmp_path / "b", batch_size=3))
    assert [len(b["key"]) for b in batches] == [3, 3, 1]  # 7 records: sessions 0 and 3 have two chains
    again = list(iter_padded_batches(tmp_path / "a", batch_size=3, prompt_length=4, response_length=8,
                                     pad_token_id=7))
    for mine, theirs in zip(batches, again, strict=True):
        assert mine["key"] == theirs["key"]
        for name, tensor in mine.items():
            if name not in ("key", "uid"):
                assert tensor.equal(theirs[name]), name
    by_key = {r.key: r for r in records}
    first = batches[0]
    for i, key in enumerate(first["key"]):
        record = by_key[key]
        assert first["prompts"][i, 4 - record.prompt_len:].tolist() == record.prompts.tolist()
        assert first["responses"][i, :record.response_len].tolist() == record.responses.tolist()
        assert first["rm_scores"][i].sum().item() == pytest.approx(record.reward)
        np.testing.assert_allclose(first["rollout_log_probs"][i, :record.response_len].numpy(),
                                   record.rollout_log_probs, rtol=1e-6)
    assert first["input_ids"].dtype.is_floating_point is False and first["input_ids"].shape == (3, 12)


def test_reading_refuses_what_does_not_fit_when_asked(tmp_path):
    sink = ParquetSink(tmp_path / "a")
    sink.commit(_stage(sink, [_session(3)])[0].name)
    with pytest.raises(RecordTooLong):
        list(iter_padded_batches(tmp_path / "a", batch_size=2, prompt_length=2, response_length=2, overflow="error"))
    with pytest.raises(ValueError, match="unpadded"):
        list(iter_padded_batches(tmp_path / "a", batch_size=2))


def test_diff_sees_options_not_layout(tmp_path):
    states = [_session(n, finished=n != 2) for n in range(4)]
    old = ParquetSink(tmp_path / "old")
    old.commit(_stage(old, states)[0].name)
    same_padded = ParquetSink(tmp_path / "same", padding=Padding(prompt_length=16, response_length=16))
    same_padded.commit(_stage(same_padded, states)[0].name)
    diff = diff_tables(read_dataset(old.directory), read_dataset(same_padded.directory))
    assert diff.common == 6 and diff.identical, render(diff)
    masked = ParquetSink(tmp_path / "masked", padding=Padding(prompt_length=2, response_length=16))
    masked.commit(_stage(masked, states, RecordOptions(mask_unfinished_episode=True,
                                                        trajectory_selection="longest"))[0].name)
    diff = diff_tables(read_dataset(old.directory), read_dataset(masked.directory))
    text = render(diff)
    # longest drops the shorter chain of sessions 0 and 3; session 2 did not finish; every prompt is cut to 2
    assert not diff.identical and diff.only_old == ["u0_0_1", "u1_1_1"] and diff.only_new == []
    assert diff.changed["loss_mask"] == 1 and diff.changed["prompts"] == 4 and diff.new.truncated == 4
    assert diff.changed["responses"] == 0 and diff.changed["reward"] == 0
    assert "only old: u0_0_1, u1_1_1" in text and "padded 2/16" in text and "different" in text
    assert msgspec.json.decode(msgspec.json.encode(diff))["common"] == 4


_LIVE_SINK = """
import sys
from pathlib import Path
from materializer.parquet import ParquetSink
sink = ParquetSink(Path(sys.argv[1]))
(sink.staging / "part-theirs.parquet").write_bytes(b"staged by a sink that is alive")
print(sink.staging, flush=True)
sys.stdin.readline()  # alive until told, then gone without a word (as if killed: no cleanup runs)
import os
os._exit(0)
"""


def test_a_live_sinks_staging_is_left_alone_and_a_dead_ones_adopted(tmp_path):
    directory = tmp_path / "trajectories"
    other = subprocess.Popen([sys.executable, "-c", _LIVE_SINK, str(directory)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        theirs = Path(other.stdout.readline().strip())
        assert theirs.with_name(theirs.name + ".lock").exists()  # the lock file beside the directory
        sink = ParquetSink(directory)
        assert sink.staged() == [] and (theirs / "part-theirs.parquet").exists()  # its lock is held
    finally:
        other.communicate("\n", timeout=60)
    assert [b.name for b in sink.staged()] == ["part-theirs.parquet"]  # adopted: its process is gone
    assert not theirs.exists() and not theirs.with_name(theirs.name + ".lock").exists()
    assert sorted(p.name for p in sink.staging_root.iterdir()) == [sink.owner, sink.owner + ".lock"]
    assert read_dataset(directory).num_rows == 0  # no lock file where the dataset's readers look
    sink.discard("part-theirs.parquet")


def test_a_lock_file_left_without_its_directory_is_cleared(tmp_path):
    sink = ParquetSink(tmp_path / "t")
    (sink.staging_root / "0123.lock").write_bytes(b"")  # its sink died between locking and making its directory
    assert sink.staged() == [] and not (sink.staging_root / "0123.lock").exists()
    second = ParquetSink(tmp_path / "t")  # two sinks in one process hold separate locks
    assert second.staged() == [] and sink.staging.exists()
