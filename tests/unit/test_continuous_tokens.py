"""Continuous-tokens mode: which mode a template gets at startup and why, and the increments of a chain
whose template re-renders earlier turns (strips reasoning, drops an analysis channel, marks the last user
turn): the sampled tokens stay as generated, and each increment is what the template writes for the new
messages alone, whatever it now does to the turns before them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from edge.app import health
from edge.chat.conversation import Message
from edge.service import OpenSession
from edge.settings import EdgeSettings
from edge.tokens.fidelity import choose_mode, load_codec, probe_continuous, sampled_text
from edge.tokens.incremental import TemplateCodec, TemplateMode
from edge.tokens.parsers import make_parser
from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from rollbus.cli import main
from rollbus.testing.engine import HandlerEngine
from rollbus.testing.memory_log import InMemoryLog, in_memory_service
from schemas.errors import CodecMismatch, TemplateNotIncremental
from schemas.events import SessionOpened, ToolCall
from tests import continuous_templates as templates
from tests.continuous_templates import tokenizer_dir

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def codecs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TemplateCodec]:
    """The codec ``load_codec`` chooses for each template (they are probed once each)."""
    sources = {"prefix-stable": templates.PREFIX_STABLE, "strips reasoning": templates.STRIPS_REASONING,
               "drops analysis": templates.DROPS_ANALYSIS, "marks last user": templates.MARKS_LAST_USER}
    return {name: load_codec(tokenizer_dir(tmp_path_factory.mktemp("tokenizer"), source), "hermes")[0]
            for name, source in sources.items()}


def _call(n: int) -> ToolCall:
    return ToolCall(id=f"call_{n}", name="calculator", arguments=json.dumps({"expression": f"{n}*2"}))


@pytest.mark.parametrize(("name", "reason"), [
    ("strips reasoning", r"^not prefix-stable \(tools, reasoning, parallel calls\): request 3: stored tokens \+ "
                         r"increment do not decode to the full render, .*<think>\\nTwo lookups.* "
                         r"\(and 2 more probes\)$"),
    ("drops analysis", r"^not prefix-stable \(tools, reasoning, parallel calls\): request 2: .*<\|channel\|>analysis"),
    ("marks last user", r"^not prefix-stable \(tools, reasoning, parallel calls\): rendering new messages changed "
                        r"the rendering of earlier ones \(at character \d+: .*'.*U \[latest\]<\|im_end.*' becomes "
                        r"'.*U<\|im_end.*'\) \(and 3 more probes\)$"),
])
def test_a_template_that_rerenders_earlier_turns_gets_continuous_tokens_and_why(
        codecs: dict[str, TemplateCodec], name: str, reason: str) -> None:
    mode = codecs[name].mode
    assert mode.name == "continuous tokens" and codecs[name].continuous
    assert re.search(reason, mode.reason), mode.reason
    assert mode.describe() == f"continuous tokens: {mode.reason}"


def test_a_prefix_stable_template_keeps_the_exact_mode(codecs: dict[str, TemplateCodec]) -> None:
    assert codecs["prefix-stable"].mode == TemplateMode() and not codecs["prefix-stable"].continuous
    assert codecs["prefix-stable"].mode.describe() == "prefix-stable"
    for builtin in ("builtin:qwen2.5", "builtin:qwen3", "builtin:qwen3-coder"):
        assert not choose_mode(load_tokenizer(builtin)).continuous, builtin


def test_a_template_whose_increments_depend_on_earlier_turns_is_refused(tmp_path: Path) -> None:
    spec = tokenizer_dir(tmp_path, templates.NUMBERS_USERS)
    with pytest.raises(CodecMismatch, match=r"^tokenizer .*: the chat template cannot be served: it is not "
                                            r"prefix-stable, and not servable as continuous tokens \(tools, reasoning, "
                                            r"parallel calls\): request 3: the increment is not what the template "
                                            r"renders for the new messages after the conversation, .*\(message 7\) "
                                            r"And tomorrow.* vs increment .*\(message 4\) And tomorrow"):
        load_codec(spec, "hermes")
    codec = TemplateCodec(load_tokenizer(spec), mode=TemplateMode(name="continuous tokens", reason="test"))
    assert not probe_continuous(codec).ok


def test_rollbus_up_refuses_a_template_it_cannot_serve_in_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    spec = tokenizer_dir(tmp_path / "tokenizer", templates.NUMBERS_USERS)
    argv = ["up", "--tokenizer", spec, "--data-dir", str(tmp_path / "data"), "--engine", "sglang",
            "--engine-url", "http://127.0.0.1:1"]  # (never reached)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rollbus: cannot start the edge: tokenizer {spec}: the chat template cannot be served: "
                          "it is not prefix-stable, and not servable as continuous tokens")
    assert err.count("\n") == 1 and not (tmp_path / "data").exists()


def test_a_prefix_stable_codec_still_refuses_an_increment_that_rerenders(codecs: dict[str, TemplateCodec]) -> None:
    prefix_stable = TemplateCodec(codecs["marks last user"].tokenizer)
    with pytest.raises(TemplateNotIncremental, match="rendering new messages changed the rendering of earlier ones"):
        prefix_stable.increment_text([Message(role="user", content="next")], ended_with_eos=True)


def _turns(codec: TemplateCodec, steps: list[tuple[str, list[Message]]], *, first: list[Message],
           ended: bool = True) -> tuple[list[int], list[Message], list[str]]:
    """A chain as the edge builds it: the first prompt, then each sampled text (with its end-of-turn
    token unless ``ended`` is False for the last) and each increment; the stored tokens, the
    conversation, and the increments' texts."""
    tokenizer = codec.tokenizer
    stored, messages, increments = codec.encode_prompt(first, ()), list(first), []
    for n, (sampled, new) in enumerate(steps):
        cut = not ended and n == len(steps) - 1
        stored += tokenizer.encode(sampled if cut else sampled + EOS)
        messages.append(_message(sampled))
        increment = codec.encode_increment(new, last_token=stored[-1])
        assert tokenizer.decode(increment) == codec.increment_text(new, ended_with_eos=not cut)
        increments.append(tokenizer.decode(increment))
        stored += increment
        messages.extend(new)
    return stored, messages, increments


def _message(sampled: str) -> Message:
    """The assistant message an agent sends back for ``sampled`` (reasoning split out)."""
    reasoning, _, content = sampled.partition("</think>\n\n")
    if not content:
        return Message(role="assistant", content=sampled)
    return Message(role="assistant", content=content, reasoning=reasoning.removeprefix("<think>\n").rstrip("\n"))


FIRST = [Message(role="system", content="Use the calculator."), Message(role="user", content="What is 2*2?")]


def test_reasoning_stays_as_sampled_while_the_template_strips_it(codecs: dict[str, TemplateCodec]) -> None:
    codec = codecs["strips reasoning"]
    steps = [("<think>\nSmall sum.\n</think>\n\nFour.", [Message(role="user", content="And 3*3?")]),
             ("<think>\nStill small.\n</think>\n\nNine.", [Message(role="user", content="Thanks")])]
    stored, messages, increments = _turns(codec, steps, first=FIRST)
    prompt = codec.prompt_text(FIRST, ())
    text = codec.tokenizer.decode(stored)
    assert text == prompt + steps[0][0] + EOS + increments[0] + steps[1][0] + EOS + increments[1]
    assert increments == ["\n<|im_start|>user\nAnd 3*3?<|im_end|>\n<|im_start|>assistant\n",
                          "\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"]
    full = codec.prompt_text(messages, ())
    assert "Small sum." not in full and "Still small." not in full  # the template's render strips both
    assert full.endswith(EOS + increments[-1]) and text != full


def test_tool_results_after_a_dropped_analysis_channel(codecs: dict[str, TemplateCodec]) -> None:
    codec = codecs["drops analysis"]
    reply = Message(role="assistant", reasoning="Use the tool.", tool_calls=(_call(2),))
    sampled = sampled_text(codec, FIRST, reply, ())
    assert sampled.startswith("<|channel|>analysis<|message|>Use the tool.<|end|>") and sampled.endswith(EOS)
    tokenizer = codec.tokenizer
    stored = codec.encode_prompt(FIRST, ()) + tokenizer.encode(sampled)
    new = [Message(role="tool", content="4", tool_call_id="call_2")]
    increment = tokenizer.decode(codec.encode_increment(new, last_token=stored[-1]))
    assert increment == "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    full = codec.prompt_text([*FIRST, reply, *new], ())
    assert "analysis" not in full and full.endswith(EOS + increment)  # the render drops it; the record keeps it


def test_the_new_last_user_turn_is_marked_and_the_earlier_mark_stays(codecs: dict[str, TemplateCodec]) -> None:
    codec = codecs["marks last user"]
    prompt = codec.prompt_text(FIRST, ())
    assert prompt.endswith("What is 2*2? [latest]<|im_end|>\n<|im_start|>assistant\n")
    stored, messages, increments = _turns(codec, [("Four.", [Message(role="user", content="And 3*3?")])], first=FIRST)
    assert increments == ["\n<|im_start|>user\nAnd 3*3? [latest]<|im_end|>\n<|im_start|>assistant\n"]
    assert "What is 2*2? [latest]" in codec.tokenizer.decode(stored)  # as the model saw it
    assert "What is 2*2? [latest]" not in codec.prompt_text(messages, ())


@pytest.mark.parametrize("name", ["strips reasoning", "drops analysis", "marks last user"])
def test_a_turn_cut_off_gets_the_end_of_turn_token_first(codecs: dict[str, TemplateCodec], name: str) -> None:
    codec = codecs[name]
    stored, _, increments = _turns(codec, [("Four", [Message(role="user", content="go on")])], first=FIRST,
                                   ended=False)
    assert increments[0].startswith(EOS + "\n<|im_start|>user\ngo on")
    assert codec.tokenizer.decode(stored).endswith("Four" + increments[0])


@pytest.mark.parametrize("name", ["strips reasoning", "drops analysis", "marks last user"])
def test_framed_and_rendered_increments_agree(codecs: dict[str, TemplateCodec], name: str) -> None:
    """Plain messages take the frame (rendered once per shape); each must equal a render of its own."""
    codec = codecs[name]
    new = [Message(role="tool", content=" x\t<b>{{ y }}</b>\n", tool_call_id="c"),
           Message(role="user", content="é 中 😀 ")]
    assert codec._frame(new) is not None
    fresh = TemplateCodec(codec.tokenizer, mode=codec.mode)
    assert codec.increment_text(new, ended_with_eos=True) == codec.separator + fresh._rendered_tail(
        [{"role": "tool", "content": new[0].content, "tool_call_id": "c"},
         {"role": "user", "content": new[1].content}])


def test_a_rewritten_reply_starts_at_the_generation_prompt(codecs: dict[str, TemplateCodec]) -> None:
    codec = codecs["strips reasoning"]
    text = codec.rewrite_text([Message(role="assistant", content="Four, surely."),
                               Message(role="user", content="Why?")])
    assert text == "Four, surely.<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"


def test_healthz_says_the_mode_and_why() -> None:
    body, status = health(True, [], template=TemplateMode(name="continuous tokens", reason="not prefix-stable: x"))
    assert status == 200
    assert json.loads(body) == {"status": "ok", "chat_template": {"mode": "continuous tokens",
                                                                  "reason": "not prefix-stable: x"}}
    body, status = health(False, [], template=TemplateMode())
    assert status == 503 and json.loads(body) == {"status": "starting", "chat_template": {"mode": "prefix-stable"}}


def test_session_opened_from_an_older_log_reads_as_think_and_prefix_stable() -> None:
    old = {"type": "session_opened", "session_id": "s", "seq": 1, "time": 1.0, "uid": "u", "session_index": 0,
           "api_key_digest": "d", "max_trajectory_length": 10, "tokenizer": "t", "tool_format": "hermes"}
    event = msgspec.json.decode(json.dumps(old), type=SessionOpened)
    assert (event.reasoning, event.template) == ("think", "prefix-stable")
    assert {"reasoning_format", "template_mode"}.isdisjoint(msgspec.json.decode(msgspec.json.encode(event)))


async def test_session_opened_records_the_reasoning_format_and_the_template_mode(
        codecs: dict[str, TemplateCodec]) -> None:
    settings = EdgeSettings(tokenizer="DIR", tool_format="hermes", reasoning_format="sglang:qwen3")
    log = InMemoryLog(settings.log)
    service = in_memory_service(HandlerEngine(lambda _: None), log=log, settings=settings,  # type: ignore[arg-type]
                                codec=(codecs["strips reasoning"], make_parser("hermes")))
    assert service.template_mode is codecs["strips reasoning"].mode
    opened = await service.open_session(OpenSession())
    (event, *_) = (await log.read_session(opened.session_id)).events
    assert isinstance(event, SessionOpened)
    assert (event.tool_format, event.reasoning, event.template) == (
        "hermes", "sglang:qwen3", "continuous tokens")


def test_the_qwen3_tokenizer_directory_keeps_its_tokens(tmp_path: Path) -> None:
    tokenizer: Tokenizer = load_tokenizer(tokenizer_dir(tmp_path, templates.STRIPS_REASONING))
    assert tokenizer.eos_token == EOS and tokenizer.encode("<think>") == [151667]
