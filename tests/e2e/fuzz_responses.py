"""Hypothesis strategies for fuzzing the OpenAI Responses wire (:mod:`tests.e2e.test_fuzz`), built from
the leaves of :mod:`tests.e2e.fuzz_payloads`: valid requests (items: messages, reasoning, function
calls and outputs; function, namespace and hosted tools), with now and then what rollbus refuses: an
item or part it does not serve, a forced tool, JSON output, a forged reasoning reference, a
``previous_response_id`` it never issued."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.e2e.fuzz_payloads import arguments, schemas, short_text, text, weighted

responses_parts = st.lists(st.builds(lambda t: {"type": "input_text", "text": t}, text), min_size=1, max_size=3)
responses_content = weighted((6, text), (2, responses_parts))
FORGED_REFERENCES = ["rbr1." + "a" * 32 + ".1." + "A" * 24, "gAAAAABoT3BlbkFJ", "", "rbr1.x.1.y"]
UNSERVED_ITEMS = [{"type": "item_reference", "id": "msg_1"},
                  {"type": "web_search_call", "id": "ws", "status": "completed"},
                  {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
                  {"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]


@st.composite
def responses_call(draw: st.DrawFn, index: int) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function_call", "call_id": draw(st.one_of(st.just(f"call_{index}"), short_text)),
                            "name": draw(short_text), "arguments": draw(arguments)}
    if draw(st.integers(0, 3)) == 0:
        call["namespace"] = draw(st.sampled_from(["crm", "multi_agent_v1", ""]))
    return call


@st.composite
def responses_turn(draw: st.DrawFn, turn: int) -> list[dict[str, Any]]:
    """An assistant turn as items (reasoning, a message, calls) and what follows it (outputs, a user message)."""
    items: list[dict[str, Any]] = []
    if draw(st.integers(0, 2)) == 0:
        reasoning: dict[str, Any] = {"type": "reasoning", "summary": [{"type": "summary_text", "text": draw(text)}]}
        if draw(st.booleans()):
            reasoning["encrypted_content"] = draw(st.sampled_from(FORGED_REFERENCES))
        items.append(reasoning)
    if draw(st.booleans()):
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": draw(text)}]})
    calls = [draw(responses_call(turn * 10 + i)) for i in range(draw(st.integers(0, 2)))]
    items += calls
    items += [{"type": "function_call_output", "call_id": call["call_id"], "output": draw(responses_content)}
              for call in calls]
    if draw(st.integers(0, 19)) == 0:
        items.append(draw(st.sampled_from(UNSERVED_ITEMS)))
    return [*items, {"role": "user", "content": draw(responses_content)}]


@st.composite
def responses_items(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A user message, then maybe an assistant turn and the user's answer; sometimes after a system or
    developer message."""
    items: list[dict[str, Any]] = []
    if draw(st.booleans()):
        items.append({"type": "message", "role": draw(st.sampled_from(["system", "developer"])),
                      "content": draw(responses_content)})
    items.append({"role": "user", "content": draw(responses_content)})
    for turn in range(draw(st.integers(0, 1))):  # longer histories: the tests extend accepted ones
        items += draw(responses_turn(turn))
    return items


responses_function = st.builds(lambda name, desc, params: {"type": "function", "name": name, "description": desc,
                                                           "parameters": params, "strict": False},
                               short_text, st.one_of(st.none(), text), schemas)
responses_tools = st.lists(weighted(
    (6, responses_function),
    (1, st.builds(lambda fns: {"type": "namespace", "name": "crm", "description": "CRM.", "tools": fns},
                  st.lists(responses_function, max_size=2))),
    (1, st.sampled_from([{"type": "web_search", "external_web_access": False}, {"type": "file_search"},
                         {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "custom", "name": "p"},
                         {"type": "image_generation"}])),
), max_size=3)

RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "instructions": text,
    "tools": responses_tools,
    "tool_choice": st.sampled_from(["auto", "none", "auto", "none", "required", {"type": "function", "name": "f"},
                                    {"type": "web_search"}, {"type": "allowed_tools", "mode": "auto", "tools": []}]),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "parallel_tool_calls": st.booleans(),
    "reasoning": st.builds(lambda e, s: {"effort": e, "summary": s}, st.sampled_from(["low", "high", None]),
                           st.sampled_from(["auto", "concise", None])),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "text"}}, {"verbosity": "low"},
                             {"format": {"type": "json_object"}}]),
    "include": st.lists(st.sampled_from(["reasoning.encrypted_content", "message.output_text.logprobs", "x"]),
                        max_size=2),
    "store": st.booleans(),
    "metadata": st.dictionaries(short_text, short_text, max_size=2),
    "client_metadata": st.dictionaries(short_text, short_text, max_size=2),
    "prompt_cache_key": short_text,
    "user": short_text,
    "truncation": st.sampled_from(["auto", "disabled"]),
    "service_tier": st.sampled_from(["auto", "default"]),
    "previous_response_id": st.sampled_from(["resp_" + "f" * 32 + "_1", "resp_x_1", "nope", ""]),
    "background": st.sampled_from([False, False, True]),
}


@st.composite
def responses_request(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.sampled_from(["m", "", "gpt-5"])),
                            "max_output_tokens": draw(st.integers(1, 8)),
                            "input": draw(weighted((4, responses_items()), (1, text)))}
    for name in draw(st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=3, unique=True)):
        body[name] = draw(RESPONSES_FIELDS[name])
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    return body
