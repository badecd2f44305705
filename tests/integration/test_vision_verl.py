"""verl 0.9.1's own code path for multimodal records accepts the vision fields rollbus builds
(:func:`vision.records.trajectory_inputs`): they equal what its agent loop rebuilds at the end of a trajectory
(``AgentLoopWorker._agent_loop_postprocess``: ``_compute_multi_modal_inputs``, ``_compute_position_ids``), its
``_postprocess`` batches them into a ``DataProto``, and its trainer-side readers (``left_right_2_no_padding``,
then ``FSDPEngineWithLMHead.prepare_model_inputs``, which gathers ``multi_modal_inputs`` with
``extract_multi_modal_inputs``) turn them into inputs on which a Qwen2.5-VL model computes exactly the logits it
computes from the trajectory by itself.

verl's classes are used as they are; the two workers are made without their ``__init__`` (which wants a whole
Hydra config, Ray and a model directory), given only the attributes those methods read.
"""

from __future__ import annotations

import asyncio
import io
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")
agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop")

from edge.engines.models import build_tiny_qwen2_vl  # noqa: E402
from edge.tokens.tokenizer import load_tokenizer  # noqa: E402
from vision.images import ImageLimits, inspect  # noqa: E402
from vision.processor import BUILTIN, QwenVisionProcessor, load_processor  # noqa: E402
from vision.records import trajectory_inputs  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 160, 256
TOKENIZER = load_tokenizer("builtin:qwen2.5")


def encoded(width: int, height: int, color: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", (width, height), color)
    image.paste((color[2], color[0], 128), (width // 3, height // 3, width // 2, height // 2))
    image.save(out, fmt)
    return out.getvalue()


SCREENSHOT, CHART = encoded(300, 200, (200, 20, 20)), encoded(64, 300, (10, 30, 220), "JPEG")


@pytest.fixture(scope="module")
def processor() -> QwenVisionProcessor:
    return load_processor(BUILTIN, TOKENIZER)


@pytest.fixture(scope="module")
def worker(processor: QwenVisionProcessor) -> Any:
    """verl's agent-loop worker, with what ``_agent_loop_postprocess`` and ``_postprocess`` read: the rollout
    lengths, the tokenizer and processor (as ``verl.utils.tokenizer.hf_processor`` makes it, ``get_rope_index``
    bound), no reward workers, no distillation."""
    worker = object.__new__(agent_loop.AgentLoopWorker)
    worker.rollout_config = types.SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    worker.processor = processor.hf_processor
    worker.tokenizer = processor.hf_processor.tokenizer
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    return worker


def conversation(processor: QwenVisionProcessor) -> tuple[list[int], list[int], list[int]]:
    """A screenshot in the prompt, a tool call, a chart in the tool's result, the answer: (prompt ids, response
    ids, response mask)."""
    def image(data: bytes) -> list[int]:
        return processor.placeholder_ids(inspect(data, ImageLimits()))

    prompt = [*TOKENIZER.encode("<|im_start|>user\nWhat is on screen? "), *image(SCREENSHOT),
              *TOKENIZER.encode("<|im_end|>\n<|im_start|>assistant\n")]
    call = TOKENIZER.encode('<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call><|im_end|>')
    result = [*TOKENIZER.encode("\n<|im_start|>user\n<tool_response>\n"), *image(CHART),
              *TOKENIZER.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")]
    answer = TOKENIZER.encode("A chart.<|im_end|>")
    return prompt, [*call, *result, *answer], [1] * len(call) + [0] * len(result) + [1] * len(answer)


def postprocessed(worker: Any, prompt: list[int], response: list[int], mask: list[int], images: list[bytes]) -> Any:
    """verl's padded trajectory, its vision fields rebuilt by its agent loop from the images."""
    output = agent_loop.AgentLoopOutput(
        prompt_ids=prompt, response_ids=response, response_mask=mask, num_turns=4,
        multi_modal_data={"images": [Image.open(io.BytesIO(data)) for data in images]} if images else {},
        metrics=agent_loop.AgentLoopMetrics())
    return asyncio.run(worker._agent_loop_postprocess(output, validate=False, raw_prompt=[]))


@pytest.fixture(scope="module")
def trajectories(worker: Any, processor: QwenVisionProcessor) -> list[tuple[Any, dict[str, Any]]]:
    """(verl's padded output, rollbus's fields for the same tokens) for the two-image conversation and a text one."""
    prompt, response, mask = conversation(processor)
    text_prompt = TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    found = []
    for args in ((prompt, response, mask, [SCREENSHOT, CHART]), (text_prompt, TOKENIZER.encode("hello<|im_end|>"),
                                                                 [1, 1], [])):
        verl = postprocessed(worker, *args)
        found.append((verl, trajectory_inputs(processor, verl.input_ids[0], verl.attention_mask[0], args[3])))
    return found


def test_the_fields_equal_what_verls_agent_loop_builds(trajectories: list[tuple[Any, dict[str, Any]]]) -> None:
    (verl, ours), (verl_text, ours_text) = trajectories
    assert sorted(verl.multi_modal_inputs) == sorted(ours["multi_modal_inputs"]) == \
        ["image_grid_thw", "images_seqlens", "pixel_values"]
    for key, value in verl.multi_modal_inputs.items():
        assert torch.equal(ours["multi_modal_inputs"][key], value), key
    assert verl.position_ids.shape == (1, 4, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert torch.equal(ours["position_ids"], verl.position_ids[0])
    assert ours["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 14, 22], [1, 22, 4]]
    assert verl_text.multi_modal_inputs == ours_text["multi_modal_inputs"] == {}  # a processor, no image
    assert torch.equal(ours_text["position_ids"], verl_text.position_ids[0])


def test_unpadded_fields_are_the_padded_ones_without_the_padding(
        trajectories: list[tuple[Any, dict[str, Any]]], processor: QwenVisionProcessor) -> None:
    """A record stored without padding (TransferQueue's jagged fields) holds the attended columns."""
    verl, ours = trajectories[0]
    attended = verl.attention_mask[0].bool()
    unpadded = trajectory_inputs(processor, verl.input_ids[0][attended], torch.ones(int(attended.sum())),
                                 [SCREENSHOT, CHART])
    assert torch.equal(unpadded["position_ids"], ours["position_ids"][:, attended])
    assert torch.equal(unpadded["multi_modal_inputs"]["pixel_values"], ours["multi_modal_inputs"]["pixel_values"])


def test_verls_trainer_reads_them_into_the_model(worker: Any, trajectories: list[tuple[Any, dict[str, Any]]]) -> None:
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import left_right_2_no_padding

    outputs = [verl.model_copy(update={"multi_modal_inputs": ours["multi_modal_inputs"],
                                       "position_ids": ours["position_ids"].unsqueeze(0)})
               for verl, ours in trajectories]
    batch = worker._postprocess(outputs)
    assert batch.batch["position_ids"].shape == (2, 4, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert len(batch.non_tensor_batch["multi_modal_inputs"]) == 2

    micro_batch = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(micro_batch, use_remove_padding=False, temperature=1.0)
    engine = object.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length, engine.use_ulysses_sp = None, False
    inputs, _ = engine.prepare_model_inputs(micro_batch)
    assert inputs["position_ids"].shape[:2] == (4, 2) and inputs["image_grid_thw"].shape == (2, 3)

    model = build_tiny_qwen2_vl(seed=0).eval()
    with torch.inference_mode():
        logits = model(**inputs).logits
        for row, (verl, ours) in enumerate(trajectories):
            ids = verl.input_ids[0][verl.attention_mask[0].bool()].unsqueeze(0)
            images = ours["multi_modal_inputs"]
            alone = model(ids, mm_token_type_ids=(ids == 151655).long(), pixel_values=images.get("pixel_values"),
                          image_grid_thw=images.get("image_grid_thw")).logits[0]
            assert torch.allclose(logits[row, :ids.shape[1]], alone, atol=1e-4), row
