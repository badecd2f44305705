"""Codec fidelity probes: which mode a chat template is encoded in (prefix-stable or continuous
tokens, and why), and does the tool format match it? The edge runs them once at startup and
refuses to start only for what cannot be served at all.

**Prefix stability.** A chain's sampled tokens are stored as the engine produced them and
every later request appends only the rendering of its new messages
(:class:`~edge.tokens.incremental.TemplateCodec`). That equals the template's render of the
conversation only if the template never re-renders an earlier turn differently once later
messages exist. Templates that strip the reasoning of earlier turns (Qwen3's official one),
drop an analysis channel (harmony), mark the last user message, or count messages are not
prefix-stable. :func:`probe_incremental` replays representative
conversations exactly as the edge would (system / user / assistant with reasoning and tool
calls / tool results / user, with and without tools, a turn cut off by ``length``): the
first request is encoded whole, each assistant turn appends what a model emits for it
(the template's rendering of its body plus the end-of-turn token), each later request
appends :meth:`~edge.tokens.incremental.TemplateCodec.encode_increment`, and after every
step the stored tokens must decode to the template's full render.

**Modes.** :func:`choose_mode` gives a template that passes every probe the prefix-stable
mode, and one that does not the continuous-tokens mode (the sampled tokens as generated plus
increments rendered for the new messages alone), its reason the first probe that failed and
how. :func:`probe_continuous` then checks that each increment is what the template writes
for the new messages at the end of the whole conversation's render: a template whose
rendering of new messages depends on the turns before them (one that numbers turns), or
whose assistant turns do not end with the eos token, cannot be served and is refused.

**Tool format.** :func:`probe_tool_format` renders an assistant tool-call turn with the
template, decodes it as the edge would decode a sampled reply, and checks that the
configured parser reads the same calls back (names and arguments): a template that writes
Qwen3-Coder XML with ``--tool-format hermes`` fails here, and so does one that does not
render tool calls at all.

Verdicts are cached per template (tokenizer name, template source, end-of-turn token), mode
and parser name, so probing costs nothing after the first time. :func:`check_codec` raises
:class:`CodecMismatch` (a :class:`ValueError`: a configuration error) listing every
problem found.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import msgspec

from edge.chat.conversation import Message, ToolSpec
from edge.chat.digest import canonical_arguments
from edge.tokens.incremental import CONTINUOUS_MODE, TemplateCodec, TemplateMode
from edge.tokens.parsers import make_parser
from edge.tokens.parsers.base import ToolParser
from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from schemas.errors import (
    ChatTemplateError,
    CodecMismatch,
    MalformedRequest,
    TemplateNotIncremental,
    UnfaithfulTemplate,
)
from schemas.events import ToolCall


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


_VERDICTS: dict[tuple[str, ...], Verdict] = {}


def _key(codec: TemplateCodec, *extra: str) -> tuple[str, ...]:
    tokenizer = codec.tokenizer
    mode = (CONTINUOUS_MODE,) if codec.continuous else ()
    return (tokenizer.name, tokenizer.chat_template.source, tokenizer.eos_token, *mode, *extra)


def load_codec(tokenizer: str, tool_format: str) -> tuple[TemplateCodec, ToolParser]:
    """The codec (in the mode :func:`choose_mode` finds) and parser for ``--tokenizer`` / ``--tool-format``,
    checked by :func:`check_codec`; the mode is ``codec.mode``.

    Every configuration error is a :class:`ValueError` (an unknown name, a template that
    does not compile, :class:`CodecMismatch`).
    """
    codec = choose_mode(load_tokenizer(tokenizer))
    parser = make_parser(tool_format)
    check_codec(codec, parser)
    return codec, parser


def choose_mode(tokenizer: Tokenizer) -> TemplateCodec:
    """The codec for ``tokenizer``'s template in the mode it gets: prefix-stable when it passes every probe of
    :func:`probe_incremental`, else continuous tokens, whose :attr:`TemplateMode.reason` is the first probe
    that failed and how. :class:`CodecMismatch` when it cannot be served either way (say, its assistant turns
    do not end with the eos token)."""
    try:
        codec = TemplateCodec(tokenizer)
    except TemplateNotIncremental as exc:
        reason = f"not prefix-stable: {exc}"
    else:
        problems = _cached(_key(codec), lambda: probe_incremental(codec)).problems
        if not problems:
            return codec
        others = f" (and {len(problems) - 1} more probes)" if len(problems) > 1 else ""
        reason = problems[0] + others
    try:
        return TemplateCodec(tokenizer, mode=TemplateMode(name=CONTINUOUS_MODE, reason=reason))
    except TemplateNotIncremental as exc:
        raise CodecMismatch(f"tokenizer {tokenizer.name}: the chat template cannot be served: {exc}") from exc


def check_codec(codec: TemplateCodec, parser: ToolParser) -> None:
    """Raise :class:`CodecMismatch` unless ``codec`` encodes incrementally in its mode (prefix-stable:
    :func:`probe_incremental`; continuous tokens: :func:`probe_continuous`) and ``parser`` matches it."""
    probe = probe_continuous if codec.continuous else probe_incremental
    incremental = _cached(_key(codec), lambda: probe(codec))
    if codec.continuous and incremental.problems:  # in neither mode: one line, the first problem
        others = f" (and {len(incremental.problems) - 1} more probes)" if len(incremental.problems) > 1 else ""
        raise CodecMismatch(f"tokenizer {codec.tokenizer.name}: the chat template cannot be served: it is not "
                            f"prefix-stable, and {incremental.problems[0]}{others}")
    tool_format = _cached(_key(codec, parser.name), lambda: probe_tool_format(codec, parser))
    problems = [*incremental.problems, *tool_format.problems]
    if problems:
        listed = "\n  - ".join(problems)
        raise CodecMismatch(
            f"tokenizer {codec.tokenizer.name} with --tool-format {parser.name} cannot record exact "
            f"trajectories:\n  - {listed}"
        )


def _cached(key: tuple[str, ...], probe: Callable[[], Verdict]) -> Verdict:
    if key not in _VERDICTS:
        _VERDICTS[key] = probe()
    return _VERDICTS[key]


# ---------------------------------------------------------------- what a model emits


def sampled_text(codec: TemplateCodec, history: Sequence[Message], reply: Message,
                 tools: Sequence[ToolSpec]) -> str:
    """What a model emits for ``reply`` after ``history``: its rendered body and the end-of-turn token.

    Raises :class:`UnfaithfulTemplate` when the template renders the assistant turn in a
    way that does not continue its own generation prompt, or ends it otherwise.
    """
    prompt = codec.prompt_text(history, tools)
    rendered = codec.full_text([*history, reply], tools, add_generation_prompt=False)
    opened = rendered.rfind(codec.generation_prompt)  # continuous tokens: the history may render otherwise now
    if rendered.startswith(prompt):
        body = rendered[len(prompt) :]
    elif codec.continuous and opened >= 0:
        body = rendered[opened + len(codec.generation_prompt):]
    else:
        raise UnfaithfulTemplate(
            "an assistant turn does not continue the generation prompt: "
            + _difference(rendered, prompt, ("turn", "generation prompt"))
        )
    ending = codec.tokenizer.eos_token + codec.separator
    if not body.endswith(ending):
        raise UnfaithfulTemplate(f"an assistant turn does not end with {ending!r}: it ends {body[-40:]!r}")
    return body[: len(body) - len(codec.separator)]


def _difference(actual: str, expected: str, labels: tuple[str, str] = ("stored", "render")) -> str:
    """Where two texts first differ, with a little context."""
    at = next((i for i, (a, b) in enumerate(zip(actual, expected, strict=False)) if a != b),
              min(len(actual), len(expected)))
    window = slice(max(0, at - 30), at + 30)
    return f"at character {at}: {labels[0]} {actual[window]!r} vs {labels[1]} {expected[window]!r}"


# ---------------------------------------------------------------- prefix stability


class Round(msgspec.Struct, frozen=True):
    """An assistant turn (``ended``: with the end-of-turn token), then the next request's new messages."""

    reply: Message
    new: tuple[Message, ...] = ()
    ended: bool = True


class Probe(msgspec.Struct, frozen=True):
    name: str
    tools: tuple[ToolSpec, ...]
    first: tuple[Message, ...]
    rounds: tuple[Round, ...]


def probe_incremental(codec: TemplateCodec, probes: Sequence[Probe] | None = None) -> Verdict:
    """Problems found replaying ``probes`` (default: :data:`PROBES`) through ``codec``.

    A template that renders system messages where they stand mid-conversation
    (:attr:`TemplateCodec.mid_system`) is also replayed with some (:data:`MID_SYSTEM`); one that
    does not gets a 400 for such a request instead (:meth:`TemplateCodec.check_system_placement`).
    A probe the template refuses to render (say, parallel tool calls for a template that
    allows one call a turn) is skipped: the edge answers such requests with a 400 anyway.
    At least one probe must run.
    """
    return _replayed(codec, probes, replay, (UnfaithfulTemplate, TemplateNotIncremental), "not prefix-stable")


def _replayed(codec: TemplateCodec, probes: Sequence[Probe] | None,
              run: Callable[[TemplateCodec, Probe], str | None], failures: tuple[type[Exception], ...],
              what: str) -> Verdict:
    """``run`` over ``probes`` (default: :data:`PROBES`, and :data:`MID_SYSTEM` for a template that renders
    system messages mid-conversation): each problem, or ``failures`` raised, named ``what (probe): ...``; a
    probe the template refuses is skipped, unless it refuses them all."""
    chosen = probes if probes is not None else (*PROBES, MID_SYSTEM) if codec.mid_system else PROBES
    problems, refusals = [], []
    for probe in chosen:
        try:
            problem = run(codec, probe)
        except ChatTemplateError as exc:
            refusals.append(f"{probe.name}: {exc}")
            continue
        except failures as exc:
            problem = str(exc)
        if problem is not None:
            problems.append(f"{what} ({probe.name}): {problem}")
    if len(refusals) == len(chosen):
        problems.append(f"the template refused every probe conversation; {refusals[-1]}")
    return Verdict(problems=tuple(problems))


def replay(codec: TemplateCodec, probe: Probe) -> str | None:
    """Run ``probe`` as the edge would; the first disagreement with the full render, if any."""
    decode = codec.tokenizer.decode
    messages = list(probe.first)
    stored = codec.encode_prompt(messages, probe.tools)
    if (problem := _compare(decode(stored), codec.prompt_text(messages, probe.tools), "the first prompt")) is not None:
        return problem
    for number, step in enumerate(probe.rounds, 1):
        sampled = sampled_text(codec, messages, step.reply, probe.tools)
        if not step.ended:
            sampled = sampled.removesuffix(codec.tokenizer.eos_token)
        stored += codec.tokenizer.encode(sampled)
        messages.append(step.reply)
        if not step.new:
            tail = codec.separator if step.ended else codec.tokenizer.eos_token + codec.separator
            full = codec.full_text(messages, probe.tools, add_generation_prompt=False)
            return _compare(decode(stored) + tail, full, f"after turn {number}")
        stored += codec.encode_increment(step.new, last_token=stored[-1])
        messages.extend(step.new)
        full = codec.prompt_text(messages, probe.tools)
        if (problem := _compare(decode(stored), full, f"request {number + 1}")) is not None:
            return problem
    return None


def probe_continuous(codec: TemplateCodec, probes: Sequence[Probe] | None = None) -> Verdict:
    """Problems found replaying ``probes`` (default: :data:`PROBES`, and :data:`MID_SYSTEM` as
    :func:`probe_incremental` chooses) through ``codec`` in continuous-tokens mode: each later request's
    increment must be what the template writes for its new messages after the whole conversation (the end of
    the full render, after the last reply's end-of-turn token and the separator), however the template
    re-renders the turns before them. A template whose rendering of new messages depends on what came before
    (one that numbers turns) cannot be served."""
    return _replayed(codec, probes, replay_continuous, (TemplateNotIncremental,), "not servable as continuous tokens")


def replay_continuous(codec: TemplateCodec, probe: Probe) -> str | None:
    """Each increment of ``probe`` against the end of the full render; the first that differs, if any."""
    messages = list(probe.first)
    codec.encode_prompt(messages, probe.tools)
    for number, step in enumerate(probe.rounds, 1):
        messages.append(step.reply)
        if not step.new:
            return None
        increment = codec.increment_text(step.new, ended_with_eos=step.ended)
        messages.extend(step.new)
        full = codec.prompt_text(messages, probe.tools)
        want = codec.tokenizer.eos_token + codec.increment_text(step.new, ended_with_eos=True)
        if not full.endswith(want):
            end = full[-len(want):]
            return (f"request {number + 1}: the increment is not what the template renders for the new messages "
                    f"after the conversation, {_difference(end, want, ('render', 'increment'))}")
        if codec.tokenizer.decode(codec.tokenizer.encode(increment)) != increment:
            return f"request {number + 1}: the increment's tokens do not decode to its text"
    return None


def _compare(stored: str, full: str, where: str) -> str | None:
    if stored == full:
        return None
    return f"{where}: stored tokens + increment do not decode to the full render, {_difference(stored, full)}"


# ---------------------------------------------------------------- tool format


def probe_tool_format(codec: TemplateCodec, parser: ToolParser) -> Verdict:
    """Whether ``parser`` reads back the tool calls the template renders (``none`` reads none: always fine)."""
    if parser.name == "none":
        return Verdict()
    history = [Message(role="user", content="Weather in Zürich, and search the news?")]
    refused = []
    for reply in _TOOL_REPLIES:
        try:
            text = sampled_text(codec, history, reply, _TOOLS)
        except (UnfaithfulTemplate, MalformedRequest) as exc:
            refused.append(str(exc))
            continue
        return Verdict(problems=_read_back(codec, parser, text, reply))
    return Verdict(problems=(f"the template cannot render an assistant tool call: {refused[-1]}",))


def _read_back(codec: TemplateCodec, parser: ToolParser, text: str, reply: Message) -> tuple[str, ...]:
    body = codec.reply_text(codec.tokenizer.encode(text))
    parsed = parser.parse(body, lambda i: f"probe_{i}", _TOOLS)
    got = [(c.name, canonical_arguments(c.arguments)) for c in parsed.tool_calls]
    want = [(c.name, canonical_arguments(c.arguments)) for c in reply.tool_calls]
    if got == want:
        return ()
    why = f": {parsed.parse_error}" if parsed.parse_error else ""
    shown = body if len(body) <= 160 else body[:160] + "..."
    return (f"--tool-format {parser.name} does not match the template: the template renders tool calls as "
            f"{shown!r}, which the parser reads as {[name for name, _ in got]}{why}",)


# ---------------------------------------------------------------- the probe conversations


def _call(call_id: str, name: str, arguments: dict[str, object]) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _user(text: str) -> Message:
    return Message(role="user", content=text)


def _tool(call_id: str, text: str) -> Message:
    return Message(role="tool", content=text, tool_call_id=call_id)


_TOOLS = (
    ToolSpec(name="get_weather", description="Weather for a city.", parameters={
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    }),
    ToolSpec(name="search", description="Search the news.", parameters={
        "type": "object",
        "properties": {"query": {"type": "string"}, "filters": {"type": "object"},
                       "limit": {"type": ["integer", "null"]}},
    }),
)
_WEATHER = _call("call_0", "get_weather", {"city": "Zürich", "days": 3, "metric": True})
_SEARCH = _call("call_1", "search", {"query": "föhn 2025", "filters": {"lang": ["de", "en"], "safe": False},
                                     "limit": None})
_TOOL_REPLIES = (
    Message(role="assistant", content="Let me check.", tool_calls=(_WEATHER, _SEARCH)),
    Message(role="assistant", tool_calls=(_WEATHER,)),  # templates that allow one call and no content (Llama 3)
)

PROBES = (
    Probe(
        name="tools, reasoning, parallel calls",
        tools=_TOOLS,
        first=(Message(role="system", content="You are a probe."), _user("Weather in Zürich, and search the news?")),
        rounds=(
            Round(Message(role="assistant", content="Let me check.", reasoning="Two lookups.",
                          tool_calls=(_WEATHER, _SEARCH)),
                  (_tool("call_0", "Sunny, 21°C"), _tool("call_1", '{"hits": []}'))),
            Round(Message(role="assistant", content="Sunny; no news.", reasoning="Both answered."),
                  (_user("And tomorrow?"),)),
            Round(Message(role="assistant", tool_calls=(_WEATHER,)), (_tool("call_0", "Rain"),)),
            Round(Message(role="assistant", content="Rain tomorrow.", reasoning="")),
        ),
    ),
    Probe(
        name="tools, one call a turn",
        tools=_TOOLS,
        first=(_user("Weather in Zürich?"),),
        rounds=(
            Round(Message(role="assistant", reasoning="Look it up.", tool_calls=(_WEATHER,)),
                  (_tool("call_0", "Sunny"),)),
            Round(Message(role="assistant", tool_calls=(_SEARCH,)), (_tool("call_1", "[]"), _user("Thanks"))),
            Round(Message(role="assistant", content="You're welcome.")),
        ),
    ),
    Probe(
        name="no tools, no system, a turn cut off by length",
        tools=(),
        first=(_user("hi"),),
        rounds=(
            Round(Message(role="assistant", content="Hello!", reasoning="Greet back."), (_user("again"),)),
            Round(Message(role="assistant", content="Hello ag"), (_user("go on"),), ended=False),
            Round(Message(role="assistant", content="ain.")),
        ),
    ),
)

_system = Message(role="system", content="Available agents: helper, planner.")
MID_SYSTEM = Probe(
    name="system messages mid-conversation (Claude Code's)",
    tools=_TOOLS,
    first=(Message(role="system", content="You are a probe."), _user("Weather in Zürich?"), _system),
    rounds=(
        Round(Message(role="assistant", tool_calls=(_WEATHER,)), (_tool("call_0", "Sunny"), _system)),
        Round(Message(role="assistant", content="Sunny."),
              (Message(role="system", content="Be brief."), _user("And tomorrow?"))),
        Round(Message(role="assistant", content="Rain."), (_system,)),
        Round(Message(role="assistant", content="Done.")),
    ),
)
