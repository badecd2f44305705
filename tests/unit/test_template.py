"""The chat template environment and our Qwen2.5 template: exact renders, prefix stability."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.tokens.template import ChatTemplate, builtin_template_source
from schemas.errors import ChatTemplateError

DEFAULT_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, e.g. <Zürich> & 'Köln'",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    return ChatTemplate(builtin_template_source("qwen2.5"), eos_token="<|im_end|>")


def test_default_system_prompt_and_generation_prompt(qwen: ChatTemplate) -> None:
    rendered = qwen.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_given_system_prompt_replaces_the_default(qwen: ChatTemplate) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert qwen.render(messages) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_tool_conversation_renders_exactly(qwen: ChatTemplate) -> None:
    messages = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather and time in Zürich?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "Sunny, 21°C"},
        {"role": "tool", "tool_call_id": "b", "content": "14:05"},
        {"role": "user", "content": "Thanks!"},
    ]
    expected = (
        "<|im_start|>system\nYou check the weather.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather for a city, e.g. <Zürich> & \'Köln\'", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
        '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather and time in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\nLet me look.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny, 21°C\n</tool_response>\n"
        "<tool_response>\n14:05\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert qwen.render(messages, tools=[WEATHER_TOOL, TIME_TOOL], add_generation_prompt=True) == expected


def test_tools_without_system_use_the_default_prompt(qwen: ChatTemplate) -> None:
    rendered = qwen.render([{"role": "user", "content": "hi"}], tools=[TIME_TOOL])
    assert rendered.startswith(DEFAULT_SYSTEM.removesuffix("<|im_end|>\n") + "\n\n# Tools\n")


def test_tool_call_without_content_or_function_wrapper(qwen: ChatTemplate) -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {}}]}]
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert qwen.render(messages) == DEFAULT_SYSTEM + f"<|im_start|>assistant\n{call}<|im_end|>\n"


def test_content_parts_concatenate_their_text(qwen: ChatTemplate) -> None:
    parts = [
        {"type": "text", "text": "look at "},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "this"},
    ]
    as_parts = qwen.render([{"role": "system", "content": parts[:1]}, {"role": "user", "content": parts}])
    as_text = qwen.render([{"role": "system", "content": "look at "}, {"role": "user", "content": "look at this"}])
    assert as_parts == as_text


def test_unknown_role_is_rejected(qwen: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="unknown message role: critic"):
        qwen.render([{"role": "critic", "content": "meh"}])


_ROLES = st.sampled_from(["system", "user", "assistant", "assistant_calls", "tool"])
_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)


@st.composite
def _message(draw: st.DrawFn) -> dict:
    role = draw(_ROLES)
    content = draw(st.one_of(_TEXT, st.lists(st.builds(lambda t: {"type": "text", "text": t}, _TEXT), max_size=2)))
    if role != "assistant_calls":
        return {"role": role, "content": content}
    arguments = st.one_of(st.dictionaries(st.text(max_size=4), st.integers() | _TEXT, max_size=2), _TEXT)
    calls = draw(st.lists(st.fixed_dictionaries({"name": _TEXT, "arguments": arguments}), min_size=1, max_size=2))
    return {"role": "assistant", "content": content, "tool_calls": [{"function": c} for c in calls]}


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_message(), max_size=8), with_tools=st.booleans())
def test_prefix_stable(qwen: ChatTemplate, messages: list[dict], with_tools: bool) -> None:
    """Appending a message never changes the rendering of earlier ones.

    Two exceptions, both Qwen2.5's format: a system message may only come first (it
    replaces the default prompt), and a tool result that follows a tool result joins
    the same user turn, so the turn closed after the first one is reopened.
    """
    tools = [TIME_TOOL] if with_tools else None
    for k in range(len(messages)):
        joins_tool_turn = k > 0 and messages[k]["role"] == messages[k - 1]["role"] == "tool"
        if messages[k]["role"] == "system" or joins_tool_turn:
            continue
        assert qwen.render(messages[: k + 1], tools=tools).startswith(qwen.render(messages[:k], tools=tools))


def test_consecutive_tool_results_share_one_turn(qwen: ChatTemplate) -> None:
    one = [{"role": "tool", "content": "1"}]
    assert qwen.render(one).endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n")
    two = qwen.render([*one, {"role": "tool", "content": "2"}])
    assert two.endswith("</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n")


def test_tojson_is_plain_json_dumps_like_transformers() -> None:
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}")
    value = {"s": "<é> & 'q'", "n": [1, None]}
    assert template.render([], x=value) == (
        '{"s": "<é> & \'q\'", "n": [1, null]}|{\n  "s": "<é> & \'q\'",\n  "n": [\n    1,\n    null\n  ]\n}'
        '|{"s":"<é> & \'q\'","n":[1,null]}'
    )


def test_special_tokens_and_kwargs_reach_the_template() -> None:
    source = "{% if bos_token is defined %}{{ bos_token }}{% endif %}{{ eos_token }}{{ flavor }}"
    assert ChatTemplate(source, bos_token="<s>", eos_token="</s>").render([], flavor="!") == "<s></s>!"
    assert ChatTemplate(source, eos_token="</s>").render([], flavor="?") == "</s>?"


def test_environment_trims_blocks_and_allows_loop_controls() -> None:
    source = "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n{{ m }}\n{% endfor %}"
    assert ChatTemplate(source).render(["a", "b", "c"]) == "a\nb\n"


def test_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="no way"):
        ChatTemplate("{{ raise_exception('no way') }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% if %}")


def test_unknown_builtin_template() -> None:
    with pytest.raises(ValueError, match="no builtin chat template named 'nope'"):
        builtin_template_source("nope")


@pytest.fixture(scope="module")
def qwen3() -> ChatTemplate:
    return ChatTemplate(builtin_template_source("qwen3"), eos_token="<|im_end|>")


def test_qwen3_renders_reasoning_of_every_turn_as_sampled(qwen3: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
        {"role": "tool", "content": "14:05"},
        {"role": "assistant", "content": "4", "reasoning_content": " 2+2=4\n"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    assert qwen3.render(messages, add_generation_prompt=True) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"  # no default system prompt
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n14:05\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n 2+2=4\n\n</think>\n\n4<|im_end|>\n"  # verbatim, though before the last query
        "<|im_start|>user\nand 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n"  # no reasoning: no <think> block
        "<|im_start|>assistant\n"
    )


def test_qwen3_tools_prompt_matches_qwen25_without_the_default_system(qwen: ChatTemplate, qwen3: ChatTemplate) -> None:
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert qwen3.render(with_system, tools=[TIME_TOOL]) == qwen.render(with_system, tools=[TIME_TOOL])
    alone = qwen3.render([{"role": "user", "content": "hi"}], tools=[TIME_TOOL])
    assert alone.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
