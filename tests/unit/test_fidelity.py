"""The startup probes: prefix stability of the chat template, and the tool format matching it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

import edge.tokens.fidelity as fidelity
from edge.settings import EdgeSettings
from edge.tokens.fidelity import check_codec, load_codec, probe_incremental, probe_tool_format
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers import make_parser
from edge.tokens.template import builtin_template_source
from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from rollbus.cli import main
from schemas.errors import CodecMismatch, TemplateNotIncremental
from stack.runtime import build_edge_service

QWEN3 = builtin_template_source("qwen3")
QWEN25 = builtin_template_source("qwen2.5")


def _replaced(source: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert old in source, old
        source = source.replace(old, new, 1)
    return source


# Qwen3's official behaviour: reasoning only for assistant turns after the last user message.
STRIPS_PAST_REASONING = _replaced(
    QWEN3,
    ("{%- for message in messages -%}",
     "{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
     "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for message in messages -%}"),
    ("message.reasoning_content is not none -%}",
     "message.reasoning_content is not none and loop.index0 > ns.last_user -%}"),
)
MARKS_LAST_USER = _replaced(
    QWEN25,
    ("{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}",
     "{{- '<|im_start|>user\\n' + content + (' (answer now)' if loop.last else '') + '<|im_end|>\\n' -}}"),
)
COUNTS_MESSAGES = _replaced(
    QWEN25,
    ("{{- '<|im_start|>system\\n' + system", "{{- '<|im_start|>system\\n' + (messages | length | string) + system"),
)
NOTES_TOOL_RESULTS = _replaced(
    QWEN25,
    ("{{- '<|im_start|>system\\n' + system",
     "{{- '<|im_start|>system\\n' + ('(tools were used) ' if messages | selectattr('role', 'eq', 'tool') | list"
     " else '') + system"),
)
NO_TOOL_CALLS = _replaced(QWEN25, ("message.role == 'assistant' and message.tool_calls", "false"))
ENDS_TURNS_OTHERWISE = QWEN25.replace("{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}",
                                      "{{- '<|im_start|>assistant\\n' + content + '<|endoftext|>\\n' -}}")
# Llama 3.1's way, on ChatML: one call per turn as {"name", "parameters"}, content dropped.
LLAMA_CALLS = _replaced(
    QWEN25,
    ("{{- '<|im_start|>assistant' -}}\n        {%- if content -%}\n"
     "            {{- '\\n' + content -}}\n        {%- endif -%}",
     "{%- if message.tool_calls | length > 1 -%}{{- raise_exception('one tool call at a time') -}}{%- endif -%}"
     "{{- '<|im_start|>assistant\\n' -}}"),
    ("{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' + arguments + '}\\n</tool_call>' -}}",
     "{{- '{\"name\": \"' + fn.name + '\", \"parameters\": ' + arguments + '}' -}}"),
)


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture(scope="module")
def saved(qwen: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen.save(tmp_path_factory.mktemp("qwen"))


def with_template(saved: Path, tmp_path: Path, source: str) -> str:
    """A tokenizer directory like ``saved`` with chat template ``source``; its spec for ``--tokenizer``."""
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        (directory / name).symlink_to(saved / name)
    config = json.loads((saved / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": source}))
    return str(directory)


@pytest.mark.parametrize(("tokenizer", "tool_format"), [
    ("builtin:qwen2.5", "hermes"), ("builtin:qwen3", "hermes"), ("builtin:qwen3-coder", "qwen3_coder"),
    ("builtin:qwen2.5", "none"), ("builtin:qwen3-coder", "none"),
])
def test_builtin_templates_pass_with_their_tool_format(tokenizer: str, tool_format: str) -> None:
    codec, parser = load_codec(tokenizer, tool_format)
    assert probe_incremental(codec).ok and probe_tool_format(codec, parser).ok
    assert parser.name == tool_format


def test_a_template_that_strips_past_reasoning_is_not_prefix_stable(saved: Path, tmp_path: Path) -> None:
    codec = TemplateCodec(load_tokenizer(with_template(saved, tmp_path, STRIPS_PAST_REASONING)))
    tools, one_call, no_tools = probe_incremental(codec).problems  # each probe has reasoning in an earlier turn
    assert tools.startswith("not prefix-stable (tools, reasoning, parallel calls): request 3: stored tokens")
    assert "'m_end|>\\n<|im_start|>assistant\\n<think>\\nTwo lookups.\\n</think>\\n' vs" in tools  # where they part
    assert one_call.startswith("not prefix-stable (tools, one call a turn): request 3:")
    assert no_tools.startswith("not prefix-stable (no tools, no system, a turn cut off by length): request 2:")


@pytest.mark.parametrize(("source", "expected"), [
    (STRIPS_PAST_REASONING, r"not prefix-stable \(tools, reasoning, parallel calls\): request 3: .*Two lookups"),
    (MARKS_LAST_USER, r"renders the prompt differently once a reply follows it"),
    (COUNTS_MESSAGES, r"renders the prompt differently once a reply follows it"),
    (NOTES_TOOL_RESULTS, r"not prefix-stable \(tools, .*\): rendering new messages changed the rendering of earlier"),
])
def test_templates_that_rerender_earlier_turns_get_continuous_tokens(saved: Path, tmp_path: Path, source: str,
                                                                     expected: str) -> None:
    codec, _ = load_codec(with_template(saved, tmp_path, source), "hermes")
    assert codec.mode.name == "continuous tokens" and codec.continuous
    assert re.search(expected, codec.mode.reason.removeprefix("not prefix-stable: ")), codec.mode.reason
    assert codec.mode.describe().startswith("continuous tokens: not prefix-stable")


def test_a_template_that_does_not_end_turns_with_eos_is_refused(saved: Path, tmp_path: Path) -> None:
    spec = with_template(saved, tmp_path, ENDS_TURNS_OTHERWISE)
    with pytest.raises(TemplateNotIncremental):
        TemplateCodec(load_tokenizer(spec))
    with pytest.raises(CodecMismatch, match=re.escape("the chat template cannot be served: the chat template does "
                                                      "not end assistant turns with the eos token '<|im_end|>'")):
        load_codec(spec, "hermes")


@pytest.mark.parametrize(("tokenizer", "tool_format", "read_as"), [
    ("builtin:qwen3-coder", "hermes", r"\[\]: tool call is not JSON"),
    ("builtin:qwen2.5", "qwen3_coder", r"\[\]: <tool_call> does not hold one <function=NAME>"),
    ("builtin:qwen3", "llama3", r"\[\]"),
])
def test_a_tool_format_that_does_not_match_the_template_is_refused(tokenizer: str, tool_format: str,
                                                                    read_as: str) -> None:
    with pytest.raises(CodecMismatch, match=rf"--tool-format {tool_format} does not match the template: .*{read_as}"):
        load_codec(tokenizer, tool_format)


def test_a_template_that_does_not_render_tool_calls_matches_no_parser(saved: Path, tmp_path: Path) -> None:
    codec = TemplateCodec(load_tokenizer(with_template(saved, tmp_path, NO_TOOL_CALLS)))
    verdict = probe_tool_format(codec, make_parser("hermes"))
    assert len(verdict.problems) == 1 and "renders tool calls as 'Let me check.'" in verdict.problems[0]


def test_single_call_templates_are_probed_with_one_call(saved: Path, tmp_path: Path) -> None:
    codec = TemplateCodec(load_tokenizer(with_template(saved, tmp_path, LLAMA_CALLS)))
    assert probe_tool_format(codec, make_parser("llama3")).ok
    assert probe_incremental(codec).ok
    assert not probe_tool_format(codec, make_parser("hermes")).ok


def test_verdicts_are_cached_per_template_and_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    codec, parser = load_codec("builtin:qwen3", "hermes")

    def no_probe(*_: object) -> None:
        raise AssertionError("probed again")

    monkeypatch.setattr(fidelity, "probe_incremental", no_probe)
    monkeypatch.setattr(fidelity, "probe_tool_format", no_probe)
    check_codec(codec, parser)
    check_codec(TemplateCodec(codec.tokenizer), make_parser("qwen25"))  # an alias: the same parser
    with pytest.raises(AssertionError, match="probed again"):
        check_codec(codec, make_parser("none"))  # another parser: probed (once)


def test_rollbus_up_refuses_a_mismatched_pair_before_starting_anything(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    # A remote engine (never reached): the local engine's model would refuse this tokenizer first.
    argv = ["up", "--tokenizer", "builtin:qwen3-coder", "--tool-format", "hermes", "--data-dir", str(data),
            "--engine", "sglang", "--engine-url", "http://127.0.0.1:1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollbus: cannot start the edge: tokenizer builtin:qwen3-coder with --tool-format hermes")
    assert "does not match the template" in err and not data.exists()
    assert main(["edge", "--nats", "nats://127.0.0.1:1", "--tool-format", "nope"]) == 2
    assert "unknown tool format 'nope'" in capsys.readouterr().err


def test_the_readme_s_mismatched_pair_example_prints_what_it_shows(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The configuration page's ``rollbus up --tokenizer builtin:qwen3-coder --tool-format hermes`` example, run as
    written (it printed the local model's refusal instead, for it named no remote engine)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    found = re.search(r"^\$ rollbus (up .*--tokenizer builtin:qwen3-coder --tool-format hermes)\n(.*)$", page, re.M)
    assert found is not None, "docs/configuration.md lost its mismatched-pair example"
    assert main([*shlex.split(found[1]), "--data-dir", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err.splitlines()[0] == found[2]  # "rollbus: cannot start the edge: tokenizer ..."
    assert not (tmp_path / "data").exists()


def test_the_edge_service_is_not_built_for_a_mismatched_pair() -> None:
    settings = EdgeSettings(tokenizer="builtin:qwen2.5", tool_format="qwen3_coder")
    with pytest.raises(CodecMismatch, match="--tool-format qwen3_coder does not match the template"):
        build_edge_service(settings, nc=None, engine=None)  # refused before it touches NATS or the engine
