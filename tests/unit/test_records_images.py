"""Records of a session with images: each trajectory's images at their offsets in input_ids, its
``multi_modal_inputs`` what the processor returns for all of them (built once from the whole trajectory, as
verl's agent loop does) and its M-RoPE position ids; in TransferQueue's fields as verl's TQ agent loop writes
them, in Parquet by digest with the three rows, restored by the reader helper; a text-only session unchanged."""

from __future__ import annotations

import hashlib
import io

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from edge.tokens.tokenizer import load_tokenizer
from materializer import tq_fields
from materializer.records import derive_records
from materializer.vision import VisionInputs, archive_images, log_images, restore
from schemas.archive import ArchivedPiece
from schemas.errors import FoldError
from schemas.events import ForkPoint, ImageRef
from schemas.records import record_digest, records_to_table
from session.fold import fold
from tests.helpers import SessionScript
from vision.images import ImageLimits, inspect
from vision.processor import BUILTIN, QwenVisionProcessor, load_processor
from vision.records import trajectory_inputs


def _png(width: int, height: int, colour: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (colour, 255 - colour, 40)).save(out, "PNG")
    return out.getvalue()


SCREEN, CHART, PHOTO = _png(56, 84, 10), _png(112, 56, 200), _png(28, 28, 90)


@pytest.fixture(scope="module")
def processor() -> QwenVisionProcessor:
    return load_processor(BUILTIN, load_tokenizer("builtin:qwen2.5"))


def _placed(processor: QwenVisionProcessor, text: list[int], images: list[bytes]) -> tuple[list[int], list[ImageRef]]:
    """``text`` then each image's placeholder, as the edge renders it; refs at offsets into these ids."""
    ids = list(text)
    refs = []
    for data in images:
        info = inspect(data, ImageLimits())
        placeholder = processor.placeholder_ids(info)
        refs.append(ImageRef(digest=info.digest, media_type=info.media_type, width=info.width, height=info.height,
                             offset=len(ids) + 1, tokens=len(placeholder) - 2))
        ids += placeholder
    return ids, refs


def _session(processor: QwenVisionProcessor, **identity: str) -> SessionScript:
    """Two images in the prompt, a tool call, a tool result with the first image again (resent), and a sub-agent
    forking off the prompt with a third image of its own."""
    script = SessionScript(processor=BUILTIN, **identity)
    prompt, first = _placed(processor, [9707, 11], [SCREEN, CHART])
    script.turn(0, prompt, [40, 41, 42], new_chain=True, images=first)
    context, second = _placed(processor, [151644, 872], [SCREEN])
    script.turn(0, context, [43], images=second, n_messages=4, tip="t1")
    child, third = _placed(processor, [5, 6], [PHOTO])
    shared = len(prompt)
    script.turn(1, prompt + child, [44], new_chain=True,
                images=[*first, *(msgspec.structs.replace(r, offset=r.offset + shared) for r in third)],
                fork=ForkPoint(cause="sub_agent", parent=0, message_index=2, token_offset=shared))
    script.reward(1.0)
    script.finalize()
    return script


class _Store:
    def __init__(self, *images: bytes) -> None:
        self.data = {hashlib.sha256(d).hexdigest(): d for d in images}
        self.asked: list[str] = []

    async def __call__(self, session_id: str, digest: str) -> bytes | None:
        self.asked.append(digest)
        return self.data.get(digest)


async def _attached(processor: QwenVisionProcessor, store: _Store | None = None) -> list:
    state = fold(_session(processor).events)
    vision = VisionInputs(store or _Store(SCREEN, CHART, PHOTO), load=lambda name, tok: processor)
    return await vision.attach(state, derive_records(state))


async def test_each_trajectory_carries_its_images_and_what_the_processor_returns_for_them(processor):
    store = _Store(SCREEN, CHART, PHOTO)
    main, sub = await _attached(processor, store)
    assert sorted(store.asked) == sorted(store.data)  # each image fetched once for the session
    assert [i.digest for i in main.images] == [hashlib.sha256(d).hexdigest() for d in (SCREEN, CHART, SCREEN)]
    assert [i.digest for i in sub.images] == [hashlib.sha256(d).hexdigest() for d in (SCREEN, CHART, PHOTO)]
    for record, images in ((main, [SCREEN, CHART, SCREEN]), (sub, [SCREEN, CHART, PHOTO])):
        ids = record.input_ids
        for image in record.images:  # each placeholder run where its image says
            assert (ids[image.offset: image.offset + image.tokens] == processor.pad_id).all()
            assert ids[image.offset - 1] == processor.start_id and ids[image.offset + image.tokens] == processor.end_id
        expected = processor.model_inputs(images)
        assert record.multi_modal_inputs.keys() == expected.keys() == {"pixel_values", "image_grid_thw",
                                                                       "images_seqlens"}
        for key, value in expected.items():
            assert torch.equal(record.multi_modal_inputs[key], value)
        rope = processor.position_ids(torch.as_tensor(ids), torch.ones(len(ids), dtype=torch.long),
                                      expected["image_grid_thw"])
        assert np.array_equal(record.vision_position_ids, rope.numpy())
        assert record.vision_position_ids.shape == (3, record.seq_len)
        assert record.vision_position_ids.max() < record.seq_len - 1  # images take fewer positions than tokens


async def test_transfer_queue_fields_are_those_verls_tq_agent_loop_writes(processor):
    from verl.utils.model import extract_multi_modal_inputs
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    records = await _attached(processor)
    ((_keys, fields, _tags),) = tq_fields.grouped(records)
    assert "multi_modal_inputs" in tq_fields.fields_of(records[0])
    # verl's AgentLoopWorkerTQ._agent_loop_postprocess: trajectory_inputs per output, list_of_dict_to_tensordict
    theirs = list_of_dict_to_tensordict([
        {"position_ids": out["position_ids"], "multi_modal_inputs": out["multi_modal_inputs"]}
        for out in (trajectory_inputs(processor, r.input_ids, np.ones(r.seq_len, np.int64),
                                      [_Store(SCREEN, CHART, PHOTO).data[im.digest] for im in r.images])
                    for r in records)])
    ours = fields["position_ids"]
    assert ours.dim() == 3 and ours.shape[:2] == (2, 4) and ours._ragged_idx == 2
    assert torch.equal(ours.values(), theirs["position_ids"].values())  # (4, total tokens): what the engines read
    assert torch.equal(ours.offsets(), theirs["position_ids"].offsets())
    batch = extract_multi_modal_inputs(list(fields["multi_modal_inputs"]))
    expected = extract_multi_modal_inputs(list(theirs["multi_modal_inputs"]))
    assert batch.keys() == expected.keys() == {"pixel_values", "image_grid_thw", "images_seqlens"}
    assert batch["image_grid_thw"].shape == (6, 3)  # both trajectories' images, in order
    for key in expected:
        assert torch.equal(batch[key], expected[key])


async def test_parquet_keeps_the_images_by_digest_and_the_reader_restores_the_tensors(processor):
    records = await _attached(processor)
    table = records_to_table(records)
    sink = pa.BufferOutputStream()
    import pyarrow.parquet as pq

    pq.write_table(table, sink)
    assert SCREEN[20:80] not in sink.getvalue().to_pybytes()  # the pixels' bytes are not in the file
    rows = pq.read_table(pa.BufferReader(sink.getvalue())).to_pylist()
    assert rows[0]["processor"] == BUILTIN
    assert [i["digest"] for i in rows[0]["images"]] == [i.digest for i in records[0].images]
    assert np.array_equal(np.asarray(rows[0]["vision_position_ids"]), records[0].vision_position_ids)

    store = _Store(SCREEN, CHART, PHOTO)
    images = await log_images(store, rows)
    pieces = [ArchivedPiece(session_id=r["session_id"], digest=bytes.fromhex(d), data=v)
              for r in rows[:1] for d, v in store.data.items()]
    assert archive_images(pieces) == images == store.data
    for row, record in zip(rows, records, strict=True):
        restored = restore(row, images, processor)
        assert restored["position_ids"].shape == (4, record.seq_len)
        assert np.array_equal(restored["position_ids"][1:].numpy(), record.vision_position_ids)
        for key, value in record.multi_modal_inputs.items():
            assert torch.equal(restored["multi_modal_inputs"][key], value)
    with pytest.raises(FoldError, match=f"image {records[0].images[1].digest} is not in"):
        restore(rows[0], {d: v for d, v in images.items() if v != CHART}, processor)


async def test_a_missing_or_altered_image_makes_the_records_underivable(processor):
    chart = hashlib.sha256(CHART).hexdigest()
    with pytest.raises(FoldError, match=f"image {chart} is not in the log's object store"):
        await _attached(processor, _Store(SCREEN, PHOTO))
    altered = _Store(SCREEN, CHART, PHOTO)
    altered.data[chart] = SCREEN
    with pytest.raises(FoldError, match=f"image {chart} in the object store does not match its digest"):
        await _attached(processor, altered)


async def test_a_trajectory_without_images_in_a_session_with_a_processor(processor):
    script = SessionScript(processor=BUILTIN)
    script.turn(0, [9707, 11, 12], [40, 41], new_chain=True)
    script.finalize()
    state = fold(script.events)
    (record,) = await VisionInputs(None, load=lambda name, tok: processor).attach(state, derive_records(state))
    assert record.multi_modal_inputs == {} and record.images == ()
    assert np.array_equal(record.vision_position_ids, np.tile(np.arange(5), (3, 1)))
    row = records_to_table([record]).to_pylist()[0]
    assert row["images"] == [] and row["processor"] == BUILTIN


async def test_a_text_only_session_is_untouched():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True)
    script.finalize()
    state = fold(script.events)
    before = derive_records(state)
    after = await VisionInputs(None).attach(state, before)
    assert after is before and before[0].processor is None
    assert "multi_modal_inputs" not in tq_fields.fields_of(before[0])
    row = records_to_table(before).to_pylist()[0]
    assert (row["processor"], row["images"], row["vision_position_ids"]) == (None, None, None)
    with_images = msgspec.structs.replace(before[0], processor=BUILTIN)
    assert record_digest(with_images) != record_digest(before[0])


async def test_the_materializer_fetches_the_images_through_the_log_and_quarantines_a_session_missing_one(
        processor, tmp_path):
    from materializer.parquet import ParquetSink
    from rollbus.testing.memory_log import InMemoryLog
    from schemas import blobs
    from tests.sessions import append
    from tests.unit.test_materializer_memory import DURABLE, markers, running, settled, until

    log = InMemoryLog(max_wait=0.005)
    whole, lacking = _session(processor), _session(processor, session_id="f" * 32, uid="other")
    for script, images in ((whole, (SCREEN, CHART, PHOTO)), (lacking, (SCREEN, PHOTO))):
        for data in images:  # as the edge stores them, before the events
            log.pieces[blobs.object_name(script.session_id, hashlib.sha256(data).digest())] = data
    sink = ParquetSink(tmp_path / "t")
    await log.subscribe(log.cfg.ready_stream, log.cfg.ready_subjects, DURABLE, ack_wait=5, max_ack_pending=256)
    async with running(log, sink):
        await append(log, whole)
        await append(log, lacking)
        await until(lambda: len(log.ready) == 2 and settled(log), timeout=60)
    rows = sink.read().to_pylist()
    assert {r["session_id"] for r in rows} == {whole.session_id}
    expected = await _attached(processor)
    for row, record in zip(rows, expected, strict=True):
        assert [i["digest"] for i in row["images"]] == [i.digest for i in record.images]
        assert np.array_equal(np.asarray(row["vision_position_ids"]), record.vision_position_ids)
    chart = hashlib.sha256(CHART).hexdigest()
    assert markers(log)[lacking.session_id].status == "quarantined"
    last = (await log.read_session(lacking.session_id)).events[-1]
    assert last.stage == "underivable" and f"image {chart} is not in the log's object store" in last.reason


async def test_a_padded_table_keeps_the_image_columns_as_the_unpadded_one(processor):
    from materializer.padding import Padding, pad_records

    records = await _attached(processor)
    padding = Padding(prompt_length=128, response_length=128)
    padded = records_to_table(records, pad_records(records, padding), msgspec.structs.asdict(padding)).to_pylist()
    plain = records_to_table(records).to_pylist()
    for name in ("processor", "images", "vision_position_ids"):  # offsets into the valid tokens, rows unpadded
        assert [r[name] for r in padded] == [r[name] for r in plain]
    images = {hashlib.sha256(d).hexdigest(): d for d in (SCREEN, CHART, PHOTO)}
    for row, record in zip(padded, records, strict=True):  # restored from the valid tokens of a padded row
        assert np.array_equal(restore(row, images, processor)["position_ids"][1:].numpy(), record.vision_position_ids)
    cut = records_to_table(records, pad_records(records, Padding(prompt_length=8, response_length=8)),
                           {}).to_pylist()[0]
    with pytest.raises(FoldError, match="cut to the padded lengths"):
        restore(cut, images, processor)
