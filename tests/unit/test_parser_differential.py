"""SGLang's tool-call parsers against the model families' documented formats, against the
built-in parsers, and streamed against whole (the ``sglang`` extra is installed: nothing skips).

Model outputs are generated: some text, then one to three calls (names and JSON arguments
drawn from the tools' schemas) written the way each family writes them. Streams are cut at
random boundaries between tokens: a format's special markers (``<tool_call>``,
``<\uff5ctool▁sep\uff5c>``, ``<|call|>``, ...) are single tokens of the model's vocabulary and arrive
whole, the rest may be cut anywhere.

Checked, for every format:

- SGLang's whole parse reads back exactly the calls written (names, arguments as JSON values)
  and the text before them;
- a built-in parser of the same format reads the same calls and the same text;
- SGLang's own stream (``parse_stream_chunk``, ``parse_stream_end``) gives the same calls;
- a reply streamed through the edge (:class:`edge.tokens.reply.ReplyStream` with
  ``sglang:NAME``) shows what it records, and records what the whole parse reads.

Where they differ, by the family's documented format (decided here, once):

- text before the calls: SGLang's detectors strip it, where the built-in parsers keep its leading
  whitespace (the newlines after ``</think>``), as :class:`edge.tokens.parsers.ToolParser` asks
  and as SGLang's streams show it. The adapter gives it back
  (``sglang_adapter._text_before``), so the text compares equal here, whitespace included.
- SGLang's streams (``parse_stream_chunk``) are right a token a piece, as SGLang's server
  streams, but for two cases, and wrong in more when a piece holds several tokens: text before
  a call marker in the marker's piece is dropped, a piece spanning the end of one call and the
  start of the next loses the next (hermes, mistral), deepseekv3 loses a call's arguments when
  they arrive with the end of its code fence. Mistral's stream reads only the first call of a
  ``[TOOL_CALLS] [{...}, {...}]`` list, even a token a piece; the rest comes out as normal text.
  Llama3's stream cuts a string argument short at a ``:`` followed by two ``'`` (``":''"``),
  where it reads the JSON as a Python literal.
- GLM-4.5's arguments are raw text between ``<arg_value>`` tags, and SGLang reads a string argument
  written between two of the same quote (``'x'``, ``"x"``, ``''``) as quoted: the quotes are dropped,
  whole and streamed (its ``parse_arguments``, "strategy 2.5"), so such a value cannot be passed
  through it; the generated outputs leave them out for glm45, and the last tests assert it.
  (Asserted below, so that a fixed SGLang shows here.) Their whole parses are right. So the
  edge shows SGLang's streamed normal text only up to the first call, records the whole parse,
  and sends its calls and the rest of its text at the end: an edge stream loses nothing
  however it is cut (last test).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from edge.chat.conversation import ToolSpec
from edge.chat.deltas import ContentDelta, ToolCallReady
from edge.tokens.parsers import make_parser, make_reasoning
from edge.tokens.parsers.sglang_adapter import SGLangParser
from edge.tokens.reply import ReplyParser, call_ids

WEATHER = ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}})
SEARCH = ToolSpec(name="search", parameters={"type": "object", "properties": {"query": {"type": "string"}}})
TOOLS = (WEATHER, SEARCH)

Call = tuple[str, dict[str, Any]]

# Strings as models write them in arguments: words, digits, punctuation, non-ASCII letters; no markup
# of any format (<, >, [, {, ", backslash), no whitespace at either end (the XML formats strip values).
_WORD = st.text(st.sampled_from("abcxyzZüé日本 0123,.:;!?-_'/"), min_size=1, max_size=12).map(str.strip).filter(
    lambda s: bool(s) and not s.lstrip("-").replace(".", "", 1).isdigit() and s not in ("true", "false", "null"))
_ARGS = {
    "get_weather": st.fixed_dictionaries({"city": _WORD}, optional={
        "days": st.integers(-5, 10_000), "metric": st.booleans()}),
    "search": st.fixed_dictionaries({"query": _WORD}),
}
CALL = st.sampled_from(sorted(_ARGS)).flatmap(lambda name: _ARGS[name].map(lambda args: (name, args)))
TEXT = st.text(st.sampled_from("Let me check the weather. Sure!\n"), max_size=40)


def _json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def _xml_value(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def hermes(text: str, calls: list[Call]) -> str:
    blocks = [f'<tool_call>\n{{"name": "{n}", "arguments": {_json(a)}}}\n</tool_call>' for n, a in calls]
    return f"{text}\n" + "\n".join(blocks) if text else "\n".join(blocks)


def qwen3_coder(text: str, calls: list[Call]) -> str:
    def block(name: str, args: dict[str, Any]) -> str:
        params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    return (f"{text}\n\n" if text else "") + "\n".join(block(n, a) for n, a in calls)


def llama3(text: str, calls: list[Call]) -> str:  # Llama 3.1+: JSON after <|python_tag|>, ';'-separated
    return text + "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {_json(a)}}}' for n, a in calls)


def mistral(text: str, calls: list[Call]) -> str:
    body = ", ".join(f'{{"name": "{n}", "arguments": {_json(a)}}}' for n, a in calls)
    return f"{text} [TOOL_CALLS] [{body}]" if text else f"[TOOL_CALLS] [{body}]"


def _ds(name: str) -> str:
    """A DeepSeek marker: ``name`` between fullwidth bars (U+FF5C), as DeepSeek's vocabulary spells them."""
    return f"<\uff5c{name}\uff5c>"


def deepseekv3(text: str, calls: list[Call]) -> str:
    blocks = "\n".join(f"{_ds('tool▁call▁begin')}function{_ds('tool▁sep')}{n}\n```json\n{_json(a)}\n```"
                       f"{_ds('tool▁call▁end')}" for n, a in calls)
    return f"{text}{_ds('tool▁calls▁begin')}{blocks}{_ds('tool▁calls▁end')}"


def kimi_k2(text: str, calls: list[Call]) -> str:
    blocks = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_json(a)}<|tool_call_end|>"
                     for i, (n, a) in enumerate(calls))
    return f"{text}<|tool_calls_section_begin|>{blocks}<|tool_calls_section_end|>"


def glm45(text: str, calls: list[Call]) -> str:
    def block(name: str, args: dict[str, Any]) -> str:
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n" for k, v in args.items())
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    return (f"{text}\n" if text else "") + "\n".join(block(n, a) for n, a in calls)


def gpt_oss(text: str, calls: list[Call]) -> str:
    """harmony: the analysis message (``text`` as reasoning), then each call a commentary message."""
    analysis = f"<|channel|>analysis<|message|>{text or 'Think.'}<|end|>"
    return analysis + "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
                              f"<|message|>{_json(a)}<|call|>" for n, a in calls)


# name -> (how the family writes calls, the built-in parser of that format or None)
FORMATS: dict[str, tuple[Callable[[str, list[Call]], str], str | None]] = {
    "hermes": (hermes, "hermes"),
    "qwen25": (hermes, "qwen25"),
    "qwen3_coder": (qwen3_coder, "qwen3_coder"),
    "llama3": (llama3, "llama3"),
    "mistral": (mistral, None),
    "deepseekv3": (deepseekv3, None),
    "kimi_k2": (kimi_k2, None),
    "glm45": (glm45, None),
    "gpt-oss": (gpt_oss, None),
}
REASONING = {"gpt-oss": make_reasoning("sglang:gpt-oss")}  # harmony's analysis channel is its reasoning
SINGLE_CALL = {"gpt-oss"}  # a harmony reply ends at its first <|call|>: one call a turn

MARKERS = re.compile("|".join(map(re.escape, [
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<|python_tag|>",
    "[TOOL_CALLS]", *map(_ds, ["tool▁calls▁begin", "tool▁call▁begin", "tool▁sep", "tool▁call▁end", "tool▁calls▁end"]),
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
    "<|tool_call_end|>", "<|tool_calls_section_end|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>", "<think>", "</think>"])))


def tokens(text: str) -> list[str]:
    """``text`` as the pieces a stream can carry: special markers whole, every other character alone."""
    out: list[str] = []
    position = 0
    for match in MARKERS.finditer(text):
        out.extend(text[position:match.start()])
        out.append(match.group())
        position = match.end()
    out.extend(text[position:])
    return out


@st.composite
def chunked(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut into pieces of one to eight tokens."""
    atoms = tokens(text)
    pieces, i = [], 0
    while i < len(atoms):
        n = draw(st.integers(1, 8))
        pieces.append("".join(atoms[i:i + n]))
        i += n
    return pieces


@st.composite
def outputs(draw: st.DrawFn, fmt: str) -> tuple[str, str, list[Call], list[str]]:
    """A model output in ``fmt``: (the text before the calls, the output, its calls, the output in pieces)."""
    text = draw(TEXT).rstrip()  # leading newlines kept: the text after a </think>
    calls = draw(st.lists(CALL, min_size=1, max_size=1 if fmt in SINGLE_CALL else 3))
    output = FORMATS[fmt][0](text, calls)
    return text, output, calls, draw(chunked(output))


def sglang(fmt: str) -> SGLangParser:
    parser = make_parser(f"sglang:{fmt}")
    assert isinstance(parser, SGLangParser)
    return parser


def read(calls: Any) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed_by_sglang(fmt: str, pieces: list[str]) -> tuple[str, list[Call]]:
    """SGLang's own stream: the normal text it releases and the calls put together from its deltas."""
    parser = sglang(fmt).new(TOOLS)
    normal: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for items in (parser.parse_stream_chunk(p) for p in pieces):
        normal.append(items[0])
        for item in items[1]:
            names[item.tool_index] = item.name or names.get(item.tool_index, "")
            arguments[item.tool_index] = arguments.get(item.tool_index, "") + (item.parameters or "")
    end_text, end_items = parser.parse_stream_end()
    normal.append(end_text)
    for item in end_items:
        names[item.tool_index] = item.name or names.get(item.tool_index, "")
        arguments[item.tool_index] = arguments.get(item.tool_index, "") + (item.parameters or "")
    return "".join(normal), [(names[i], json.loads(arguments[i] or "null")) for i in sorted(names)]


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@SETTINGS
@given(data=st.data())
def test_sglang_whole_parse_reads_the_documented_format(fmt: str, data: st.DataObject) -> None:
    text, output, calls, _ = data.draw(outputs(fmt))
    assume(not _quotes_dropped(fmt, calls))  # (docstring)
    parsed = sglang(fmt).parse(output, call_ids(1), TOOLS)
    assert parsed.parse_error is None
    assert read(parsed.tool_calls) == calls
    assert parsed.content == ("" if fmt == "gpt-oss" else text)  # harmony: the analysis is reasoning


@pytest.mark.parametrize("fmt", [f for f, (_, builtin) in sorted(FORMATS.items()) if builtin])
@SETTINGS
@given(data=st.data())
def test_builtin_parsers_read_what_sglang_reads(fmt: str, data: st.DataObject) -> None:
    _, output, calls, _ = data.draw(outputs(fmt))
    ours = make_parser(FORMATS[fmt][1] or "").parse(output, call_ids(1), TOOLS)
    theirs = sglang(fmt).parse(output, call_ids(1), TOOLS)
    assert read(ours.tool_calls) == read(theirs.tool_calls) == calls
    assert ours.content == theirs.content


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@SETTINGS
@given(data=st.data())
def test_sglang_stream_gives_the_calls_of_its_whole_parse(fmt: str, data: st.DataObject) -> None:
    text, output, calls, _ = data.draw(outputs(fmt))
    assume(fmt != "llama3" or not re.search(r":[^']*'[^']*'", output))  # its stream cuts these short (docstring)
    assume(not _quotes_dropped(fmt, calls))  # (docstring)
    normal, streamed = streamed_by_sglang(fmt, tokens(output))  # a token a piece, as SGLang's server streams
    assert streamed == (calls[:1] if fmt == "mistral" else calls)  # mistral: the list's first call (docstring)
    if fmt == "mistral":  # the rest of the list comes out as normal text (docstring)
        normal = normal.split(", {")[0]
    if fmt != "gpt-oss":  # its stream passes the analysis through as normal text
        assert normal.strip() == text.strip()  # its streams keep whitespace as it comes, or strip it


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@settings(SETTINGS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_edge_stream_shows_what_it_records_and_records_the_whole_parse(fmt: str, data: st.DataObject,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    _, output, _, pieces = data.draw(outputs(fmt))
    replies = ReplyParser(sglang(fmt), reasoning=REASONING.get(fmt))
    whole = replies.parse(output, call_ids(4), tools=TOOLS)
    stream = replies.stream(call_ids(4), tools=TOOLS)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        deltas = [d for p in pieces for d in stream.feed(p)]
        last, record = stream.finish()
    deltas += last
    assert "changed content already streamed" not in caplog.text
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == record.content
    assert tuple(d.call for d in deltas if isinstance(d, ToolCallReady)) == record.tool_calls == whole.tool_calls
    assert record == whole


def _quotes_dropped(fmt: str, calls: list[Call]) -> bool:
    """Whether SGLang's glm45 reads a string argument of ``calls`` without its quotes (docstring)."""
    return fmt == "glm45" and any(isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] and v[0] in "'\""
                                  for _, args in calls for v in args.values())


def test_sglang_glm45_drops_the_quotes_around_a_string_argument() -> None:
    quoted = [("get_weather", {"city": "''"}), ("search", {"query": '"a b"'})]
    parsed = sglang("glm45").parse(glm45("", quoted), call_ids(1), TOOLS)
    assert read(parsed.tool_calls) == [("get_weather", {"city": ""}), ("search", {"query": "a b"})]
    assert _quotes_dropped("glm45", quoted) and not _quotes_dropped("hermes", quoted)


def test_sglang_stream_divergences_are_as_documented() -> None:
    """Pieces of several tokens (a batched engine's chunks): SGLang's hermes stream loses the second
    call of a piece that ends one call and starts the next; mistral's reads only a list's first call;
    llama3's cuts ``":''"`` short."""
    two = [("search", {"query": "a"}), ("get_weather", {"city": "b"})]
    output = hermes("", two)
    cut = output.index("}}\n</tool_call>")
    assert streamed_by_sglang("hermes", [output[:cut], output[cut:]]) == ("", two[:1])
    normal, calls = streamed_by_sglang("mistral", tokens(mistral("", two)))
    assert calls == two[:1] and '"get_weather"' in normal
    quoted = [("search", {"query": ":''"})]
    with pytest.raises(json.JSONDecodeError):  # '{"query": ":' : the argument's JSON cut short
        streamed_by_sglang("llama3", tokens(llama3("", quoted)))
    assert read(sglang("llama3").parse(llama3("", quoted), call_ids(1), TOOLS).tool_calls) == quoted
    for name in ("hermes", "mistral"):  # the whole parses and the edge's streams are right
        assert read(sglang(name).parse(FORMATS[name][0]("", two), call_ids(1), TOOLS).tool_calls) == two


REASONING_FORMATS = ("qwen3", "deepseek-r1", "glm45", "kimi_k2", "minimax")  # <think> ... </think> ahead of the reply


@pytest.mark.parametrize("fmt", REASONING_FORMATS)
@SETTINGS
@given(reasoning=TEXT.map(str.strip).filter(bool), content=TEXT.map(str.strip).filter(bool), data=st.data())
def test_sglang_reasoning_streamed_equals_whole_and_reads_what_ours_reads(fmt: str, reasoning: str, content: str,
                                                                          data: st.DataObject) -> None:
    """Reasoning and content: SGLang's keep the newlines around the reasoning and ahead of the
    content, which ours strips; otherwise the same, streamed or whole. (Whitespace-only content
    aside: SGLang's streams drop what its whole parse keeps.)"""
    output = f"<think>\n{reasoning}\n</think>\n\n{content}"
    sglang_reasoning = make_reasoning(f"sglang:{fmt}")
    whole = sglang_reasoning.split(output)
    stream = sglang_reasoning.stream()
    pieces = [p for chunk in data.draw(chunked(output)) for p in stream.feed(chunk)]
    pieces += stream.finish()
    streamed = ("".join(t for k, t in pieces if k == "reasoning") or None, "".join(t for k, t in pieces
                                                                              if k == "content"))
    assert streamed == whole == (f"\n{reasoning}\n", f"\n\n{content}")
    assert make_reasoning("think").split(output) == (reasoning or None, content)
