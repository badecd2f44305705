"""The processor: how an image becomes placeholder tokens and model inputs, for the Qwen2-VL family.

``--processor builtin:qwen2.5-vl`` is transformers' ``Qwen2VLImageProcessor`` with Qwen2.5-VL's preprocessor
settings (patch 14, temporal patch 2, merge 2, 3136 to 12845056 pixels, CLIP's mean and std), built from code;
a directory is a local Hugging Face processor (its ``preprocessor_config.json``, read with
``local_files_only``; its ``config.json`` when there is one). Nothing is downloaded. The vocabulary is the
tokenizer's (Qwen's: ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655).

What each part is, as verl 0.9.1 builds it (``verl/experimental/agent_loop/agent_loop.py``):

- :meth:`QwenVisionProcessor.image_tokens`: the number of ``<|image_pad|>`` of one image, from its declared
  size alone (the image processor's own ``get_number_of_image_patches``: smart resize to multiples of
  patch x merge within the pixel bounds, patches / merge**2); no pixel is decoded.
- :meth:`QwenVisionProcessor.model_inputs`: ``pixel_values`` (patches x 1176, float32), ``image_grid_thw``
  (images x 3) and ``images_seqlens`` (patches per image), what ``AgentLoopBase._compute_multi_modal_inputs``
  leaves in a trajectory's ``multi_modal_inputs``; ``{}`` without images.
- :meth:`QwenVisionProcessor.position_ids`: the three M-RoPE rows (temporal, height, width), ``(3, L)``,
  from the model family's ``get_rope_index`` bound to the processor as ``verl.utils.tokenizer.hf_processor``
  binds it (what the agent loop calls; equal to ``verl.models.transformers.qwen2_vl.get_rope_index`` on the
  unpadded tokens, which the tests check). A record's position ids add verl's text row on top:
  :func:`vision.records.trajectory_inputs`.

transformers and torch are imported when a processor is loaded, not with this module. Without torchvision,
transformers' PIL image processor is used (the builtin uses it always, so its outputs do not depend on what is
installed); videos are not taken.
"""

from __future__ import annotations

import json
import types
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from schemas.errors import ImageRefused, UserError
from vision.images import ImageInfo, open_image

if TYPE_CHECKING:
    import torch

BUILTIN = "builtin:qwen2.5-vl"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# Qwen2.5-VL's preprocessor_config.json (Qwen/Qwen2.5-VL-*-Instruct); the mean and std are CLIP's, the
# image processor's defaults.
QWEN25_VL_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                          "merge_size": 2}
_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@runtime_checkable
class Processor(Protocol):
    """What the edge, the engines and the materializer need of a vision processor."""

    name: str  # "builtin:qwen2.5-vl" or the directory
    placeholder_text: str  # "<|vision_start|><|image_pad|><|vision_end|>" for Qwen2.5-VL
    pad_id: int  # <|image_pad|> = 151655

    def image_tokens(self, info: ImageInfo) -> int:
        """How many ``<|image_pad|>`` this image expands to (from its grid; no pixel decode)."""
        ...

    def placeholder_ids(self, info: ImageInfo) -> list[int]:
        """The image's whole placeholder: ``<|vision_start|>``, ``<|image_pad|>`` x N, ``<|vision_end|>``."""
        ...

    def model_inputs(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """``pixel_values``, ``image_grid_thw``, ``images_seqlens`` of the images, in order, as verl's agent
        loop builds them (``{}`` for none)."""
        ...

    def position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """The ``(3, L)`` M-RoPE position ids of one sequence (``input_ids``, ``attention_mask``: ``(L,)``)."""
        ...


def load_processor(spec: str, tokenizer: object) -> QwenVisionProcessor:
    """``builtin:qwen2.5-vl`` or a local Hugging Face processor directory, with the session's tokenizer (the
    edge's :class:`edge.tokens.tokenizer.Tokenizer` or a transformers tokenizer). A spec that names neither
    is a :class:`UserError` naming the choices."""
    if spec == BUILTIN:
        return QwenVisionProcessor(BUILTIN, _builtin_image_processor(), tokenizer, family="qwen2_5_vl")
    if spec.startswith("builtin:"):
        raise UserError(f"--processor {spec}: no such builtin (the builtin is {BUILTIN}, or give a local "
                        f"Hugging Face processor directory)")
    path = Path(spec)
    if not (path / "preprocessor_config.json").is_file():
        raise UserError(f"--processor {spec}: not a Hugging Face processor directory (no preprocessor_config.json)")
    image_processor = _directory_image_processor(path)
    return QwenVisionProcessor(str(path), image_processor, tokenizer, family=_directory_family(path),
                               config_dir=path if (path / "config.json").is_file() else None)


def _builtin_image_processor() -> Any:
    return _image_processor_class()(**QWEN25_VL_PREPROCESSOR)


def _image_processor_class() -> type:
    try:  # transformers 5: the PIL backend by name (the default one needs torchvision)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:  # transformers 4: the slow processor is PIL's
        from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def _directory_image_processor(path: Path) -> Any:
    settings = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8"))
    kind = settings.get("image_processor_type", "")
    if not kind.startswith("Qwen2VLImageProcessor"):
        raise UserError(f"--processor {path}: image processor {kind or 'unnamed'} is not one rollbus reads "
                        f"(Qwen2VLImageProcessor, as Qwen2-VL and Qwen2.5-VL use)")
    return _image_processor_class().from_pretrained(str(path), local_files_only=True)


def _directory_family(path: Path) -> str:
    config = path / "config.json"
    if not config.is_file():
        return "qwen2_5_vl"
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type", "")
    if model_type not in _FAMILIES:
        raise UserError(f"--processor {path}: model_type {model_type!r} is not one rollbus reads ({_FAMILIES})")
    return str(model_type)


def _token_id(tokenizer: object, token: str) -> int:
    """A token's id from the edge's tokenizer (``token_to_id``) or a transformers one."""
    lookup = getattr(tokenizer, "token_to_id", None) or getattr(tokenizer, "convert_tokens_to_ids", None)
    token_id = lookup(token) if lookup is not None else None
    if not isinstance(token_id, int) or token_id < 0:
        raise UserError(f"the tokenizer has no {token} token: the processor needs the Qwen2-VL vocabulary")
    return token_id


class QwenVisionProcessor:
    """A Qwen2-VL-family processor (:class:`Processor`) over transformers' image processor."""

    def __init__(self, name: str, image_processor: Any, tokenizer: object, *, family: str,
                 config_dir: Path | None = None) -> None:
        self.name = name
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.family = family
        self._config_dir = config_dir
        self.start_id = _token_id(tokenizer, VISION_START)
        self.pad_id = _token_id(tokenizer, IMAGE_PAD)
        self.end_id = _token_id(tokenizer, VISION_END)
        self.placeholder_text = VISION_START + IMAGE_PAD + VISION_END
        self.merge_size = int(image_processor.merge_size)

    def __repr__(self) -> str:
        return f"QwenVisionProcessor({self.name!r})"

    def image_tokens(self, info: ImageInfo) -> int:
        try:
            patches = self.image_processor.get_number_of_image_patches(info.height, info.width, {})
        except ValueError as exc:  # e.g. an aspect ratio over 200
            raise ImageRefused(f"the processor does not take an image of {info.width}x{info.height}: {exc}") \
                from exc
        return int(patches) // self.merge_size**2

    def placeholder_ids(self, info: ImageInfo) -> list[int]:
        return [self.start_id, *[self.pad_id] * self.image_tokens(info), self.end_id]

    def model_inputs(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        import torch

        features = self.image_processor(images=[open_image(data) for data in images], return_tensors="pt")
        grid = features["image_grid_thw"]
        return {"pixel_values": features["pixel_values"], "image_grid_thw": grid,
                "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])}

    def position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        import torch

        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
        mask = torch.as_tensor(attention_mask, dtype=torch.long).reshape(1, -1)
        token_types = (ids == self.pad_id).long()  # as the agent loop rebuilds mm_token_type_ids: images are 1
        positions, _ = self._rope.get_rope_index(input_ids=ids, attention_mask=mask,
                                                        mm_token_type_ids=token_types,
                                                        image_grid_thw=image_grid_thw, video_grid_thw=None)
        return positions[:, 0, :]

    @cached_property
    def _rope(self) -> Any:
        """The family's ``get_rope_index`` bound to a holder of its config (no tokenizer needed)."""
        return _bind_rope(types.SimpleNamespace(), self)

    @cached_property
    def hf_processor(self) -> Any:
        """The transformers processor (images only) over this image processor and the tokenizer, with the
        family's ``get_rope_index`` bound to it as ``verl.utils.tokenizer.hf_processor`` binds it: what verl's
        agent loop is given as its ``processor``."""
        return _hf_processor(self)


def _hf_tokenizer(tokenizer: object) -> Any:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    import tokenizers

    to_json = getattr(tokenizer, "to_json", None)
    if to_json is None:
        raise UserError(f"the processor cannot use tokenizer {tokenizer!r}: neither transformers' nor rollbus's")
    eos = getattr(tokenizer, "eos_token", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    backend = tokenizers.Tokenizer.from_str(to_json())
    pad = backend.id_to_token(pad_id) if isinstance(pad_id, int) else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=pad)


def _family(family: str) -> tuple[type, type, type]:
    """(config, model, processor) classes of the family."""
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl import Qwen2VLConfig, Qwen2VLModel, Qwen2VLProcessor

        return Qwen2VLConfig, Qwen2VLModel, Qwen2VLProcessor
    from transformers.models.qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5_VLProcessor

    return Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5_VLProcessor


def _bind_rope(holder: Any, processor: QwenVisionProcessor) -> Any:
    """``holder`` with the family's config and ``get_rope_index`` bound to it, as verl binds them."""
    config_class, model_class, _ = _family(processor.family)
    if processor._config_dir is not None:
        holder.config = config_class.from_pretrained(str(processor._config_dir), local_files_only=True)
    else:
        holder.config = config_class(image_token_id=processor.pad_id, vision_start_token_id=processor.start_id,
                                     vision_end_token_id=processor.end_id)
        holder.config.vision_config.spatial_merge_size = processor.merge_size
    holder.get_rope_index = types.MethodType(model_class.get_rope_index, holder)
    if hasattr(model_class, "get_vision_position_ids"):
        holder.get_vision_position_ids = types.MethodType(model_class.get_vision_position_ids, holder)
    return holder


def _hf_processor(processor: QwenVisionProcessor) -> Any:
    base = _family(processor.family)[2]

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        """The family's processor without a video processor (transformers' needs torchvision)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: object) -> object:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    hf = ImagesOnly(image_processor=processor.image_processor, tokenizer=_hf_tokenizer(processor.tokenizer),
                    video_processor=None)
    return _bind_rope(hf, processor)
