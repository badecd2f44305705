"""The builtin processor against transformers' own: the placeholder count of an image (from its header alone)
is what transformers' Qwen2-VL processor expands it to, the model inputs are its image processor's outputs, and
the position ids are verl's; loading is offline, and a spec that names nothing is one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from schemas.errors import ImageRefused, UserError
from vision.images import ImageInfo, ImageLimits, inspect
from vision.processor import BUILTIN, QWEN25_VL_PREPROCESSOR, Processor, QwenVisionProcessor, load_processor

# (width, height): tiny (scaled up to min_pixels), odd sizes, tall, wide, a screenshot (over max_pixels: the
# local directory test below, with a smaller bound)
SIZES = [(20, 20), (28, 28), (300, 200), (64, 900), (1000, 70), (1920, 1080)]


def encoded(width: int, height: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 33)).save(out, fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture(scope="module")
def processor(tokenizer: Tokenizer) -> QwenVisionProcessor:
    return load_processor(BUILTIN, tokenizer)


def test_the_builtin_is_qwen25_vl(processor: QwenVisionProcessor) -> None:
    assert isinstance(processor, Processor)
    assert (processor.name, processor.pad_id, processor.start_id, processor.end_id) == (BUILTIN, 151655, 151652, 151653)
    assert processor.placeholder_text == "<|vision_start|><|image_pad|><|vision_end|>"
    image_processor = processor.image_processor
    assert type(image_processor).__name__.startswith("Qwen2VLImageProcessor")  # what verl's workers test for
    assert (image_processor.patch_size, image_processor.temporal_patch_size, image_processor.merge_size) == (14, 2, 2)
    assert (image_processor.size["shortest_edge"], image_processor.size["longest_edge"]) == (3136, 12845056)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_the_placeholder_count_is_transformers_own(processor: QwenVisionProcessor, width: int, height: int) -> None:
    data = encoded(width, height, "JPEG" if width > 1000 else "PNG")
    info = inspect(data, ImageLimits())
    hf = processor.hf_processor
    image = Image.open(io.BytesIO(data))
    expanded = hf(text=[f"look: {processor.placeholder_text}!"], images=[image], return_tensors="pt")
    ids = expanded["input_ids"][0].tolist()
    assert processor.image_tokens(info) == ids.count(151655)
    start = ids.index(151652)
    assert ids[start:start + processor.image_tokens(info) + 2] == processor.placeholder_ids(info)
    grid = expanded["image_grid_thw"][0]
    assert processor.image_tokens(info) == int(grid.prod()) // 4


def test_the_count_needs_no_pixels(processor: QwenVisionProcessor) -> None:
    """A header is enough: the count of an image that was never encoded matches transformers' for a real one."""
    declared = ImageInfo(digest="0" * 64, media_type="image/png", width=1920, height=1080)
    assert processor.image_tokens(declared) == 2691  # 1932x1092 after smart resize: 69 x 39 merged patches
    with pytest.raises(ImageRefused, match="aspect ratio"):
        processor.image_tokens(ImageInfo(digest="0" * 64, media_type="image/png", width=5000, height=20))


def test_model_inputs_are_the_image_processors(processor: QwenVisionProcessor) -> None:
    images = [encoded(300, 200), encoded(64, 900, "JPEG")]
    inputs = processor.model_inputs(images)
    assert sorted(inputs) == ["image_grid_thw", "images_seqlens", "pixel_values"]
    reference = type(processor.image_processor)(**QWEN25_VL_PREPROCESSOR)(
        images=[Image.open(io.BytesIO(data)).convert("RGB") for data in images], return_tensors="pt")
    assert torch.equal(inputs["pixel_values"], reference["pixel_values"])
    assert inputs["image_grid_thw"].tolist() == [[1, 14, 22], [1, 64, 4]]
    assert inputs["images_seqlens"].tolist() == [14 * 22, 64 * 4]
    assert inputs["pixel_values"].shape == (14 * 22 + 64 * 4, 3 * 2 * 14 * 14)
    assert processor.model_inputs([]) == {}


def test_position_ids_are_verls(processor: QwenVisionProcessor, tokenizer: Tokenizer) -> None:
    from verl.models.transformers.qwen2_vl import get_rope_index

    images = [encoded(300, 200), encoded(64, 900)]
    infos = [inspect(data, ImageLimits()) for data in images]
    ids = torch.tensor([*tokenizer.encode("a"), *processor.placeholder_ids(infos[0]), *tokenizer.encode(" then"),
                        *processor.placeholder_ids(infos[1]), *tokenizer.encode(" end")])
    mask = torch.ones_like(ids)
    grid = processor.model_inputs(images)["image_grid_thw"]
    positions = processor.position_ids(ids, mask, grid)
    assert positions.shape == (3, len(ids))
    assert torch.equal(positions, get_rope_index(processor.hf_processor, input_ids=ids, image_grid_thw=grid,
                                                 attention_mask=mask))
    first = ids.tolist().index(151655)
    assert positions[:, first:first + 3].tolist() == [[first] * 3, [first] * 3, [first, first + 1, first + 2]]
    text = torch.tensor(tokenizer.encode("no image here"))
    assert torch.equal(processor.position_ids(text, torch.ones_like(text), None),
                       torch.arange(len(text)).expand(3, -1))


def test_a_local_processor_directory_loads_offline(tmp_path: Path, tokenizer: Tokenizer,
                                                   processor: QwenVisionProcessor) -> None:
    processor.image_processor.save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "preprocessor_config.json").read_text())
    settings["size"] = {"shortest_edge": 3136, "longest_edge": 200_704}  # a smaller max_pixels than the builtin
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    local = load_processor(str(tmp_path), tokenizer)
    assert local.name == str(tmp_path)
    big = ImageInfo(digest="0" * 64, media_type="image/png", width=1920, height=1080)
    assert local.image_tokens(big) < processor.image_tokens(big) and local.image_tokens(big) <= 200_704 // 28**2
    assert local.image_tokens(big) == local.model_inputs([encoded(1920, 1080)])["image_grid_thw"].prod() // 4


@pytest.mark.parametrize(("spec", "why"), [("builtin:llava", "no such builtin"), ("/nonexistent", "no preprocessor")])
def test_a_spec_that_names_nothing_is_a_user_error(spec: str, why: str, tokenizer: Tokenizer) -> None:
    with pytest.raises(UserError, match=why):
        load_processor(spec, tokenizer)


def test_a_directory_of_another_family_is_a_user_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(UserError, match="CLIPImageProcessor is not one rollbus reads"):
        load_processor(str(tmp_path), tokenizer)
