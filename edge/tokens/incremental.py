"""Incremental encoding: the chain's stored tokens are never re-tokenized.

A chain's first request is rendered whole with the chat template. Each later request
renders only its *new* messages, against a fixed three-message stand-in history, and
appends their tokens: the cost of a turn does not grow with the conversation.

The model ends its turn with the template's end-of-turn token (Qwen: ``<|im_end|>``) but
never emits what the template writes after it (Qwen: ``\\n``): that *turn separator*
leads every increment. A turn that ended without the end-of-turn token (``length``, a
stop string) also gets the end-of-turn token first. Invariant (tested, property-based in
``tests/unit/test_incremental_property.py``): decode(stored + increment) equals the
template's full render of the conversation.

That holds only for a *prefix-stable* template, one that never renders an earlier turn
differently once later messages exist. A template is encoded in one of two modes
(:class:`TemplateMode`), which :func:`edge.tokens.fidelity.choose_mode` picks at startup by
probing whole conversations (reasoning, tool calls, tool results):

- **prefix-stable** (the default): the tail of a render is what follows the stand-in
  history's own render, and :meth:`TemplateCodec.increment_text` refuses a request whose new
  messages change it (:class:`TemplateNotIncremental`). Records equal the full render.
- **continuous tokens**, for a template that is not prefix-stable: one that strips the
  reasoning of earlier turns (Qwen3's and DeepSeek-R1's official templates), drops the
  analysis channel from history (gpt-oss's harmony), or marks the last user turn. A chain's
  context is its sampled tokens exactly as generated plus, for each later request, what the
  template writes for the new messages *alone*: the render of the stand-in history and the
  new messages, cut after the stand-in reply's end-of-turn token and the separator, however
  the template now renders that reply and the turns before it. (verl's agent loop builds
  trajectories the same way: it renders the new messages alone and strips the template's
  fixed prefix.) The engine sees and training gets these tokens, the same ones; they are
  not the template's render of the whole conversation, which would rewrite earlier turns.

With a thinking template the model's reasoning (``<think>...</think>``) is part of its
sampled tokens and stays in the trajectory as sampled in either mode; ``builtin:qwen3``
renders earlier reasoning as it was sampled, so it is prefix-stable. A template that does
not end assistant turns with the eos token cannot be served in either mode.

A system message after the first one (Claude Code sends them mid-conversation) is rendered
where it stands, in the prompt and in increments alike, when the template does so
(:attr:`TemplateCodec.mid_system`, probed once); a conversation with one is refused with a
400 otherwise (:meth:`TemplateCodec.check_system_placement`), never dropped or moved.

A message's images are rendered as :attr:`TemplateCodec.image_placeholder` where they stand, in a prompt
and in an increment alike (never through a frame); :mod:`edge.tokens.images` expands each placeholder into
the image's tokens, so an image resent in a later prompt gets the same tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import Message, ToolSpec, template_message, template_tools
from edge.tokens.tokenizer import Tokenizer
from schemas.errors import ChatTemplateError, MalformedRequest, NoRoom, TemplateNotIncremental

_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_REPLY = {"role": "assistant", "content": "\x01rollbus-reply\x01"}  # (found in a render by its text)

# Frames: increments of plain messages (no tool calls, no reasoning) are rendered once per
# *shape* with placeholder contents, then filled in; see TemplateCodec._frame.
Shape = tuple[tuple[str, bool, bool], ...]
Frame = tuple[str, ...]
_MAX_FRAMED = 8
_SENTINEL = "\x01rollbus-field\x01"
_PLACEHOLDER = re.compile("\x00(\\d+)\x00")
_exact_tools = msgspec.json.Encoder()  # key order kept: the template renders the schemas as sent
_TRICKY = ("  \n x\t <b>&amp;</b> {{ y }}\n\n ", "", "\u00e9\u4e2d\U0001f600 ")
_MID_SYSTEM = {"role": "system", "content": "\x01rollbus-mid-system\x01"}


PREFIX_STABLE_MODE = "prefix-stable"
CONTINUOUS_MODE = "continuous tokens"


class TemplateMode(msgspec.Struct, frozen=True, kw_only=True):
    """How a template's chains are encoded: ``prefix-stable`` (records equal the template's full render) or
    ``continuous tokens`` (sampled tokens as generated plus increments), and ``reason``: why, for the latter
    (the probe that found the template not prefix-stable, and how)."""

    name: Literal["prefix-stable", "continuous tokens"] = PREFIX_STABLE_MODE
    reason: str = ""

    @property
    def continuous(self) -> bool:
        return self.name == CONTINUOUS_MODE

    def describe(self) -> str:
        return f"{self.name}: {self.reason}" if self.reason else self.name


PREFIX_STABLE = TemplateMode()


def _parting(before: str, after: str) -> str:
    """Where ``after`` stops continuing ``before``, with a little context."""
    at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(before))
    return f"at character {at}: {before[max(0, at - 20):at + 20]!r} becomes {after[max(0, at - 20):at + 20]!r}"


class TemplateCodec:
    """Prompts and increments for one tokenizer and its chat template."""

    def __init__(self, tokenizer: Tokenizer, *, prompt_cache: int = 1024, mode: TemplateMode = PREFIX_STABLE) -> None:
        """``prompt_cache``: how many first prompts to keep encoded (0: none). ``mode``: how increments are
        cut from a render (see the module docstring); :func:`edge.tokens.fidelity.load_codec` probes which."""
        self.tokenizer = tokenizer
        self.mode = mode
        # What the template gets where a message's image stands: the processor's placeholder text, set by the
        # edge that has one (edge.tokens.images expands it); "": none (images are refused before rendering).
        self.image_placeholder = ""
        self._template = tokenizer.chat_template
        self._eos = tokenizer.eos_token
        self._prompted = self._render(_BASE, add_generation_prompt=True)
        self._history = self._render([*_BASE, _REPLY], add_generation_prompt=False)
        if mode.continuous:
            self.separator = self._history[self._reply_end(self._history, "a conversation ending with it"):]
        else:
            self.separator = self._prefix_stable_separator()
        opened = self._render(_BASE, add_generation_prompt=False)
        if not self._prompted.startswith(opened):
            raise TemplateNotIncremental("the chat template renders the conversation differently once it adds the "
                                         "generation prompt")
        self.generation_prompt = self._prompted[len(opened):]
        self._frames: dict[Shape, Frame | None] = {}
        self.mid_system = self._renders_mid_system()
        self._prompts: BoundedCache[tuple[bytes, tuple[Message, ...]], tuple[int, ...]] | None = (
            BoundedCache(max_items=prompt_cache, max_bytes=16 * 1024 * 1024) if prompt_cache else None)

    @property
    def continuous(self) -> bool:
        return self.mode.continuous

    def _prefix_stable_separator(self) -> str:
        if not self._history.startswith(self._prompted):
            raise TemplateNotIncremental("the chat template renders the prompt differently once a reply follows it "
                                         f"({_parting(self._prompted, self._history)})")
        if not self._history.startswith(self._prompted + _REPLY["content"] + self._eos):
            raise TemplateNotIncremental("the chat template does not end assistant turns with the eos token")
        return self._history[len(self._prompted) + len(_REPLY["content"]) + len(self._eos):]

    def _reply_end(self, rendered: str, where: str) -> int:
        """Where the stand-in reply's turn ends in ``rendered`` (after its end-of-turn token): what the
        template writes after it does not depend on how it renders that turn or the ones before."""
        if rendered.count(_REPLY["content"]) != 1:
            raise TemplateNotIncremental(f"the chat template does not render an assistant reply's text once, as "
                                         f"sent, in {where}")
        end = rendered.index(_REPLY["content"]) + len(_REPLY["content"])
        if not rendered.startswith(self._eos, end):
            raise TemplateNotIncremental(f"the chat template does not end assistant turns with the eos token "
                                         f"{self._eos!r} (in {where}, the reply's text is followed by "
                                         f"{rendered[end:end + 20]!r})")
        return end + len(self._eos)

    def _renders_mid_system(self) -> bool:
        """Whether the template renders a system message that is not the first message where it stands:
        after a user message (as in Claude Code's first request) and after an assistant turn (an
        increment), its content in the text there, the turns before it unchanged. A template may
        instead refuse one, drop it, or move it to the top (:meth:`check_system_placement`)."""
        try:
            first = self._render([*_BASE, _MID_SYSTEM], add_generation_prompt=True)
            later = self._rendered_tail([_MID_SYSTEM])
        except MalformedRequest:
            return False
        before = self._render(_BASE, add_generation_prompt=False)
        mark = _MID_SYSTEM["content"]
        return first.startswith(before) and mark in first[len(before):] and mark in later

    def check_system_placement(self, messages: Sequence[Message]) -> None:
        """Refuse (:class:`ChatTemplateError`, a 400) a system message after the first message when the
        template cannot render one there (:attr:`mid_system`): it would be refused, dropped or moved.
        The words match what Claude Code recognises to fall back to sending such messages in user turns."""
        if self.mid_system:
            return
        late = next((i for i, m in enumerate(messages) if i and m.role == "system"), None)
        if late is not None:
            preview = messages[late].content[:40]
            raise ChatTemplateError(
                f"role 'system' is not supported mid-conversation by the chat template of {self.tokenizer.name}: "
                f"it renders a system message only as the first message, and message {late} of the conversation "
                f"is one ({preview!r}...); send its text in a user message instead", param="messages")

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        return self._template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def prompt_text(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> str:
        return self.full_text(messages, tools, add_generation_prompt=True)

    def full_text(self, messages: Sequence[Message], tools: Sequence[ToolSpec], *,
                  add_generation_prompt: bool) -> str:
        """The template's render of the whole conversation (what incremental encoding must equal)."""
        return self._render(
            [template_message(m, self.image_placeholder) for m in messages],
            tools=template_tools(tuple(tools)),
            add_generation_prompt=add_generation_prompt,
        )

    def _encode(self, text: str, room: int | None) -> list[int]:
        """``room``: the most tokens that can follow; :class:`NoRoom` when ``text`` cannot fit."""
        if room is not None and self.tokenizer.min_tokens(text) >= room:
            raise NoRoom(f"{len(text)} characters need at least {self.tokenizer.min_tokens(text)} tokens; "
                         f"{room} fit")
        return self.tokenizer.encode(text)

    def encode_prompt(self, messages: Sequence[Message], tools: Sequence[ToolSpec], *,
                      room: int | None = None) -> list[int]:
        """The tokens of a new chain's prompt. Cached by the exact messages and tools: RL rollouts
        start several sessions (GRPO's samples of one prompt) with the same first request, and
        sub-agents restart from the same instructions."""
        if self._prompts is None:
            return self._encode(self.prompt_text(messages, tools), room)
        key = (_exact_tools.encode(tools) if tools else b"", tuple(messages))
        ids = self._prompts.get(key)
        if ids is None:
            ids = tuple(self._encode(self.prompt_text(messages, tools), room))
            self._prompts.put(key, ids, 8 * len(ids) + len(key[0]) +
                             sum(len(m.content) + sum(len(i.data) for i in m.images) for m in messages))
        return list(ids)

    def increment_text(self, new_messages: Sequence[Message], *, ended_with_eos: bool) -> str:
        """The text that follows a chain's last sampled token, up to the next generation prompt."""
        lead = self.separator if ended_with_eos else self._eos + self.separator
        return lead + self._tail(new_messages)

    def _tail(self, new_messages: Sequence[Message]) -> str:
        """The rendering of ``new_messages`` after an assistant turn, with the generation prompt."""
        frame = self._frame(new_messages)
        if frame is not None:
            return frame[0] + "".join(m.content + part for m, part in zip(new_messages, frame[1:], strict=True))
        return self._rendered_tail([template_message(m, self.image_placeholder) for m in new_messages])

    def _rendered_tail(self, messages: list[dict[str, Any]]) -> str:
        """What the template writes for ``messages`` after the stand-in history, with the generation prompt:
        prefix-stable, the render less the history's; continuous, what follows the stand-in reply's end and
        the separator, however the template now renders that reply and the turns before it."""
        rendered = self._render([*_BASE, _REPLY, *messages], add_generation_prompt=True)
        if not self.mode.continuous:
            if not rendered.startswith(self._history):
                raise TemplateNotIncremental("rendering new messages changed the rendering of earlier ones "
                                             f"({_parting(self._history, rendered)})")
            return rendered[len(self._history) :]
        end = self._reply_end(rendered, "a conversation continuing after it")
        if not rendered.startswith(self.separator, end):
            raise TemplateNotIncremental(f"the chat template writes {rendered[end:end + 20]!r} after an assistant "
                                         f"turn that messages follow, not the turn separator {self.separator!r}")
        return rendered[end + len(self.separator):]

    def _frame(self, messages: Sequence[Message]) -> Frame | None:
        """The literal text around each message's content, for messages of this shape, if the
        template inserts contents verbatim (checked once per shape against a real render)."""
        if len(messages) > _MAX_FRAMED or any(m.tool_calls or m.reasoning is not None or m.images for m in messages):
            return None
        shape: Shape = tuple((m.role, m.name is not None, m.tool_call_id is not None) for m in messages)
        if shape not in self._frames:
            self._frames[shape] = self._build_frame(shape)
        return self._frames[shape]

    def _build_frame(self, shape: Shape) -> Frame | None:
        def messages(contents: Sequence[str]) -> list[dict[str, Any]]:
            return [{"role": role, "content": content, **({"name": _SENTINEL} if named else {}),
                     **({"tool_call_id": _SENTINEL} if with_id else {})}
                    for (role, named, with_id), content in zip(shape, contents, strict=True)]

        placeholders = [f"\x00{i}\x00" for i in range(len(shape))]
        try:
            tail = self._rendered_tail(messages(placeholders))
            found = [int(i) for i in _PLACEHOLDER.findall(tail)]
            if _SENTINEL in tail or found != list(range(len(shape))):
                return None
            frame = tuple(_PLACEHOLDER.split(tail)[::2])
            for tricky in _TRICKY:  # the template must not trim, escape or reformat contents
                filled = frame[0] + "".join(tricky + part for part in frame[1:])
                if filled != self._rendered_tail(messages([tricky] * len(shape))):
                    return None
        except MalformedRequest:  # the template refuses this shape: render each time (and fail there)
            return None
        return frame

    def rewrite_text(self, new_messages: Sequence[Message]) -> str:
        """What follows a generation prompt when ``new_messages`` start with an assistant message
        that replaces the one sampled there (a rolled-back reply), up to the next generation prompt."""
        tail = self._tail(new_messages)
        if not new_messages or new_messages[0].role != "assistant" or not tail.startswith(self.generation_prompt):
            raise TemplateNotIncremental("a rewritten reply must start with the template's generation prompt")
        return tail[len(self.generation_prompt):]

    def encode_rewrite(self, new_messages: Sequence[Message], *, room: int | None = None) -> list[int]:
        return self._encode(self.rewrite_text(new_messages), room)

    def encode_increment(self, new_messages: Sequence[Message], *, last_token: int,
                         room: int | None = None) -> list[int]:
        ended = last_token == self.tokenizer.eos_token_id
        return self._encode(self.increment_text(new_messages, ended_with_eos=ended), room)

    def reply_text(self, token_ids: Sequence[int]) -> str:
        """The sampled text without its end-of-turn token (what the agent sees)."""
        if token_ids and token_ids[-1] in self.tokenizer.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids)
