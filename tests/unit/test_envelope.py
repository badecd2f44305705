import msgspec
import pytest

from schemas import envelope
from schemas.errors import FoldError
from schemas.events import SCHEMA_VERSION, RewardReported, SessionOpened, TurnCompleted
from tests.helpers import SessionScript


def test_round_trip_every_event_type():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True)
    script.turn(0, [6], [7, 8, 9])
    script.reward(1.0, acc=1.0)
    script.close(0)
    script.finalize()
    decoded = envelope.decode(envelope.encode(script.events))
    assert decoded == script.events
    assert {type(e).__name__ for e in decoded} >= {"SessionOpened", "RequestReceived", "ChainStarted",
                                                   "ContextAppended", "TokensGenerated", "TurnCompleted",
                                                   "RewardReported", "ChainClosed", "SessionFinalized"}


def test_json_round_trip_is_also_exact():
    script = SessionScript()
    script.turn(0, [1, 2], [3], new_chain=True)
    for event in script.events:
        assert msgspec.json.decode(msgspec.json.encode(event), type=type(event)) == event


def test_events_are_frozen():
    event = SessionScript().events[0]
    with pytest.raises(AttributeError):
        event.seq = 5  # type: ignore[misc]


def test_kind_is_last_event_kind():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    assert envelope.kind_of(script.events[:1]) == "opened"
    assert envelope.kind_of(script.events) == "turn"


def test_undecodable_envelope_is_a_fold_error():
    with pytest.raises(FoldError):
        envelope.decode(b"\x93garbage")


def test_older_schema_versions_are_upgraded(monkeypatch):
    """An event written by schema v0 goes through the registered upgrader before decoding."""
    old = msgspec.msgpack.encode([{"type": "reward_reported", "session_id": "s" * 16, "seq": 2, "time": 1.0,
                                   "v": SCHEMA_VERSION - 1, "score": 0.5}])

    def lift(raw: dict) -> dict:
        raw = dict(raw)
        raw["reward"] = raw.pop("score")
        return raw

    monkeypatch.setitem(envelope.UPGRADERS, ("reward_reported", SCHEMA_VERSION - 1), lift)
    (event,) = envelope.decode(old, schema_version=SCHEMA_VERSION - 1)
    assert isinstance(event, RewardReported)
    assert event.reward == 0.5 and event.v == SCHEMA_VERSION


def test_newer_schema_is_refused():
    raw = msgspec.msgpack.encode([{"type": "session_finalized", "session_id": "s" * 16, "seq": 2, "time": 1.0,
                                   "v": SCHEMA_VERSION + 1}])
    with pytest.raises(FoldError, match="newer schema"):
        envelope.decode(raw, schema_version=SCHEMA_VERSION + 1)


def test_opened_defaults_survive_round_trip():
    opened = SessionScript().events[0]
    assert isinstance(opened, SessionOpened)
    again = envelope.decode(envelope.encode([opened]))[0]
    assert again == opened


def test_turn_completed_requires_its_fields():
    with pytest.raises(TypeError):
        TurnCompleted(session_id="s", seq=1, time=0.0)  # type: ignore[call-arg]
