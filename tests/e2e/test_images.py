"""Images end to end, through the official SDKs against a stack with ``--processor builtin:qwen2.5-vl`` in front of
the scripted SGLang engine: one conversation (an image in the question, a tool call, a tool result holding a
second image) through the OpenAI SDK and through the Anthropic SDK leaves identical token events with the same
placeholder spans, the engine gets the same ``image_data``, the log holds digests and the object store the bytes;
hostile images are refused in each wire's shape, naming the field and the limit, and nothing is recorded."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import anthropic
import msgspec
import nats
import openai
import pytest

from eventlog.pieces import open_pieces
from eventlog.reader import iter_messages, last_stream_seq
from schemas import tokens
from schemas.bodies import rebuild
from schemas.events import ChainStarted, ContextAppended, RequestReceived, SessionOpened, TokensGenerated
from stack.options import StackOptions
from tests.e2e.conftest import ADMIN_TOKEN
from tests.e2e.test_openai_session import TOOLS, call_text, open_session, reply
from tests.images import anthropic_image, bomb, data_url, noise_png, openai_image, png
from tests.stack import StackThread
from vision.images import image_digest

PROCESSOR = "builtin:qwen2.5-vl"
CHART, SCREENSHOT = png(112, 56, (10, 200, 30)), noise_png(80, 60, seed=3)
QUESTION, RESULT = "Which bar is higher in this chart?", "Here is the screen after running it:"
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
IMAGE_PAD = 151655


@pytest.fixture
def vision_stack(make_stack):
    return make_stack(processor=PROCESSOR)


def run_openai(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Look carefully."},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, openai_image(CHART)]}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls or []
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": [{"type": "text", "text": RESULT}, openai_image(SCREENSHOT)]}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert second.choices[0].message.content == "The green bar."


def run_anthropic(client: anthropic.Anthropic, *, stream: bool = False) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, anthropic_image(CHART)]}]
    request = {"model": "m", "max_tokens": 256, "system": "Look carefully.", "tools": ANTHROPIC_TOOLS}
    if stream:
        with client.messages.stream(messages=messages, **request) as events:  # type: ignore[arg-type]
            first = events.get_final_message()
    else:
        first = client.messages.create(messages=messages, **request)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": [
                     {"type": "text", "text": RESULT}, anthropic_image(SCREENSHOT)]}]}]
    second = client.messages.create(messages=messages, **request)  # type: ignore[arg-type]
    assert [b.text for b in second.content if b.type == "text"] == ["The green bar."]


def messages_of(stack, session_id: str) -> list[bytes]:
    """The session's log messages as stored in the stream (not decoded: pieces not fetched)."""
    async def read() -> list[bytes]:
        nc = await nats.connect(stack.nats_url)
        try:
            cfg, js = stack.options.log, nc.jetstream()
            subjects = cfg.session_filter(session_id)
            until = await last_stream_seq(js, cfg, subjects)
            return [message.data async for _, message in iter_messages(js, cfg, subjects, until)]
        finally:
            await nc.close()

    return asyncio.run(read())


def pieces_of(stack, session_id: str, digests: list[str]) -> list[bytes | None]:
    async def read() -> list[bytes | None]:
        nc = await nats.connect(stack.nats_url)
        try:
            store = await open_pieces(nc.jetstream(), stack.options.log)
            assert store is not None
            return [await store.get(session_id, bytes.fromhex(d)) for d in digests]
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "anthropic-streamed"])
def test_one_conversation_with_images_through_both_sdks_leaves_identical_tokens(vision_stack, engine, tokenizer,
                                                                                 stream: bool):
    logged = []
    for wire in ("openai", "anthropic"):
        engine.push(reply(tokenizer, "Let me look.\n" + call_text("bars")), reply(tokenizer, "The green bar."))
        session = open_session(vision_stack, uid=wire)
        if wire == "openai":
            run_openai(openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0))
        else:
            run_anthropic(anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                              max_retries=0), stream=stream)
        events = vision_stack.events(session["session_id"])
        assert next(e for e in events if type(e) is SessionOpened).processor == PROCESSOR
        started = next(e for e in events if type(e) is ChainStarted)
        appended = next(e for e in events if type(e) is ContextAppended)
        logged.append((started.prompt_ids, started.images, appended.token_ids, appended.images))
        digests = [image_digest(CHART), image_digest(SCREENSHOT)]
        assert [r.digest for r in (*started.images, *appended.images)] == digests
        assert pieces_of(vision_stack, session["session_id"], digests) == [CHART, SCREENSHOT]
        # the log holds digests, the object store the bytes, and the base64 text the raw bodies held too
        assert not any(image in msgspec.msgpack.encode(e) for e in events for image in (CHART, SCREENSHOT))
        texts = [base64.b64encode(image) for image in (CHART, SCREENSHOT)]
        assert texts[0] in rebuild(events).body(1)  # read back, a body is the agent's, byte for byte
        assert not any(text in message for message in messages_of(vision_stack, session["session_id"])
                       for text in texts)
    assert logged[0] == logged[1]
    prompt, images, context, more = logged[0]
    ids = tokens.unpack_ids(prompt).tolist()
    (chart,) = images
    assert ids[chart.offset:chart.offset + chart.tokens] == [IMAGE_PAD] * chart.tokens and chart.tokens == 8
    assert ids.count(IMAGE_PAD) == chart.tokens
    (screen,) = more
    increment = tokens.unpack_ids(context).tolist()
    assert increment[screen.offset:screen.offset + screen.tokens] == [IMAGE_PAD] * screen.tokens
    assert tokenizer.decode(increment[:screen.offset]).endswith(f"{RESULT}<|vision_start|>")
    openai_calls, anthropic_calls = engine.requests[:2], engine.requests[2:]
    for a, b in zip(openai_calls, anthropic_calls, strict=True):
        assert (a["input_ids"], a["image_data"]) == (b["input_ids"], b["image_data"])
    assert anthropic_calls[1]["image_data"] == [data_url(CHART), data_url(SCREENSHOT)]


def test_hostile_images_through_the_openai_sdk_are_refused_naming_the_limit(vision_stack, engine):
    session = open_session(vision_stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)

    def refused(*parts: dict[str, Any], text: str = "look") -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="m", messages=[
                {"role": "user", "content": [{"type": "text", "text": text}, *parts]}])
        return caught.value

    error = refused(openai_image(bomb()))
    assert error.status_code == 413 and "max_pixels" in error.message
    assert error.body["param"] == "messages[0].content[1].image_url.url"  # type: ignore[index]
    error = refused(*[openai_image(CHART)] * 17)
    assert error.status_code == 400 and "max_images" in error.message
    assert error.body["param"] == "messages[0].content[17].image_url.url"  # type: ignore[index]
    error = refused({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    assert error.status_code == 400 and "does not decode" in error.message
    error = refused({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}})
    assert error.status_code == 400 and "not fetched" in error.message
    error = refused(text="<|vision_start|><|image_pad|><|vision_end|>")
    assert error.status_code == 400 and "placeholder" in error.message
    assert [type(e) for e in vision_stack.events(session["session_id"])] == [SessionOpened]  # nothing recorded
    assert engine.requests == []


def test_hostile_images_through_the_anthropic_sdk_are_refused_naming_the_limit(vision_stack, engine, tokenizer):
    session = open_session(vision_stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)

    def refused(*blocks: dict[str, Any]) -> tuple[int, str, str]:
        with pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(model="m", max_tokens=16, messages=[
                {"role": "user", "content": [{"type": "text", "text": "look"}, *blocks]}])
        error = caught.value.body["error"]  # type: ignore[index]
        return caught.value.status_code, error["type"], error["message"]

    status, kind, message = refused(anthropic_image(bomb()))
    assert (status, kind) == (413, "request_too_large")
    assert message.startswith("messages[0].content[1].source.data: ") and "max_pixels" in message
    status, kind, message = refused({"type": "image", "source": {"type": "file", "file_id": "file_1"}})
    assert (status, kind) == (400, "invalid_request_error")
    assert message.startswith("messages[0].content[1].source.type: ")
    status, _, message = refused({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                              "data": "%%%"}})
    assert status == 400 and "base64" in message
    assert [type(e) for e in vision_stack.events(session["session_id"])] == [SessionOpened]
    engine.push(reply(tokenizer, "A chart."))  # the session still works
    messages = [{"role": "user", "content": [anthropic_image(CHART), {"type": "text", "text": "what is it?"}]}]
    counted = client.messages.count_tokens(model="m", messages=messages)  # type: ignore[arg-type]
    answer = client.messages.create(model="m", max_tokens=16, messages=messages)  # type: ignore[arg-type]
    assert answer.content[0].text == "A chart."  # type: ignore[union-attr]
    assert counted.input_tokens == answer.usage.input_tokens == len(engine.requests[0]["input_ids"])
    assert [type(e) for e in vision_stack.events(session["session_id"])][:3] == [SessionOpened, RequestReceived,
                                                                                 ChainStarted]


def test_without_a_processor_an_image_is_a_400_naming_the_field(stack, engine):
    session = open_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"}, openai_image(CHART)]}])
    assert "--processor" in caught.value.message
    assert caught.value.body["param"] == "messages[0].content[1].image_url.url"  # type: ignore[index]
    assert engine.requests == []


def test_the_responses_api_takes_input_image_as_chat_takes_image_url(vision_stack, engine, tokenizer):
    started = []
    for wire in ("chat", "responses"):
        engine.push(reply(tokenizer, "A chart."))
        session = open_session(vision_stack, uid=f"r{wire}")
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        if wire == "chat":
            client.chat.completions.create(model="m", messages=[
                {"role": "user", "content": [{"type": "text", "text": QUESTION}, openai_image(CHART)]}])
        else:
            response = client.responses.create(model="m", input=[{"role": "user", "content": [
                {"type": "input_text", "text": QUESTION},
                {"type": "input_image", "image_url": data_url(CHART), "detail": "auto"}]}])
            assert response.output_text == "A chart."
        event = next(e for e in vision_stack.events(session["session_id"]) if type(e) is ChainStarted)
        started.append((event.prompt_ids, event.images))
    assert started[0] == started[1] and started[0][1][0].digest == image_digest(CHART)


@pytest.fixture
def local_vision_stack(nats_server, log_config, tmp_path) -> Iterator[StackThread]:
    options = StackOptions(port=0, data_dir=tmp_path / "data", nats_url=nats_server.url, admin_token=ADMIN_TOKEN,
                           log=log_config, model="tiny-qwen2-vl", processor=PROCESSOR, max_trajectory_length=4096)
    stack = StackThread(options).start()
    yield stack
    stack.stop()


def test_the_local_vision_model_answers_a_turn_with_images(local_vision_stack):
    """The whole path on CPU: the edge expands the images, the local tiny Qwen2.5-VL takes them."""
    stack = local_vision_stack
    session = open_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, openai_image(CHART)]}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": [openai_image(SCREENSHOT), {"type": "text", "text": "and this?"}]}]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    assert first.usage is not None and second.usage is not None and second.usage.completion_tokens == 4
    events = stack.events(session["session_id"])
    started = next(e for e in events if type(e) is ChainStarted)
    appended = next(e for e in events if type(e) is ContextAppended)
    assert [r.digest for r in (*started.images, *appended.images)] == [image_digest(CHART), image_digest(SCREENSHOT)]
    sampled = next(e for e in events if type(e) is TokensGenerated)
    assert second.usage.prompt_tokens == sum(map(tokens.count, (started.prompt_ids, sampled.token_ids,
                                                                appended.token_ids)))


def test_a_response_continued_by_previous_response_id_keeps_its_images(vision_stack, engine, tokenizer):
    engine.push(reply(tokenizer, "A chart."), reply(tokenizer, "Green."))
    session = open_session(vision_stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    first = client.responses.create(model="m", store=True, input=[{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(CHART)}]}])
    second = client.responses.create(model="m", previous_response_id=first.id, input="Which color?")
    assert second.output_text == "Green."
    events = vision_stack.events(session["session_id"])
    assert [type(e) for e in events].count(ChainStarted) == 1  # the stored conversation continued its chain
    assert engine.requests[1]["image_data"] == [data_url(CHART)]  # the engine still sees the chain's image
    assert engine.requests[1]["input_ids"][:len(engine.requests[0]["input_ids"])] == engine.requests[0]["input_ids"]
