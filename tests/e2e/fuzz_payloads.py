"""Hypothesis strategies for the fuzz tests (:mod:`tests.e2e.test_fuzz`): nearly valid and hostile
bodies for the OpenAI and Anthropic wires and for ``POST /sessions``, and the headers they go with
(the Responses wire's: :mod:`tests.e2e.fuzz_responses`).

A body is drawn structure first: a valid request (a conversation with tool calls and results,
tools, sampling fields, streaming options), then most often one perturbation at a path of it (a
value replaced by one of another type or out of range, a key removed, an unknown key added), and
then, sometimes, a mutation of its bytes (cut short, garbage inside or after it, invalid UTF-8,
a lone surrogate, a byte-order mark, a duplicated key). Leaves are drawn from what breaks parsers
and templates: lone surrogates, the chat template's special tokens, integers past 64 bits,
non-finite floats (written as ``NaN``/``Infinity``, which JSON has not), JSON nested past the
edge's bounds, inside the body or inside a tool call's arguments string.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

# --- leaves -----------------------------------------------------------------------------------------------

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
           "<tool_response>", "x-anthropic-billing-header: cc_version=1;\n", "\x00", "\r\n", "{{ x }}", "{%",
           "\u202e", "\ufeff", "😀", "\\u0000", '"', "\\"]


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each ``weight`` times as likely as a strategy of weight 1."""
    return st.one_of(*[strategy for weight, strategy in choices for _ in range(weight)])


plain_text = st.text(max_size=24)
special_text = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=6)), max_size=4).map("".join)
lone_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
surrogate_text = st.tuples(plain_text, lone_surrogate, plain_text).map("".join)
text = weighted((3, plain_text), (1, special_text))  # what a valid request may hold (no lone surrogate)
short_text = st.one_of(st.just("hi"), st.text(min_size=1, max_size=8), special_text)

huge_ints = st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400, -(10**40)])
odd_floats = st.sampled_from([0.0, -0.0, 0.5, 1e-300, 1e300, float("inf"), float("-inf"), float("nan"), 1.5])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), huge_ints, odd_floats, text, surrogate_text,
                    st.just(""), st.just([]), st.just({}))
clean_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False,
                          allow_infinity=False), text)


def nested(levels: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(inner, max_size=3), st.dictionaries(short_text, inner, max_size=3))


clean_json = st.recursive(clean_scalars, _containers, max_leaves=8)  # JSON a valid request may hold
json_values = st.recursive(scalars, _containers, max_leaves=8)
deep_values = st.sampled_from([63, 65, 100, 300]).map(nested)
hostile = st.one_of(scalars, json_values, deep_values)

# Tool-call arguments, as the string the OpenAI wire carries them in: mostly a JSON object.
arguments = weighted(
    (30, st.dictionaries(short_text, clean_json, max_size=3).map(json.dumps)),
    (1, st.sampled_from(["", "{", "null", "[]", '{"a": NaN}', '{"a": Infinity}', '{"a": 1e999}',
                         '{"a": "\\ud800"}', '{"a": "\\udc00x"}', '"just a string"', "not json", '{"a": 1} trailing',
                         '{"a": ' + "1" * 500 + "}"])),
    (1, st.sampled_from([63, 65, 200, 900, 2000]).map(lambda n: "[" * n + "]" * n)),
    (1, st.sampled_from([63, 65, 200, 900, 2000]).map(lambda n: "[" * n + "NaN" + "]" * n)),
    (1, st.sampled_from([65, 900, 2000]).map(lambda n: '{"a": ' + "[" * n + '"\\ud800"' + "]" * n + "}")),
    (1, st.sampled_from([65, 900, 2000]).map(lambda n: '{"a": ' + "[" * n + "NaN" + "]" * n + "}")),
    (1, st.sampled_from([65, 900]).map(lambda n: "[" * n)),
    (1, text),
)

# --- perturbation -----------------------------------------------------------------------------------------


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out += _paths(child, (*path, index))
    return out


def _parent(root: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        root = root[step]
    return root


@st.composite
def perturbed(draw: st.DrawFn, body: Any) -> Any:
    """A copy of ``body`` with one of its values replaced by a hostile one, removed, or given an
    unknown sibling (a copy: strategies such as ``st.just`` hand out the same object every time)."""
    body = copy.deepcopy(body)
    paths = _paths(body)[1:]  # not the whole body (Hypothesis favours the first choice; NOT_JSON has those)
    if not paths:
        return body
    path = draw(st.sampled_from(paths))
    action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "null"]))
    parent, last = _parent(body, path), path[-1]
    if action == "replace":
        parent[last] = draw(hostile)
    elif action == "null":
        parent[last] = None
    elif action == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[draw(st.one_of(short_text, st.sampled_from(["type", "role", "content", "id", "name"])))] = \
            draw(hostile)
    else:
        parent.insert(draw(st.integers(0, len(parent))), draw(hostile))
    return body


# --- bytes ------------------------------------------------------------------------------------------------


def encode(value: Any, ascii_only: bool = True) -> bytes:
    """``value`` as JSON bytes, lone surrogates written as escapes (``ascii_only``) or as the bytes
    UTF-8 has no place for (the surrogate code point encoded as if it were a character)."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


GARBAGE = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"}", b"]", b",", b'"', b"\\", b"{", b"[", b"NaN",
           b"\xef\xbb\xbf", b'\\ud800', b"\x80\x80", b"\r\n", b"/*", b" garbage"]


@st.composite
def mutated_bytes(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` with one byte-level mutation (what is drawn does not depend on ``raw``, which may come
    from outside the draws: Hypothesis replays them)."""
    kind = draw(st.sampled_from(["truncate", "insert", "replace", "trailing", "bom", "duplicate", "double"]))
    at = draw(st.integers(0, 2**20)) % max(1, len(raw))
    junk = draw(st.one_of(st.sampled_from(GARBAGE), st.binary(min_size=1, max_size=4)))
    key = draw(st.sampled_from([b"messages", b"max_tokens", b"stream", b"tools", b"system", b"metadata"]))
    value = encode(draw(hostile))
    if kind == "truncate":
        return raw[:at]
    if kind == "insert":
        return raw[:at] + junk + raw[at:]
    if kind == "replace":
        return raw[:at] + junk + raw[at + 1:]
    if kind == "trailing":
        return raw + junk
    if kind == "bom":
        return b"\xef\xbb\xbf" + raw
    if kind == "duplicate" and raw.endswith(b"}"):  # a second value for a key: the parser's last wins
        return raw[:-1] + b', "' + key + b'": ' + value + b"}"
    return raw + raw


NOT_JSON = [b"", b" ", b"null", b"[]", b"{}", b'"x"', b"1", b"[" * 5000, b"[" * 5000 + b"]" * 5000, b"{" * 5000,
            b'{"a":' * 2000]


@st.composite
def body_bytes(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> bytes:
    """A body from ``valid`` requests: as is (a quarter), perturbed (two fifths), byte-mutated, both,
    or (one in twenty) no request at all."""
    how = draw(st.integers(0, 19))  # (Hypothesis favours 0: as is)
    if how == 19:
        return draw(st.one_of(st.sampled_from(NOT_JSON), st.binary(max_size=64)))
    value = draw(valid)
    if 5 <= how <= 12 or how >= 16:
        value = draw(perturbed(value))
    raw = encode(value, draw(st.booleans()))
    return draw(mutated_bytes(raw)) if how >= 13 else raw


# --- OpenAI chat completions ------------------------------------------------------------------------------
# What follows draws valid requests, with now and then a well-formed option rollbus refuses (an image,
# n=2, JSON mode, a forced tool): a 400 naming it. Perturbation and byte mutation (above) do the rest.

openai_parts = st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), min_size=1, max_size=3)
openai_content = weighted((6, text), (2, openai_parts), (1, st.none()))
UNSERVED_PARTS = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, {"type": "text"}]


@st.composite
def openai_tool_call(draw: st.DrawFn, index: int) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function", "function": {"name": draw(short_text), "arguments": draw(arguments)}}
    if draw(st.integers(0, 5)):
        call["id"] = draw(st.one_of(st.just(f"call_{index}"), short_text))
    return call


@st.composite
def openai_messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A user message, then maybe an assistant message (tool calls, reasoning) with the calls' results
    and a user message; sometimes after a system (or developer) message."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(openai_content)})
    messages.append({"role": "user", "content": draw(openai_content)})
    for turn in range(draw(st.integers(0, 1))):  # longer histories: the tests extend accepted ones
        calls = [draw(openai_tool_call(turn * 10 + i)) for i in range(draw(st.integers(0, 2)))]
        assistant: dict[str, Any] = {"role": "assistant", "content": draw(st.one_of(st.none(), text))}
        if calls:
            assistant["tool_calls"] = calls
        if draw(st.integers(0, 3)) == 0:
            assistant["reasoning_content"] = draw(text)
        messages.append(assistant)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.get("id", "x"), "content": draw(openai_content)})
        messages.append({"role": "user", "content": draw(openai_content)})
    return messages


schemas = weighted((6, st.just({"type": "object", "properties": {"path": {"type": "string"}}})),
                   (6, st.dictionaries(short_text, clean_json, max_size=3)), (2, st.none()),
                   (1, deep_values.map(lambda v: {"type": "object", "x": v})))
openai_tools = st.lists(st.builds(
    lambda name, desc, params: {"type": "function", "function": {"name": name, "description": desc,
                                                                 "parameters": params}},
    short_text, st.one_of(st.none(), text), schemas), max_size=2)

OPENAI_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 20]),
    "max_completion_tokens": st.integers(1, 8),
    "stop": st.one_of(short_text, st.lists(short_text, max_size=3)),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "n": st.sampled_from([1, 1, 1, 2]),
    "seed": st.integers(0, 2**31),
    "stream_options": st.builds(lambda u: {"include_usage": u}, st.booleans()),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                         {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}]),
        st.builds(lambda schema, strict: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                 "strict": strict}},
                  st.one_of(st.just({"type": "object"}), clean_json), st.booleans())),
    "tool_choice": st.sampled_from(["auto", "none", "auto", "none", "required",
                                    {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.booleans(),
    "user": short_text,
    "metadata": clean_json,
    "frequency_penalty": st.floats(-2, 2),
    "functions": st.just([{"name": "f", "parameters": {}}]),
}


@st.composite
def openai_request(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.sampled_from(["m", "", "gpt-4o"])), "messages": draw(openai_messages()),
                            "max_tokens": draw(st.integers(1, 8))}
    if draw(st.booleans()):
        body["tools"] = draw(openai_tools)
    for name in draw(st.lists(st.sampled_from(sorted(OPENAI_FIELDS)), max_size=3, unique=True)):
        body[name] = draw(OPENAI_FIELDS[name])
    if draw(st.integers(0, 9)) == 0:  # a content part rollbus does not serve
        message = draw(st.sampled_from(body["messages"]))
        message["content"] = [{"type": "text", "text": "a"}, draw(st.sampled_from(UNSERVED_PARTS))]
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    return body


# --- Anthropic messages -----------------------------------------------------------------------------------

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


def text_block(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


text_blocks = st.lists(st.builds(text_block, text), min_size=1, max_size=2)
result_content = weighted((24, text), (12, text_blocks), (1, st.just([IMAGE])), (2, st.none()))
user_content = weighted((24, text), (12, text_blocks), (1, st.just([IMAGE])), (2, st.just([])))
tool_input = weighted((20, st.dictionaries(short_text, clean_json, max_size=2)),
                      (1, deep_values.map(lambda v: {"a": v})))
UNSERVED_BLOCKS = [{"type": "redacted_thinking", "data": "x"}, IMAGE,
                   {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]


@st.composite
def _assistant_turn(draw: st.DrawFn, turn: int) -> list[dict[str, Any]]:
    """An assistant message (thinking, text, tool uses) and the user message after it (the results)."""
    blocks: list[dict[str, Any]] = []
    if draw(st.integers(0, 3)) == 0:
        blocks.append({"type": "thinking", "thinking": draw(text), "signature": draw(short_text)})
    if draw(st.booleans()):
        blocks.append(text_block(draw(text)))
    uses = [{"type": "tool_use", "id": draw(st.one_of(st.just(f"toolu_{turn}{i}"), short_text)),
             "name": draw(short_text), "input": draw(tool_input)} for i in range(draw(st.integers(0, 2)))]
    if draw(st.integers(0, 19)) == 0:
        blocks.append(draw(st.sampled_from(UNSERVED_BLOCKS)))
    results: list[dict[str, Any]] = [
        {"type": "tool_result", "tool_use_id": use["id"], "content": draw(result_content),
         **({"is_error": draw(st.booleans())} if draw(st.booleans()) else {})} for use in uses]
    after = results + draw(st.lists(st.builds(text_block, text), max_size=1)) if results else draw(user_content)
    return [{"role": "assistant", "content": blocks + uses if blocks or uses else draw(text)},
            {"role": "user", "content": after}]


@st.composite
def anthropic_messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A user message, then maybe an assistant message and the user's answer to it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": draw(user_content)}]
    for turn in range(draw(st.integers(0, 1))):  # longer histories: the tests extend accepted ones
        messages += draw(_assistant_turn(turn))
    if draw(st.integers(0, 3)) == 0:  # a system message mid-conversation, as Claude Code sends them
        content = draw(weighted((4, text), (2, text_blocks), (1, st.just([IMAGE]))))
        messages.insert(draw(st.integers(0, len(messages))), {"role": "system", "content": content})
    return messages


BILLING = "x-anthropic-billing-header: cc_version=1;"
system = weighted((4, text), (2, text_blocks), (1, st.builds(lambda t: f"{BILLING}\n{t}", text)),
                  (1, st.builds(lambda t: [text_block(f"{BILLING}{t}"), text_block("s")], text)),
                  (1, st.just([])), (1, st.just([IMAGE])))
anthropic_tools = st.lists(weighted(
    (4, st.builds(lambda name, desc, schema: {"name": name, "description": desc, "input_schema": schema},
                  short_text, st.one_of(st.none(), text), schemas)),
    (1, st.sampled_from([{"type": "bash_20250124", "name": "bash"},
                         {"type": "custom", "name": "f", "input_schema": {"type": "object"},
                          "cache_control": {"type": "ephemeral"}}])),
), max_size=2)

ANTHROPIC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "system": system,
    "tools": anthropic_tools,
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}, {"type": "auto"}, {"type": "any"},
                                    {"type": "tool", "name": "f"},
                                    {"type": "auto", "disable_parallel_tool_use": True}]),
    "stop_sequences": st.lists(short_text, max_size=3),
    "metadata": st.builds(lambda u: {"user_id": u}, short_text),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 40),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                 {"type": "adaptive"}, "adaptive"]),
    "context_management": st.sampled_from([{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, []]),
    "output_config": st.sampled_from([{"effort": "high"}, {"effort": 3}, "high"]),
    "service_tier": st.just("auto"),
}


@st.composite
def anthropic_request(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.sampled_from(["m", "", "claude-x"])),
                            "max_tokens": draw(st.integers(1, 8)), "messages": draw(anthropic_messages())}
    for name in draw(st.lists(st.sampled_from(sorted(ANTHROPIC_FIELDS)), max_size=3, unique=True)):
        body[name] = draw(ANTHROPIC_FIELDS[name])
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    return body


# --- POST /sessions ---------------------------------------------------------------------------------------

METADATA: dict[str, st.SearchStrategy[Any]] = {
    "rollout_n": st.integers(1, 4), "global_steps": st.integers(0, 2**63 - 1), "tq_partition": st.just("train"),
    "attempt": st.integers(-(2**63), 3), "prompt_status_rule": st.sampled_from(["any_success", "all_success", "most"]),
    "trajectory_selection": st.sampled_from(["all", "longest", "shortest"]),
    "mask_unfinished_episode": st.booleans(), "agent_name": short_text, "extra_info": clean_json,
    "data_source": text, "other": weighted((3, clean_json), (1, deep_values)),
}
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.sampled_from([-1, 1, 40, 0]),
    "max_tokens": st.integers(1, 8), "stop": st.one_of(st.lists(short_text, max_size=3), short_text),
}


@st.composite
def session_request(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["uid"] = draw(st.one_of(st.text(alphabet="abcdef0123456789-", min_size=1, max_size=12), short_text))
    if draw(st.booleans()):
        body["session_index"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from(sorted(METADATA)), max_size=3, unique=True))
        body["metadata"] = {key: draw(METADATA[key]) for key in keys}
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=3, unique=True))
        body["sampling"] = {key: draw(SAMPLING[key]) for key in keys}
    return body


# --- headers ----------------------------------------------------------------------------------------------

CONTENT_TYPES = [b"application/json", b"application/json", b"application/json", b"application/json; charset=utf-8",
                 b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"",
                 b"application/json; charset=latin-1", b"\xff\xfe", None]
EXTRA_HEADERS = [(b"idempotency-key", b"k1"), (b"idempotency-key", b""), (b"idempotency-key", b"\xe9\xe9"),
                 (b"idempotency-key", b"x" * 300), (b"x-stainless-retry-count", b"1"),
                 (b"x-stainless-retry-count", b"-1"), (b"x-stainless-retry-count", b"\xb2"),
                 (b"x-stainless-retry-count", b"99999999999999999999999"),
                 (b"x-stainless-retry-count", b"9" * 5000), (b"anthropic-version", b"2023-06-01"),
                 (b"anthropic-beta", b"\xff"), (b"accept", b"text/event-stream"), (b"accept-encoding", b"gzip"),
                 (b"expect", b"100-continue")]


def _header_safe(value: bytes) -> bytes:
    """``value`` as bytes HTTP allows in a header value (visible ASCII and obs-text)."""
    return bytes(b if 0x21 <= b <= 0x7E or b >= 0x80 else 0x3F for b in value)


@st.composite
def header_list(draw: st.DrawFn, key: str) -> list[tuple[bytes, bytes]]:
    """Headers for a request whose valid key is ``key``: mostly right (so the decoder is reached)."""
    headers: list[tuple[bytes, bytes]] = []
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append((b"content-type", content_type))
    auth = draw(st.integers(0, 19))
    raw_key = key.encode()
    if auth <= 12:
        headers.append((b"authorization", b"Bearer " + raw_key))
    elif auth <= 14:
        headers.append((b"x-api-key", raw_key))
    elif auth == 15:
        headers.append((b"authorization", draw(st.sampled_from(
            [b"Bearer", b"bearer  " + raw_key, b"BEARER " + raw_key, b"Basic " + raw_key, b"Bearer \xe9" + raw_key,
             b"Bearer " + raw_key[:-1]]))))
    elif auth == 16:
        headers += [(b"authorization", b"Bearer wrong"), (b"x-api-key", raw_key)]
    elif auth == 17:
        headers.append((b"x-api-key", draw(st.binary(min_size=1, max_size=8).map(_header_safe))))
    # auth 18, 19: no key at all
    for name, value in draw(st.lists(st.sampled_from(EXTRA_HEADERS), max_size=2, unique=True)):
        headers.append((name, value))
    return headers
