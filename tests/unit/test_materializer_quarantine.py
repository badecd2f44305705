"""Quarantine, the pure parts: what the sinks can hold (validation against the real Arrow schema),
the one fold rule, each session read on its own, the summary and the ``rollbus sessions`` table."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from materializer.padding import Padding
from materializer.parquet import ParquetSink
from materializer.reading import Ended, Orphan, SessionReader
from materializer.records import RecordOptions, derive_records
from materializer.service import backoff
from materializer.validation import bounded, record_problems, session_problem
from materializer.verify import compare
from rollbus.commands.sessions import shown_status, table
from schemas import envelope
from schemas.errors import FoldError, LogUnavailable, RecordTooLong, SessionNotFound
from schemas.events import SessionQuarantined
from schemas.records import MaterializedMarker, TrajectoryRecord, records_to_table
from session.fold import SessionState, fold, release_buffers
from session.summary import summarize
from tests.helpers import SessionScript


def _script(session_id: str = "a" * 32, *, index: int = 0, sampled: tuple[int, ...] = (7, 8),
            metadata: dict | None = None) -> SessionScript:
    script = SessionScript(session_id=session_id, uid="u1", session_index=index, metadata=metadata)
    script.turn(0, [1, 2, 3], list(sampled), new_chain=True)
    script.reward(1.0)
    script.finalize()
    return script


def _records(**kwargs: object) -> list[TrajectoryRecord]:
    state = fold(_script(**kwargs).events)  # type: ignore[arg-type]
    assert state is not None
    return derive_records(state)


def test_records_the_schema_holds_have_no_problem():
    records = _records(metadata={"global_steps": 2**40, "extra_info": {"nested": [1, "a", None, 2.5]}})
    assert session_problem(records) is None
    assert records_to_table(records).num_rows == 1


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"index": 2**31}, "session_index=2147483648 is out of the int32 range"),
    ({"metadata": {"x": msgspec.msgpack.Ext(5, b"?")}}, "metadata cannot be stored as JSON"),
    ({"metadata": {"extra_info": {1: "a"}}}, "metadata cannot be stored as JSON"),
])
def test_what_the_parquet_schema_refuses_is_found_first(kwargs, problem):
    records = _records(**kwargs)
    assert problem in (session_problem(records) or "")
    with pytest.raises((ValueError, TypeError, OverflowError)):  # what the sink itself would do
        records_to_table(records)


def test_a_global_steps_out_of_int64_is_found_first_and_is_no_setting_in_metadata():
    (record,) = _records(metadata={"global_steps": 2**63})  # not a setting (schemas.metadata): the default, 0
    assert record.global_steps == 0 and record.metadata == {"global_steps": 2**63}
    records = [msgspec.structs.replace(record, global_steps=2**63)]
    assert "global_steps=9223372036854775808 is out of the int64 range" in (session_problem(records) or "")
    with pytest.raises((ValueError, TypeError, OverflowError)):
        records_to_table(records)


def test_a_token_id_past_int32_is_a_problem_the_schema_would_not_see():
    records = _records(sampled=(7, 2**31 + 5))
    assert "responses holds a token id out of the int32 range" in (session_problem(records) or "")
    table = records_to_table(records)  # no error: the id wraps around, silently
    assert table.column("responses").to_pylist()[0][1] < 0


def test_arrays_that_do_not_line_up_are_problems():
    (record,) = _records()
    short = msgspec.structs.replace(record, rm_scores=np.zeros(1, np.float32), loss_mask=np.full(2, 3, np.int8))
    problems = record_problems(short)
    assert "rm_scores has 1 values for 2 response tokens" in problems
    assert "loss_mask holds values other than 0 and 1" in problems
    wide = msgspec.structs.replace(record, prompts=record.prompts.astype(np.int64))
    assert record_problems(wide) == ["prompts is not a 1-D int32 array"]


def test_a_record_too_long_for_padding_that_refuses_overflow_is_a_problem(tmp_path):
    records = _records(sampled=(7, 8, 9))
    refusing = Padding(prompt_length=2, response_length=8, overflow="error")
    assert "longer (3 + 3 tokens) than the padded lengths (2 + 8)" in (session_problem(records, refusing) or "")
    assert session_problem(records, Padding(prompt_length=2, response_length=8)) is None  # truncated instead
    with pytest.raises(RecordTooLong):
        ParquetSink(tmp_path / "t", padding=refusing).table(records)


def test_reasons_are_one_bounded_line_of_utf8():
    assert bounded("a\n  b\tc") == "a b c"
    assert len(bounded("x" * 1000)) == 400 and bounded("x" * 1000).endswith("…")
    assert bounded("bad \ud800 text") == "bad \\ud800 text"


def test_fit_builds_one_table_and_names_the_sessions_it_cannot_hold(tmp_path):
    sink = ParquetSink(tmp_path / "t")
    good, bad, other = _records(), _records(index=2**31), _records(index=1)
    table, refused = sink.fit([good, bad, other])
    assert list(refused) == [1] and "ArrowInvalid" in refused[1]
    assert table is not None and table.column("session_index").to_pylist() == [0, 1]
    table, refused = sink.fit([good, other])
    assert refused == {} and table is not None and table.num_rows == 2
    table, refused = sink.fit([bad])
    assert table is None and list(refused) == [0]


def test_the_fold_keeps_the_first_quarantine_of_an_ended_session():
    script = _script()
    first = SessionQuarantined(session_id=script.session_id, seq=len(script.events) + 1, time=9.0,
                               stage="invalid", reason="first")
    second = msgspec.structs.replace(first, seq=first.seq + 1, reason="second")
    state = fold([*script.events, first, second])
    assert state is not None and state.quarantined == "first" and state.status == "finalized"
    assert state.seq == second.seq
    released = fold([first], release_buffers(fold(script.events)))  # the projector's way
    assert released is not None and summarize(released).quarantined == "first"
    opened = SessionScript(session_id="b" * 32)
    with pytest.raises(FoldError, match="is open"):
        fold([*opened.events, msgspec.structs.replace(first, session_id=opened.session_id, seq=2)])
    assert envelope.decode(envelope.encode([first])) == [first]
    assert envelope.kind_of([first]) == "quarantined"


def _summary(quarantined: str | None = None, status: str = "finalized"):
    script = _script()
    state = fold(script.events)
    assert state is not None
    return summarize(msgspec.structs.replace(state, quarantined=quarantined, status=status))


def test_rollbus_sessions_shows_a_quarantined_session_with_its_reason():
    plain, set_aside = _summary(), _summary("the sinks cannot hold it: session_index=2147483648")
    assert (shown_status(plain), shown_status(set_aside)) == ("finalized", "quarantined")
    rows = table([plain, set_aside], now=10.0).splitlines()
    assert rows[2].split()[1] == "finalized" and rows[2].rstrip().endswith("ago")
    assert rows[3].split()[1] == "quarantined"
    assert rows[3].endswith("the sinks cannot hold it: session_index=2147483648")
    assert msgspec.json.decode(msgspec.json.encode(set_aside))["quarantined"].startswith("the sinks")


def _unfoldable(session_id: str) -> SessionScript:
    """A rollback that drops more tokens than the turn sampled: the projector's released fold takes it
    (it holds no tokens to count), the materializer's full fold does not."""
    script = SessionScript(session_id=session_id, uid="u1", session_index=3)
    script.turn(0, [1, 2], [5, 6], new_chain=True)
    script.roll_back(0, turn_request_no=1, dropped=9)
    script.turn(0, [7], [8], n_messages=4, tip="t2", prefix="p1")
    script.finalize()
    return script


def test_a_rollback_that_does_not_add_up_folds_released_but_not_in_full():
    events = _unfoldable("c" * 32).events
    released = None
    for event in events:
        released = fold([event], release_buffers(released) if released is not None else None)
    assert released is not None and released.status == "finalized"
    with pytest.raises(FoldError, match="does not match its last turn"):
        fold(events)


def _reader(logs: dict[str, list], fail: dict[str, Exception] | None = None) -> SessionReader:
    async def load(session_id: str) -> tuple[SessionState, int]:
        if fail and session_id in fail:
            raise fail[session_id]
        state = fold(logs[session_id])
        assert state is not None
        return state, 7

    return SessionReader(load=load, quarantine=None, options=RecordOptions(), rollout_n=4, partition="",
                         padding=None, scorer=None)


async def test_each_session_is_read_on_its_own_and_a_bad_one_is_quarantined_not_raised():
    good, invalid = _script("1" * 32), _script("2" * 32, index=2**31)
    underivable = _script("3" * 32)
    underivable.events[3] = msgspec.structs.replace(underivable.events[3], token_ids=b"\x01" * 5,
                                                    logprobs=b"\x00" * 5)  # not whole uint32s: folds, won't unpack
    unfoldable = _unfoldable("4" * 32)
    still_open = SessionScript(session_id="5" * 32)
    logs = {s.session_id: s.events for s in (good, invalid, underivable, unfoldable, still_open)}
    fail = {"6" * 32: LogUnavailable("no answer"), "7" * 32: SessionNotFound("no log")}
    ids = [*logs, *fail]
    ended, orphans, retry = await _reader(logs, fail).read_all(ids, {})
    by_id: dict[str, Ended | Orphan] = {e.session_id: e for e in [*ended, *orphans]}
    assert retry == ["5" * 32, "6" * 32]  # not ended yet, and a transient failure: never quarantined
    assert by_id[good.session_id].quarantine is None and len(by_id[good.session_id].records) == 1
    stages = {sid: x.quarantine.stage for sid, x in by_id.items() if x.quarantine is not None}
    assert stages == {invalid.session_id: "invalid", underivable.session_id: "underivable",
                      unfoldable.session_id: "unreadable", "7" * 32: "unreadable"}
    assert isinstance(by_id["7" * 32], Orphan) and isinstance(by_id[unfoldable.session_id], Orphan)  # no log to ask
    assert "session_index=2147483648" in by_id[invalid.session_id].quarantine.reason
    assert "buffer size must be a multiple" in by_id[underivable.session_id].quarantine.reason
    assert all(not e.records for e in ended if e.quarantine is not None)


async def test_a_session_the_log_says_is_quarantined_stays_so_and_a_rejected_one_is():
    logged = _script("1" * 32)
    logged.events.append(SessionQuarantined(session_id=logged.session_id, seq=len(logged.events) + 1, time=1.0,
                                            stage="invalid", reason="said before"))
    fine = _script("2" * 32)
    reader = _reader({logged.session_id: logged.events, fine.session_id: fine.events})
    ended, _, _ = await reader.read_all([logged.session_id, fine.session_id], {fine.session_id: "its write failed"})
    first, second = ended
    assert first.quarantine is not None and first.quarantine.logged and first.quarantine.reason == "said before"
    assert second.quarantine is not None and (second.quarantine.stage, second.quarantine.reason) == (
        "write", "its write failed")


async def test_a_bug_still_fails_the_read_loudly():
    reader = _reader({}, {"1" * 32: AttributeError("a bug")})
    with pytest.raises(AttributeError):
        await reader.read_all(["1" * 32], {})


def test_the_backoff_doubles_up_to_its_bound():
    assert [backoff(n, 0.5, 30.0) for n in (1, 2, 3, 4, 7, 8, 50)] == [0.5, 1.0, 2.0, 4.0, 30.0, 30.0, 30.0]


def test_verify_names_a_quarantined_session_instead_of_its_missing_keys():
    script = _script()
    event = SessionQuarantined(session_id=script.session_id, seq=len(script.events) + 1, time=9.0,
                               stage="invalid", reason="why")
    state = fold([*script.events, event])
    assert state is not None
    marker = MaterializedMarker(session_id=script.session_id, stream_seq=3, digests={}, status="quarantined")
    (difference,) = compare(state, marker)
    assert difference.kind == "quarantined" and "none of its 1 records are in the sinks: why" in difference.detail
