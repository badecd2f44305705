"""The records' vision fields: a trajectory's images into verl's ``multi_modal_inputs`` and M-RoPE position ids.

A session opened with an image processor (``SessionOpened.processor``) gets, for each record, what verl 0.9.1's
agent loop builds once from the whole trajectory (:func:`vision.records.trajectory_inputs`): the processor's
outputs for all its images (``pixel_values``, ``image_grid_thw``, ``images_seqlens``; ``{}`` for a trajectory
without images) and the three M-RoPE rows of its position ids (the records keep them apart from the text row,
which is ``position_ids``). :class:`VisionInputs` does it in the materializer, after the pure derivation
(:mod:`materializer.records`): it loads the session's processor (by name, with the session's tokenizer, once
per pair), fetches each image once from the log's object store (:meth:`eventlog.port.LogPort.image`) and
checks its digest. An image the store does not hold, or holds altered, and a processor that cannot be loaded
here make the session's records underivable (:class:`FoldError`: the session is quarantined and ``rollbus
materialize --from-log`` can try it again); the object store not answering is transient (retried).

Parquet keeps the images by digest and the three rows, never the pixels; :func:`restore` gives a row's tensors
back, from the images of the log (:func:`log_images`) or of an export (:func:`archive_images`), and checks them
against the stored rows.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from schemas.archive import ArchivedPiece
from schemas.errors import FoldError, ImageRefused, UserError
from schemas.records import TrajectoryRecord
from session.fold import SessionState

if TYPE_CHECKING:
    from vision.processor import Processor

ImageFetch = Callable[[str, str], Awaitable[bytes | None]]  # (session id, digest) -> bytes; None: not stored


def load_session_processor(processor: str, tokenizer: str) -> Processor:
    """A session's processor by name, with its tokenizer (nothing downloaded)."""
    from edge.tokens.tokenizer import load_tokenizer
    from vision.processor import load_processor

    return load_processor(processor, load_tokenizer(tokenizer))


class VisionInputs:
    """Adds the vision fields to the records of sessions with a processor (see the module docstring)."""

    def __init__(self, fetch: ImageFetch | None,
                 load: Callable[[str, str], Processor] = load_session_processor) -> None:
        self._fetch = fetch
        self._load = load
        self._processors: dict[tuple[str, str], Processor] = {}

    async def processor(self, name: str, tokenizer: str) -> Processor:
        key = (name, tokenizer)
        if key not in self._processors:
            try:
                self._processors[key] = await asyncio.to_thread(self._load, name, tokenizer)
            except UserError as exc:
                raise FoldError(f"its processor {name} cannot be loaded here: {exc}") from exc
        return self._processors[key]

    async def attach(self, state: SessionState, records: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
        """The records with their vision fields (unchanged for a session without a processor)."""
        if state.processor is None or not records:
            return records
        processor = await self.processor(state.processor, state.tokenizer)
        images = await self.images(state.session_id, (i.digest for r in records for i in r.images))
        try:
            return await asyncio.to_thread(lambda: [with_vision(r, processor, images) for r in records])
        except ImageRefused as exc:  # (the edge took it: another processor here reads it otherwise)
            raise FoldError(f"session {state.session_id}: the processor refuses an image: {exc}") from exc

    async def images(self, session_id: str, digests: Iterable[str]) -> dict[str, bytes]:
        """Each image once, checked against its digest."""
        found = {}
        for digest in dict.fromkeys(digests):
            data = await self._fetch(session_id, digest) if self._fetch is not None else None
            found[digest] = checked(session_id, digest, data)
        return found


def checked(session_id: str, digest: str, data: bytes | None) -> bytes:
    if data is None:
        raise FoldError(f"session {session_id}: image {digest} is not in the log's object store")
    if hashlib.sha256(data).hexdigest() != digest:
        raise FoldError(f"session {session_id}: image {digest} in the object store does not match its digest")
    return data


def with_vision(record: TrajectoryRecord, processor: Processor, images: Mapping[str, bytes]) -> TrajectoryRecord:
    """One record with ``multi_modal_inputs`` and its three M-RoPE rows, from its whole trajectory."""
    from vision.records import trajectory_inputs

    ids = record.input_ids
    built = trajectory_inputs(processor, ids, np.ones(len(ids), dtype=np.int64),
                              [images[i.digest] for i in record.images])
    rope = built["position_ids"][1:].numpy().astype(np.int64)
    return msgspec.structs.replace(record, multi_modal_inputs=dict(built["multi_modal_inputs"]),
                                   vision_position_ids=rope)


# --- reading Parquet back ------------------------------------------------------------------------------------


def restore(row: Mapping[str, Any], images: Mapping[str, bytes], processor: Processor) -> dict[str, Any]:
    """A Parquet row's ``multi_modal_inputs`` and ``position_ids`` (four rows, verl's, over its valid tokens)
    rebuilt from its images (``images``: digest -> bytes, e.g. :func:`log_images` or :func:`archive_images`),
    unpadded or padded; :class:`FoldError` when an image is missing or altered, the row was cut to the padded
    lengths, or the rows rebuilt differ from those stored. A text-only row gives ``{}``."""
    if row.get("processor") is None:
        return {}
    from vision.records import trajectory_inputs

    ids = _valid_ids(row)
    session_id = str(row["session_id"])
    data = [checked(session_id, ref["digest"], images.get(ref["digest"])) for ref in row["images"] or []]
    built = trajectory_inputs(processor, ids, np.ones(len(ids), dtype=np.int64), data)
    stored = row.get("vision_position_ids")
    if stored is not None and not np.array_equal(built["position_ids"][1:].numpy(), np.asarray(stored)):
        raise FoldError(f"record {row['key']}: the position ids rebuilt differ from those stored")
    return {"multi_modal_inputs": dict(built["multi_modal_inputs"]), "position_ids": built["position_ids"]}


def _valid_ids(row: Mapping[str, Any]) -> np.ndarray:
    """A row's valid tokens: all of an unpadded row's; a padded row's between its prompt's left padding and its
    response's right padding (a row cut to the padded lengths is refused: its images' offsets do not hold)."""
    if row.get("truncated"):
        raise FoldError(f"record {row['key']}: cut to the padded lengths, its images cannot be restored")
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    if len(ids) == row["seq_len"]:
        return ids
    width = len(row["prompts"])
    return ids[width - row["prompt_len"]: width + row["response_len"]]


async def log_images(fetch: ImageFetch, rows: Iterable[Mapping[str, Any]]) -> dict[str, bytes]:
    """The images of Parquet rows, from the log's object store (``fetch``: e.g. a ``LogPort``'s ``image``)."""
    found: dict[str, bytes] = {}
    for row in rows:
        for ref in row.get("images") or []:
            if ref["digest"] not in found:
                data = await fetch(str(row["session_id"]), ref["digest"])
                found[ref["digest"]] = checked(str(row["session_id"]), ref["digest"], data)
    return found


def archive_images(records: Iterable[object]) -> dict[str, bytes]:
    """The images (and any other pieces) of an export's records (``rollbus.commands.archive_io.read_archive``
    of a ``rollbus export`` file), by sha256 hex."""
    return {record.digest.hex(): record.data for record in records if isinstance(record, ArchivedPiece)}
