"""``turn_abandoned``: an audit event that leaves the chains exactly as they were."""

import msgspec

from materializer.records import derive_records
from schemas import envelope
from schemas.bodies import received
from schemas.events import TurnAbandoned
from session.fold import fold
from tests.helpers import SessionScript


def test_an_abandoned_turn_changes_nothing_but_the_sequence():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True)
    before = fold(script.events)
    abandoned = [received(session_id=script.session_id, seq=len(script.events) + 1, time=9.0, request_no=2,
                          wire="anthropic", body=b"{}"),
                 TurnAbandoned(session_id=script.session_id, seq=len(script.events) + 2, time=9.5, request_no=2,
                               chain=0, reason="client_disconnected", tokens_sampled=7)]
    assert envelope.decode(envelope.encode(abandoned)) == abandoned
    assert envelope.kind_of(abandoned) == "abandoned"
    after = fold(abandoned, before)
    # Only the sequence and the request bookkeeping move (the request is indexed for idempotent retries).
    assert msgspec.structs.replace(after, seq=before.seq, updated_at=before.updated_at, requests=1,
                                   request_bodies=before.request_bodies) == before
    assert after.chains == before.chains and after.requests == 2

    script.events.extend(abandoned)
    script.turn(0, [6], [7])  # the retry continues the chain
    script.finalize()
    (record,) = derive_records(fold(script.events))
    assert record.response_mask.tolist() == [1, 1, 0, 1]
