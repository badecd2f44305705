"""Streaming a reply: incremental detokenization and tool-call holdback, checked against
the whole-text parse with the real Qwen tokenizer."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.chat.deltas import ContentDelta, ReasoningDelta, ToolCallReady
from edge.tokens.detokenize import IncrementalDecoder
from edge.tokens.parsers.base import PlainParser
from edge.tokens.parsers.hermes import HermesParser
from edge.tokens.reasoning import split_reasoning
from edge.tokens.reply import ReplyParser, call_ids
from edge.tokens.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("builtin:qwen2.5")
IM_END = TOKENIZER.eos_token_id


def _cut(seq, cuts):
    bounds = sorted({min(c, len(seq)) for c in cuts} | {0, len(seq)})
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]


def _decoder() -> IncrementalDecoder:
    return IncrementalDecoder(TOKENIZER.decode, TOKENIZER.stop_token_ids)


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    ids = TOKENIZER.encode("猫🦜\U0001d518")
    assert len(ids) > 2  # the emoji takes more than one byte-level token
    decoder = _decoder()
    pieces = [decoder.feed([token]) for token in ids] + [decoder.flush()]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == "猫🦜\U0001d518"
    assert "" in pieces  # something was held back


def test_a_trailing_stop_token_is_not_text_but_an_inner_one_is():
    decoder = _decoder()
    assert decoder.feed([*TOKENIZER.encode("hi"), IM_END]) == "hi"
    assert decoder.flush() == ""
    decoder = _decoder()
    assert decoder.feed([IM_END]) == ""
    assert decoder.feed(TOKENIZER.encode("x")) == "<|im_end|>x"


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.sampled_from("aé猫🦜\U0001d518 \n<>/{}\""), max_size=40), cuts=st.lists(st.integers(0, 40)),
       stop=st.booleans())
def test_incremental_decode_equals_the_whole_decode(text, cuts, stop):
    ids = TOKENIZER.encode(text) + ([IM_END] if stop else [])
    decoder = _decoder()
    pieces = [decoder.feed(chunk) for chunk in _cut(ids, cuts)] + [decoder.flush()]
    assert "".join(pieces) == TOKENIZER.decode(ids[:-1] if stop else ids)
    assert not any(p.endswith("\ufffd") for p in pieces)


CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": "é"}}\n</tool_call>'
BAD_CALL = "<tool_call>\n{oops}\n</tool_call>"
_PARTS = st.sampled_from(["<think>\n", "\n</think>\n\n", "Let me see.", " ", "\n", "猫", "<", "<tool", CALL,
                          BAD_CALL, "done"])


def _stream(parser: ReplyParser, pieces, use_tools=True):
    stream = parser.stream(call_ids(7), use_tools=use_tools)
    live = [d for piece in pieces for d in stream.feed(piece)]
    last, parsed = stream.finish()
    return live, last, parsed


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(_PARTS, max_size=8), cuts=st.lists(st.integers(0, 200), max_size=8),
       starts_open=st.booleans(), use_tools=st.booleans())
def test_stream_ends_with_the_whole_text_parse_and_shows_exactly_it(parts, cuts, starts_open, use_tools):
    text = "".join(parts)
    parser = ReplyParser(HermesParser(), starts_in_reasoning=starts_open)
    live, last, parsed = _stream(parser, _cut(text, cuts), use_tools)
    assert parsed == parser.parse(text, call_ids(7), use_tools=use_tools)
    deltas = live + last
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == parsed.content
    assert ("".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) or None) == parsed.reasoning
    assert tuple(d.call for d in deltas if isinstance(d, ToolCallReady)) == parsed.tool_calls
    assert not any(isinstance(d, ToolCallReady) for d in live)
    shown_live = "".join(d.text for d in live if isinstance(d, ContentDelta))
    if use_tools:  # what was shown live precedes the first marker: no tool-call markup leaks
        _, content = split_reasoning(text, starts_open=starts_open)
        assert content.split("<tool_call>")[0].startswith(shown_live)


def test_content_streams_until_a_marker_and_calls_come_at_the_end():
    parser = ReplyParser(HermesParser())
    stream = parser.stream(call_ids(3))
    assert stream.feed("Let me ") == [ContentDelta("Let me")]
    assert stream.feed("compute.\n<tool") == [ContentDelta(" compute.")]
    assert stream.feed("_call>\n{\"name\": \"calc\", ") == []
    assert stream.feed('"arguments": {"x": 1}}\n</tool_call>') == []
    last, parsed = stream.finish()
    (ready,) = last
    assert ready.index == 0 and ready.call.id == "call_3_0" and json.loads(ready.call.arguments) == {"x": 1}
    assert parsed.content == "Let me compute." and parsed.reasoning is None


def test_a_malformed_call_becomes_content_as_without_streaming():
    stream = ReplyParser(HermesParser()).stream(call_ids(1))
    assert stream.feed("Hi\n" + BAD_CALL) == [ContentDelta("Hi")]
    last, parsed = stream.finish()
    assert last == [ContentDelta("\n" + BAD_CALL)] and parsed.parse_error and parsed.tool_calls == ()


@pytest.mark.parametrize("parser", [HermesParser(), PlainParser()])
def test_parsers_name_their_start_markers(parser):
    assert isinstance(parser.start_markers, tuple)
    for marker in parser.start_markers:
        assert parser.parse(f"text {marker}", call_ids(1)).content.startswith("text")
