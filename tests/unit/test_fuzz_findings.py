"""What the fuzzer (``tests/e2e/test_fuzz.py``) found, each pinned where the bug lived: every one
was a 500 for a request that deserved a 400 or a plain answer."""

from __future__ import annotations

import json

import pytest

from edge.chat.conversation import Message, template_message
from edge.idempotency import retry_count
from edge.tokens.template import ChatTemplate, builtin_template_source
from edge.wires import openai as openai_wire
from schemas.errors import EngineError, MalformedRequest, PayloadTooLarge
from schemas.events import ToolCall

HEADER = "x-stainless-retry-count"


@pytest.mark.parametrize(("value", "count"), [
    ("\xb2", 0),  # "²" (the byte 0xb2, read as latin-1): str.isdigit() says yes, int() raised ValueError
    ("\xb9\xb3", 0),
    ("9" * 5000, 999_999_999_999_999_999),  # int() refuses more than 4300 digits: read as a (huge) count
    ("0" * 5000 + "3", 3),
    ("000", 0),
    (" 2 ", 2),
    ("-1", 0),
])
def test_a_retry_count_header_int_cannot_read_is_no_error(value: str, count: int) -> None:
    assert retry_count({HEADER: value}) == count


def test_openai_tools_with_invalid_utf8_are_a_400_naming_tools() -> None:
    # The tools are kept raw at first (msgspec.Raw, whose UTF-8 is not checked), then decoded: that
    # raised msgspec.DecodeError, which only ValidationError was caught for.
    body = (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
            b'"tools": [{"type": "function", "function": {"name": "f\xff"}}]}')
    with pytest.raises(MalformedRequest) as refused:
        openai_wire.decode_request(body)
    assert refused.value.param == "tools"


LONE_SURROGATE = '{"a": "\\ud800"}'  # valid to json.loads, not to msgspec (nor to any UTF-8 encoder)


@pytest.mark.parametrize("arguments", [
    LONE_SURROGATE,  # the fuzzer's find: the template's tojson raised UnicodeEncodeError (a 500)
    '{"a": ' + "[" * 65 + '"\\ud800"' + "]" * 65 + "}",
    # Not a 500 yet, the same gap: the depth bound is checked with msgspec, which refuses NaN before
    # it sees how deep the value goes, so json.loads handed the template a value 900 levels deep.
    '{"a": NaN}',
    '{"a": ' + "[" * 900 + "NaN" + "]" * 900 + "}",
])
def test_tool_call_arguments_msgspec_refuses_render_as_text(arguments: str) -> None:
    # Arguments are parsed for the template as strictly as they are checked and digested (msgspec):
    # what that refuses is rendered as the text it is, not as what json.loads makes of it.
    message = Message(role="assistant", tool_calls=(ToolCall(id="c", name="f", arguments=arguments),))
    rendered = template_message(message)
    assert rendered["tool_calls"][0]["function"]["arguments"] == arguments
    qwen = ChatTemplate(builtin_template_source("qwen2.5"), eos_token="<|im_end|>")
    text = qwen.render([{"role": "user", "content": "hi"}, rendered, {"role": "user", "content": "ok"}])
    assert arguments in text


def test_tool_call_arguments_that_parse_strictly_still_render_as_an_object() -> None:
    arguments = json.dumps({"path": "a.py", "n": [1, 2]})
    message = Message(role="assistant", tool_calls=(ToolCall(id="c", name="f", arguments=arguments),))
    assert template_message(message)["tool_calls"][0]["function"]["arguments"] == {"path": "a.py", "n": [1, 2]}


# The same str.isdigit()/int() gap, found by reading after the fuzzer's first find.

def test_a_vllm_log_prob_named_with_a_superscript_digit_is_no_crash() -> None:
    from edge.engines.vllm import _Assembler

    assembler = _Assembler(True, chat_logprobs=False)
    reply = {"choices": [{"token_ids": [5, 6], "finish_reason": "stop",
                          "logprobs": {"tokens": ["token_id:\xb2", "token_id:6"], "token_logprobs": [-0.5, -0.25]}}]}
    chunk = assembler.feed(json.dumps(reply))
    assert chunk is not None and chunk.logprobs == (-0.5, -0.25)
    other = {"choices": [{"token_ids": [5], "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5]}}]}
    with pytest.raises(EngineError, match="name other tokens"):
        _Assembler(True, chat_logprobs=False).feed(json.dumps(other))


@pytest.mark.parametrize(("declared", "refused"), [
    ("1" * 5000, True),  # int() refuses more than 4300 digits: it raised ValueError
    ("0" * 5000 + "7", False), ("99999999999999999999", True), ("\xb2", False), ("100", False), ("101", True),
])
def test_a_declared_content_length_int_cannot_read_is_no_error(declared: str, refused: bool) -> None:
    from edge.routes.handling import check_declared_size

    if refused:
        with pytest.raises(PayloadTooLarge):
            check_declared_size({"content-length": declared}, 100)
    else:
        check_declared_size({"content-length": declared}, 100)
