"""System messages mid-conversation (Claude Code sends them): a template that renders them where
they stand records them token-exact, first request and increments alike; one that refuses, drops or
moves them is found at startup, still serves every other conversation, and answers such a request
with a 400 whose words Claude Code recognises (it then sends the text in a user turn itself)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge.chat.conversation import Message
from edge.tokens.fidelity import MID_SYSTEM, check_codec, load_codec, probe_incremental, replay
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers import make_parser
from edge.tokens.template import builtin_template_source
from edge.tokens.tokenizer import load_tokenizer
from schemas.errors import ChatTemplateError
from tests.unit.test_fidelity import with_template

QWEN25 = builtin_template_source("qwen2.5")
IN_PLACE = """        {%- if not loop.first -%}
            {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' -}}
        {%- endif -%}"""
FIRST_SYSTEM = """{%- if messages and messages[0].role == 'system' -%}
    {%- set system = messages[0].content -%}"""
REFUSES = QWEN25.replace(IN_PLACE, "{%- if not loop.first -%}{{- raise_exception('System role must come first') -}}"
                                   "{%- endif -%}")
DROPS = QWEN25.replace(IN_PLACE, "")
HOISTS = QWEN25.replace(IN_PLACE, "").replace(
    FIRST_SYSTEM, "{%- if messages and messages[0].role == 'system' -%}\n    {%- set system = messages | "
                  "selectattr('role', 'eq', 'system') | map(attribute='content') | join('\\n') -%}")
UNABLE = {"refuses": REFUSES, "drops": DROPS, "hoists": HOISTS}

# What Claude Code 2.1 matches in a 400's message to retry with the system text in a user turn.
CLAUDE_CODE_FALLBACK = re.compile(r"not supported.*role .{0,2}system|role .{0,2}system.*not supported", re.I)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return load_tokenizer("builtin:qwen2.5").save(tmp_path_factory.mktemp("qwen"))


def test_the_variants_are_qwen25_changed_where_meant() -> None:
    assert IN_PLACE in QWEN25 and FIRST_SYSTEM in QWEN25


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "qwen3-coder", "smollm2"])
def test_builtin_templates_render_system_messages_where_they_stand_token_exact(name: str) -> None:
    codec = TemplateCodec(load_tokenizer(f"builtin:{name}"))
    assert codec.mid_system
    assert replay(codec, MID_SYSTEM) is None
    assert probe_incremental(codec).ok
    codec.check_system_placement([Message(role="user", content="u"), Message(role="system", content="s")])
    text = codec.prompt_text(MID_SYSTEM.first, ())
    assert text.index("Weather in Zürich?") < text.index("Available agents: helper, planner.")


@pytest.mark.parametrize("way", list(UNABLE))
def test_a_template_unable_to_place_them_is_found_and_still_serves_the_rest(saved: Path, tmp_path: Path,
                                                                            way: str) -> None:
    spec = with_template(saved, tmp_path, UNABLE[way])
    codec, _ = load_codec(spec, "hermes")  # the startup checks pass: other conversations are exact
    assert not codec.mid_system
    first = [Message(role="system", content="S"), Message(role="user", content="u")]
    codec.check_system_placement(first)  # a leading system message is the template's system prompt
    late = [*first, Message(role="system", content="Available agent types for the Agent tool: a, b")]
    with pytest.raises(ChatTemplateError) as caught:
        codec.check_system_placement(late)
    error = caught.value
    assert error.param == "messages" and CLAUDE_CODE_FALLBACK.search(f"{error.param}: {error.message}")
    assert "message 2 of the conversation" in error.message and "Available agent types" in error.message
    assert error.message.startswith("role 'system' is not supported mid-conversation")


def test_two_leading_system_messages_are_one_too_many_for_such_a_template(saved: Path, tmp_path: Path) -> None:
    codec = TemplateCodec(load_tokenizer(with_template(saved, tmp_path, DROPS)))
    with pytest.raises(ChatTemplateError):
        codec.check_system_placement([Message(role="system", content="a"), Message(role="system", content="b"),
                                      Message(role="user", content="u")])


def test_such_a_template_is_not_replayed_with_the_mid_system_probe(saved: Path, tmp_path: Path) -> None:
    codec = TemplateCodec(load_tokenizer(with_template(saved, tmp_path, HOISTS)))
    assert not probe_incremental(codec, [MID_SYSTEM]).ok  # it would fail it: the system text moves to the top
    check_codec(codec, make_parser("hermes"))  # but it is not asked to
