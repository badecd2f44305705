"""The materializer's bookkeeping in JetStream KV: session markers and prompt progress.

- ``cfg.markers_bucket``, key = session id: a :class:`MaterializedMarker` per ended session,
  written with ``create`` (revision 0): a second writer of the same marker is refused,
  never silently replaces the first. A marker is the truth that a session's records are
  in the sinks; ``rollbus replay --verify`` compares its digests with a re-derivation.
- ``cfg.prompts_bucket``, key = ``p`` + sha256(uid) (a uid may hold characters a KV key
  may not): a :class:`PromptProgress` per prompt, updated with the revision it was read
  at (compare-and-set), so concurrent writers cannot lose each other's sessions.

Both wrap a :class:`eventlog.kv.Kv`: a :class:`eventlog.kv.KvStore` on JetStream (every call bounded, NATS
errors mapped there, once), or ``rollbus.testing.memory_kv.InMemoryKv`` in unit tests.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable

import msgspec

from eventlog.kv import Kv
from materializer.prompts import PromptProgress
from schemas.errors import RevisionConflict
from schemas.records import MaterializedMarker

_marker = msgspec.json.Decoder(MaterializedMarker)
_progress = msgspec.json.Decoder(PromptProgress)


class Markers:
    def __init__(self, kv: Kv) -> None:
        self.kv = kv

    async def bind(self) -> Markers:
        await self.kv.bind()
        return self

    async def get_many(self, session_ids: Iterable[str]) -> dict[str, MaterializedMarker]:
        ids = list(dict.fromkeys(session_ids))
        found = await asyncio.gather(*(self.kv.get(sid) for sid in ids))
        return {sid: _marker.decode(hit[0]) for sid, hit in zip(ids, found, strict=True) if hit is not None}

    async def create_marker(self, marker: MaterializedMarker) -> MaterializedMarker | None:
        """Write a marker once (compare-and-set on revision 0). None: this marker stands (written now, or an
        identical one by a retried write). Returns the existing marker when another writer's won with the same
        records in another Parquet file (two materializers raced on the session): the caller must then keep
        its copy of the session out of the dataset. Different records are a conflict."""
        try:
            await self.kv.create(marker.session_id, msgspec.json.encode(marker))
        except RevisionConflict:
            existing = await self.kv.get(marker.session_id)
            if existing is None or (winner := _marker.decode(existing[0])).digests != marker.digests:
                raise
            return winner if winner.parquet_file != marker.parquet_file else None
        return None


def prompt_key(uid: str) -> str:
    return "p" + hashlib.sha256(uid.encode()).hexdigest()[:40]


class PromptLedger:
    def __init__(self, kv: Kv) -> None:
        self.kv = kv

    async def bind(self) -> PromptLedger:
        await self.kv.bind()
        return self

    async def load(self, uids: Iterable[str]) -> dict[str, tuple[PromptProgress, int]]:
        """Progress and revision of each known prompt (unknown prompts are absent)."""
        wanted = list(dict.fromkeys(uids))
        found = await asyncio.gather(*(self.kv.get(prompt_key(uid)) for uid in wanted))
        return {uid: (_progress.decode(hit[0]), hit[1]) for uid, hit in zip(wanted, found, strict=True) if hit}

    async def start_attempt(self, fresh: PromptProgress, *, tries: int = 5) -> bool:
        """Record that a newer attempt of the prompt was dispatched (by whoever dispatches it, before its
        sessions open), so that a late session of an older attempt is stale from then on; False when the
        stored progress is of this attempt or a newer one already."""
        for _ in range(tries):
            found = (await self.load([fresh.uid])).get(fresh.uid)
            current, revision = found if found is not None else (None, 0)
            if current is not None and current.for_attempt(fresh) is current:
                return False
            try:
                await self.save(current.for_attempt(fresh) if current is not None else fresh, revision)
            except RevisionConflict:
                continue  # the materializer wrote it meanwhile: look again
            return True
        raise RevisionConflict(f"prompt {fresh.uid}: progress kept changing while attempt {fresh.attempt} started")

    async def save(self, progress: PromptProgress, revision: int) -> int:
        """Create (``revision == 0``) or compare-and-set; returns the new revision."""
        return await self.kv.write(prompt_key(progress.uid), msgspec.json.encode(progress), revision)
