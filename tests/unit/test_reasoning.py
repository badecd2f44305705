"""The reasoning splitter: whole texts, and streams that must agree with them however cut."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.tokens.reasoning import ReasoningStream, opens_reasoning, split_reasoning


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("Hello", None, "Hello"),
    ("  Hello\n", None, "  Hello\n"),
    ("<think>\nLet me see.\n</think>\n\nIt is 42.", "Let me see.", "It is 42."),
    ("\n<think>a\n\nb</think>c", "a\n\nb", "c"),
    ("<think>cut off mid-thought\n", "cut off mid-thought", ""),
    ("<think>\n\n</think>\n\nanswer", None, "answer"),
    ("<think></think>", None, ""),
    ("Answer first <think>not reasoning</think>", None, "Answer first <think>not reasoning</think>"),
    ("<think>a</think>b</think>c", "a", "b</think>c"),
    ("<thin", None, "<thin"),
    ("", None, ""),
])
def test_split(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("\nthinking\n</think>\n\nanswer", "thinking", "answer"),
    ("still thinking", "still thinking", ""),
    ("</think>answer", None, "answer"),
    ("<think>x</think>y", "<think>x", "y"),
])
def test_split_when_the_prompt_opened_reasoning(text, reasoning, content):
    assert split_reasoning(text, starts_open=True) == (reasoning, content)


def test_opens_reasoning_reads_the_generation_prompt():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _stream(pieces: list[str], starts_open: bool) -> tuple[str | None, str, list]:
    stream = ReasoningStream(starts_open=starts_open)
    out = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
    reasoning = "".join(t for kind, t in out if kind == "reasoning") or None
    return reasoning, "".join(t for kind, t in out if kind == "content"), out


def test_stream_shows_reasoning_before_its_end_and_holds_only_what_may_be_a_marker():
    stream = ReasoningStream()
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nStep one") == [("reasoning", "Step one")]
    assert stream.feed(".\n\n") == [("reasoning", ".")]
    assert stream.feed("Step two\n</th") == [("reasoning", "\n\nStep two")]
    assert stream.feed("ink>\n\nDone") == [("content", "Done")]
    assert stream.feed(" <think>") == [("content", " <think>")]
    assert stream.finish() == []


_ALPHABET = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", "\n\n", " ", "a", "é", "x y"])


@given(parts=st.lists(_ALPHABET, max_size=12), cuts=st.lists(st.integers(0, 80), max_size=6),
       starts_open=st.booleans())
def test_stream_agrees_with_split_however_the_text_is_cut(parts, cuts, starts_open):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    reasoning, content, out = _stream(pieces, starts_open)
    assert (reasoning, content) == split_reasoning(text, starts_open=starts_open)
    assert all(t for _, t in out)  # never an empty piece
