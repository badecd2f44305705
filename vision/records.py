"""A trajectory's vision fields, as verl 0.9.1's agent loop leaves them in a record.

``AgentLoopBase._agent_loop_postprocess`` (``verl/experimental/agent_loop/agent_loop.py``) rebuilds them once,
at the end, from the whole trajectory: ``multi_modal_inputs`` is the processor's output for all its images
(``pixel_values``, ``image_grid_thw``, ``images_seqlens``), and ``position_ids`` has four rows, the text
positions (``arange`` over the attended tokens, 1 where the mask is 0) over the three M-RoPE rows (temporal,
height, width; 0 where the mask is 0). verl's
trainer reads exactly this: ``verl.utils.model.extract_multi_modal_inputs`` concatenates each key across the
batch, and the engines take ``position_ids`` of ``(batch, 4, L)`` (``position_ids.dim() == 3``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from schemas.errors import FoldError

if TYPE_CHECKING:
    import torch

    from vision.processor import Processor


def trajectory_inputs(processor: Processor, input_ids: Sequence[int] | torch.Tensor,
                      attention_mask: Sequence[int] | torch.Tensor, images: Sequence[bytes]) -> dict[str, Any]:
    """``{"multi_modal_inputs": {...}, "position_ids": (4, L) long}`` of one trajectory.

    ``input_ids`` and ``attention_mask`` are ``(L,)``, padded or not (padding is where the mask is 0), with
    each image's expanded ``<|image_pad|>`` run; ``images`` are the bytes of the trajectory's images in the
    order their placeholders appear. ``multi_modal_inputs`` is ``{}`` for a trajectory without images (as the
    agent loop leaves it when a processor is configured). Raises :class:`FoldError` when the ids do not hold
    the pads the images expand to (a record that would fail in the trainer's vision tower)."""
    import torch

    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    mask = torch.as_tensor(attention_mask, dtype=torch.long).reshape(-1)
    if ids.shape != mask.shape:
        raise FoldError(f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} differ in length")
    inputs = processor.model_inputs(images)
    grid = inputs.get("image_grid_thw")
    expected = 0 if grid is None else int((grid.prod(-1) // _merge_area(processor)).sum())
    found = int(((ids == processor.pad_id) & (mask == 1)).sum())
    if found != expected:
        raise FoldError(f"the trajectory holds {found} image pad tokens; its {len(images)} images expand to "
                        f"{expected}")
    rope = processor.position_ids(ids, mask, grid)
    text = torch.ones_like(ids)
    attended = mask.bool()
    text[attended] = torch.arange(int(attended.sum()))
    return {"multi_modal_inputs": inputs, "position_ids": torch.cat([text.unsqueeze(0), rope], dim=0)}


def _merge_area(processor: Processor) -> int:
    merge = getattr(processor, "merge_size", 2)
    return int(merge) ** 2
