"""A trajectory's vision fields (``vision.records.trajectory_inputs``): verl's four position rows (text positions
over the three M-RoPE rows), padding as verl's agent loop leaves it, and a record whose pads do not match
its images refused. That verl's own code builds and reads the same: tests/integration/test_vision_verl.py."""

from __future__ import annotations

import io

import pytest

from edge.tokens.tokenizer import load_tokenizer
from schemas.errors import FoldError
from vision.images import ImageLimits, inspect
from vision.processor import BUILTIN, load_processor
from vision.records import trajectory_inputs

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

TOKENIZER = load_tokenizer("builtin:qwen2.5")
PROCESSOR = load_processor(BUILTIN, TOKENIZER)


def encoded(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(out, "PNG")
    return out.getvalue()


IMAGE = encoded(56, 84)  # 3 rows of 2 merged patches: 6 pads


def ids_with_image() -> list[int]:
    placeholder = PROCESSOR.placeholder_ids(inspect(IMAGE, ImageLimits()))
    return [*TOKENIZER.encode("see"), *placeholder, *TOKENIZER.encode("ok")]


def test_four_rows_text_over_rope() -> None:
    ids = ids_with_image()
    assert ids.count(PROCESSOR.pad_id) == 6
    fields = trajectory_inputs(PROCESSOR, ids, [1] * len(ids), [IMAGE])
    positions = fields["position_ids"]
    assert positions.shape == (4, len(ids)) and positions.dtype == torch.long
    assert positions[0].tolist() == list(range(len(ids)))
    start = ids.index(PROCESSOR.pad_id)
    assert positions[1:, start:start + 6].tolist() == [[start] * 6, [start + i // 2 for i in range(6)],
                                                       [start + i % 2 for i in range(6)]]
    assert positions[1:, start + 6].tolist() == [start + 3] * 3  # after the image: past its longer side
    assert fields["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 6, 4]]


def test_padding_is_what_verls_agent_loop_leaves() -> None:
    """1 in the text row, 0 in the rope rows (transformers' get_rope_index, which the agent loop calls)."""
    ids = ids_with_image()
    padded = [0, 0, *ids, 0]
    mask = [0, 0, *[1] * len(ids), 0]
    positions = trajectory_inputs(PROCESSOR, padded, mask, [IMAGE])["position_ids"]
    unpadded = trajectory_inputs(PROCESSOR, ids, [1] * len(ids), [IMAGE])["position_ids"]
    assert torch.equal(positions[:, 2:-1], unpadded)
    assert positions[:, [0, 1, -1]].tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_pads_that_do_not_match_the_images_are_refused() -> None:
    ids = ids_with_image()
    with pytest.raises(FoldError, match="holds 6 image pad tokens; its 0 images expand to 0"):
        trajectory_inputs(PROCESSOR, ids, [1] * len(ids), [])
    with pytest.raises(FoldError, match="holds 6 image pad tokens; its 2 images expand to 12"):
        trajectory_inputs(PROCESSOR, ids, [1] * len(ids), [IMAGE, IMAGE])
    with pytest.raises(FoldError, match="differ in length"):
        trajectory_inputs(PROCESSOR, ids, [1], [IMAGE])
