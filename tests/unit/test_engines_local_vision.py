"""The local engine's vision-language model (``--model tiny-qwen2-vl``): a tiny random Qwen2.5-VL that takes a
request's images in its ``<|image_pad|>`` runs, decodes with its KV cache deterministically, and whose replies
the image changes; what it cannot serve is a 400."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import pytest

from edge.engines import GenerateRequest, GenerateResult, SamplingParams
from edge.engines.local import LocalEngine
from edge.engines.models import LOCAL_MODELS, build_tiny_qwen2_vl, weight_version
from edge.tokens.tokenizer import load_tokenizer
from schemas.errors import EngineRefused
from vision.images import ImageLimits, inspect
from vision.processor import BUILTIN, load_processor

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

TOKENIZER = load_tokenizer("builtin:qwen2.5")
PROCESSOR = load_processor(BUILTIN, TOKENIZER)


def encoded(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", (width, height), color)
    image.paste((255 - color[0], 40, 200), (width // 4, height // 4, width // 2, height // 2))
    image.save(out, "PNG")
    return out.getvalue()


RED, BLUE = encoded(120, 90, (220, 30, 30)), encoded(120, 90, (20, 40, 230))


def prompt(*images: bytes) -> list[int]:
    ids = TOKENIZER.encode("<|im_start|>user\nWhat is in")
    for data in images:
        ids += PROCESSOR.placeholder_ids(inspect(data, ImageLimits())) + TOKENIZER.encode(" and")
    return ids + TOKENIZER.encode("?<|im_end|>\n<|im_start|>assistant\n")


def request(*images: bytes, request_id: str = "0a:0", temperature: float = 1.0, ids: list[int] | None = None,
            max_new_tokens: int = 10) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, input_ids=ids if ids is not None else prompt(*images),
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
                           images=images)


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    local = LocalEngine("tiny-qwen2-vl", seed=0, chunk_tokens=4, tokenizer=TOKENIZER)
    yield local
    await local.aclose()


def test_the_model_is_selectable_and_names_its_processor() -> None:
    model = LOCAL_MODELS["tiny-qwen2-vl"]
    assert (model.tokenizer, model.tool_format, model.processor) == ("builtin:qwen2.5", "hermes", BUILTIN)
    assert weight_version("tiny-qwen2-vl", 3) == "tiny-qwen2-vl-random:3"


async def test_it_decodes_deterministically_with_and_without_an_image(engine: LocalEngine) -> None:
    with_image = await engine.generate(request(RED))
    assert with_image == await engine.generate(request(RED))
    assert len(with_image.token_ids) == len(with_image.logprobs or ()) == 10
    without = await engine.generate(request())
    assert without == await engine.generate(request())
    twin = LocalEngine("tiny-qwen2-vl", seed=0)  # no tokenizer: the vision ids come from the model's config
    assert await twin.generate(request(RED)) == with_image
    await twin.aclose()


async def test_the_image_changes_the_reply(engine: LocalEngine) -> None:
    red, blue = await engine.generate(request(RED)), await engine.generate(request(BLUE))
    assert red.token_ids != blue.token_ids and red.logprobs != blue.logprobs
    both = await engine.generate(request(RED, BLUE))
    swapped = await engine.generate(request(BLUE, RED))
    assert both.token_ids != swapped.token_ids


async def test_the_cached_decode_equals_a_full_forward(engine: LocalEngine) -> None:
    """Greedy decoding token by token with the KV cache and explicit M-RoPE positions gives the tokens a single
    forward pass over prompt + reply (the model computing its own positions) ranks first."""
    result = await engine.generate(request(RED, BLUE, temperature=0.0, max_new_tokens=6))
    model = build_tiny_qwen2_vl(seed=0).eval()
    inputs = PROCESSOR.model_inputs([RED, BLUE])
    ids = torch.tensor([prompt(RED, BLUE) + list(result.token_ids)])
    with torch.inference_mode():
        logits = model(ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                       mm_token_type_ids=(ids == PROCESSOR.pad_id).long()).logits[0].float()
    steps = logits[len(prompt(RED, BLUE)) - 1:-1]
    assert steps.argmax(-1).tolist() == list(result.token_ids)
    assert torch.allclose(torch.log_softmax(steps, -1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0],
                          torch.tensor(result.logprobs), atol=1e-4)


async def test_what_it_cannot_serve_is_refused(engine: LocalEngine) -> None:
    with pytest.raises(EngineRefused, match="holds 0 image pad tokens, its 1 images expand to 12"):
        await engine.generate(request(RED, ids=prompt()))
    with pytest.raises(EngineRefused, match="does not decode"):
        await engine.generate(request(b"not an image", ids=prompt(RED)))
    text_only = LocalEngine(seed=0)
    with pytest.raises(EngineRefused, match="takes no images"):
        await text_only.generate(request(RED))
    await text_only.aclose()


async def test_streaming_ends_in_the_same_result(engine: LocalEngine) -> None:
    chunks = [item async for item in engine.stream(request(BLUE))]
    assert isinstance(chunks[-1], GenerateResult) and chunks[-1] == await engine.generate(request(BLUE))


async def test_interleaved_requests_decode_as_they_do_alone(engine: LocalEngine) -> None:
    """Requests interleave chunk by chunk on the worker thread; each keeps its own M-RoPE positions."""
    requests = [request(RED, request_id="0a:1"), request(request_id="0a:2"), request(BLUE, RED, request_id="0a:3")]
    alone = [await engine.generate(r) for r in requests]
    assert list(await asyncio.gather(*(engine.generate(r) for r in requests))) == alone
