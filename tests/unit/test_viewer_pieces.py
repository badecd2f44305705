"""The viewer's token pieces and windows, and the session detail built from a fold state (pure)."""

from __future__ import annotations

import pytest

from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from schemas.errors import MalformedRequest
from schemas.events import EngineFailed, ToolCall, TurnAbandoned, TurnCompleted
from session.fold import fold
from session.views import chain_tokens
from tests.helpers import SessionScript
from viewer.detail import MAX_TEXT, audit_entry, bounded, request_entry, session_detail
from viewer.pieces import parse_window, token_texts, window


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


def test_token_texts_join_to_the_decoded_text_and_split_characters_go_to_their_last_token(tokenizer):
    text = "Ünïcödé ✓ 漢字 and 🜁 alchemy\n<|im_end|>\n"
    ids = tokenizer.encode(text)
    pieces = token_texts(ids, tokenizer.decode)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)
    air = next(i for i, p in enumerate(pieces) if "🜁" in p)  # its four bytes are three tokens
    assert pieces[air - 2: air] == ["", ""]


def test_token_texts_of_a_part_cut_inside_a_character_keep_what_there_is(tokenizer):
    ids = tokenizer.encode("🜁")
    assert len(ids) > 1
    pieces = token_texts(ids[:-1], tokenizer.decode)
    assert len(pieces) == len(ids) - 1 and pieces[-1].endswith("\ufffd")


def _script() -> SessionScript:
    script = SessionScript()
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True, logprobs=[-0.1, -2.0])
    script.turn(0, [30, 31], [40, 41, 42], logprobs=[-0.3, -0.4, -0.5], n_messages=4, tip="tip2")
    return script


def test_a_response_window_has_the_records_mask_and_log_probs_only_on_sampled_tokens():
    state = fold(_script().events)
    (chain,) = state.chains
    whole = window(chain, None)
    record = chain_tokens(chain)
    assert whole.ids == record["response_ids"] == [20, 21, 30, 31, 40, 41, 42]
    assert whole.mask == record["response_mask"] == [1, 1, 0, 0, 1, 1, 1]
    assert whole.logprobs == pytest.approx([-0.1, -2.0, None, None, -0.3, -0.4, -0.5], abs=1e-6)
    assert whole.turn_starts == [0, 2]  # turn 2 starts with its context
    assert whole.text is None and whole.next_offset is None and whole.length == 7


def test_windows_page_through_a_part_exactly_once():
    state = fold(_script().events)
    (chain,) = state.chains
    ids, mask, offset = [], [], 0
    while offset is not None:
        part = window(chain, None, offset=offset, limit=3)
        assert len(part.ids) <= 3 and part.offset == offset
        ids += part.ids
        mask += part.mask
        offset = part.next_offset
    assert ids == chain_tokens(chain)["response_ids"] and mask == chain_tokens(chain)["response_mask"]
    assert window(chain, None, offset=3, limit=3).turn_starts == []  # turn 2's first token is at 2
    prompt = window(chain, None, part="prompt")
    assert prompt.ids == [10, 11, 12] and prompt.mask == [0, 0, 0] and prompt.logprobs is None


def test_window_parameters_are_bounded():
    assert parse_window(None, None, None) == ("response", 0, 2000)
    assert parse_window("prompt", "5", "10") == ("prompt", 5, 10)
    for args in (("tokens", None, None), (None, "-1", None), (None, "x", None), (None, None, "0"),
                 (None, None, "10001")):
        with pytest.raises(MalformedRequest):
            parse_window(*args)


def test_the_detail_shows_tool_calls_rollbacks_reward_and_requests(tokenizer):
    script = SessionScript()
    hello = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    script.turn(0, hello, tokenizer.encode("first"), new_chain=True, body=b'{"n": 1}')
    script.roll_back(0, turn_request_no=1, dropped=len(tokenizer.encode("first")))
    script.turn(0, tokenizer.encode("rewritten"), tokenizer.encode("second"), body=b'{"n": 2}')
    last = script.events[-1]
    assert isinstance(last, TurnCompleted)
    script.events[-1] = TurnCompleted(**{**{f: getattr(last, f) for f in last.__struct_fields__},
                                         "tool_calls": (ToolCall(id="call_1", name="calc", arguments='{"x": 1}'),),
                                         "reasoning": "think " * 5000})
    script.reward(1.0, acc=0.5)
    script.finalize()
    state = fold(script.events)
    audit = [a for a in map(audit_entry, script.events) if a is not None]
    requests = [request_entry(e) for e in script.events if type(e).__name__ == "RequestReceived"]
    detail = session_detail(state, audit, requests, tokenizer.decode, last_stream_seq=9)
    assert [a.kind for a in detail.audit] == ["turn_rolled_back", "reward_reported", "session_finalized"]
    assert "rolled back" in detail.audit[0].detail and detail.audit[0].request_no == 2
    assert detail.reward.reward == 1.0 and detail.reward.extra == {"acc": 0.5}
    (chain,) = detail.chains
    (turn,) = chain.turns  # the rolled-back turn is gone from the chain; its text stays as context
    assert turn.tool_calls[0].name == "calc" and turn.tool_calls[0].arguments == '{"x": 1}'
    assert turn.context_text == "rewritten" and len(turn.reasoning) < MAX_TEXT + 100
    assert "".join(chain.response.text) == tokenizer.decode(chain_tokens(state.chains[0])["response_ids"])
    assert chain.response.mask == chain_tokens(state.chains[0])["response_mask"]
    assert "".join(chain.prompt.text).startswith("<|im_start|>user\nhi")
    assert [r.request_no for r in detail.requests] == [1, 2] and detail.requests[1].body_size == 8
    assert bounded("x" * 10, 4) == "xxxx… [6 more characters not shown]"


def test_abandoned_turns_and_engine_failures_are_in_the_audit_trail_and_tokens_are_not():
    script = SessionScript()
    script.turn(0, [1, 2], [3], new_chain=True)
    opened, received, started, generated = script.events[:4]
    abandoned = TurnAbandoned(session_id=opened.session_id, seq=9, time=9.0, request_no=2, chain=0,
                              reason="client_disconnected", tokens_sampled=17)
    failed = EngineFailed(session_id=opened.session_id, seq=10, time=10.0, request_no=3, chain=None,
                          error="EngineTimeout", message="no answer in 30 s")
    assert [audit_entry(e) for e in (opened, received, started, generated)] == [None] * 4
    entry = audit_entry(abandoned)
    assert (entry.kind, entry.chain, entry.request_no) == ("turn_abandoned", 0, 2)
    assert entry.detail == "client_disconnected; 17 tokens had been sampled"
    assert audit_entry(failed).detail == "EngineTimeout: no answer in 30 s" and audit_entry(failed).chain is None


def test_a_window_lists_the_images_that_stand_in_it_at_their_offsets_in_the_part():
    from schemas.events import ImageRef

    def ref(name: str, offset: int, tokens: int) -> ImageRef:
        return ImageRef(digest=name * 64, media_type="image/png", width=28, height=28 * tokens, offset=offset,
                        tokens=tokens)

    pad = 151655
    script = SessionScript()
    script.turn(0, [1, 151652, pad, pad, pad, 151653, 2], [3], new_chain=True, images=[ref("a", 2, 3)])
    script.turn(0, [4, 151652, pad, pad, 151653], [5], images=[ref("b", 2, 2)], n_messages=4, tip="t1")
    (chain,) = fold(script.events).chains
    (prompt_image,) = window(chain, None, part="prompt").images
    assert (prompt_image.digest, prompt_image.offset, prompt_image.tokens) == ("a" * 64, 2, 3)
    (response_image,) = window(chain, None).images  # the response: [3, 4, start, pad, pad, end, 5]
    assert (response_image.digest, response_image.offset, response_image.tokens) == ("b" * 64, 3, 2)
    assert window(chain, None, part="prompt", offset=3, limit=1).images == [prompt_image]  # a window inside its run
    assert window(chain, None, part="prompt", offset=5).images == []
    assert window(chain, None, limit=3).images == []
    assert window(chain, None, limit=4).images == [response_image]
    assert window(chain, None, offset=5).images == []
