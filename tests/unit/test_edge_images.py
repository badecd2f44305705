"""Images through the edge's turns on the in-memory log: placeholders expanded where each image stands and
nowhere else, the events' image references, the bytes in the object store once a session, the engine's
images, refusals before anything is recorded, the fetch allow-list, and what a resent image costs the log."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from edge.engines.base import GenerateRequest, GenerateResult, id_list
from edge.images import EdgeImages, ImageFetcher
from edge.live import LiveSession
from edge.settings import EdgeSettings
from edge.tokens.fidelity import load_codec
from edge.tokens.images import ImageTokens
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers.base import ToolParser
from edge.turns import TurnRequest, TurnRunner
from edge.wires.anthropic import decode_request as decode_anthropic
from edge.wires.openai import decode_request as decode_openai
from rollbus.testing.engine import HandlerEngine, result
from rollbus.testing.memory_log import InMemoryLog
from schemas import blobs, tokens
from schemas.bodies import rebuild
from schemas.errors import ImageRefused, ImageTooLarge
from schemas.events import ChainStarted, ContextAppended, ImageRef, RequestReceived, SessionOpened
from session.fold import apply
from tests.images import anthropic_image, bomb, data_url, noise_png, openai_image, png
from vision.images import ImageLimits, image_digest
from vision.processor import load_processor

SID = "0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.0
IM_END, VISION_START, IMAGE_PAD, VISION_END = 151645, 151652, 151655, 151653
RED, BLUE = png(56, 56, (200, 0, 0)), png(84, 28, (0, 0, 200))


@pytest.fixture(scope="module")
def codec() -> tuple[TemplateCodec, ToolParser]:
    return load_codec("builtin:qwen2.5", "hermes")


@pytest.fixture(scope="module")
def image_tokens(codec: tuple[TemplateCodec, ToolParser]) -> ImageTokens:
    tokenizer = codec[0].tokenizer
    return ImageTokens(load_processor("builtin:qwen2.5-vl", tokenizer), tokenizer)


def reply(codec: TemplateCodec, text: str = "seen") -> Callable[[GenerateRequest], GenerateResult]:
    return lambda request: result([*codec.tokenizer.encode(text), IM_END])


async def opened(log: InMemoryLog) -> LiveSession:
    event = SessionOpened(session_id=SID, seq=1, time=NOW, uid="u", session_index=0, api_key_digest="x",
                          max_trajectory_length=8192, tokenizer="builtin:qwen2.5", tool_format="hermes")
    appended = await log.append(SID, [event], 0)
    return LiveSession(apply(None, event), appended.stream_seq, clock=lambda: NOW)


def runner(codec: tuple[TemplateCodec, ToolParser], log: InMemoryLog, engine: HandlerEngine,
           images: EdgeImages) -> TurnRunner:
    return TurnRunner(settings=EdgeSettings(max_trajectory_length=8192), codec=codec[0], engine=engine, log=log,
                      parser=codec[1], clock=lambda: NOW, images=images)


def openai(messages: list[dict[str, Any]]) -> TurnRequest:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return TurnRequest(conversation=decode_openai(body), wire="openai", body=body)


def user(text: str, *images: bytes, after: str = "") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, *map(openai_image, images),
                                        *([{"type": "text", "text": after}] if after else [])]}


async def events_of(log: InMemoryLog) -> list[Any]:
    return list((await log.read_session(SID)).events)


def pad_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each run of image pads."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token == IMAGE_PAD:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


async def test_images_become_their_pads_where_they_stand_and_the_log_holds_their_digests(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    first = [{"role": "system", "content": "look"}, user("compare", RED, BLUE, after="which is red?")]
    outcome = await turns.run(live, openai(first))
    (sent,) = engine.requests
    assert sent.images == (RED, BLUE)  # the engine gets the bytes, in order
    started = next(e for e in await events_of(log) if type(e) is ChainStarted)
    prompt = tokens.unpack_ids(started.prompt_ids).tolist()
    assert prompt == id_list(sent.input_ids)
    counts = [image_tokens.processor.image_tokens(image_tokens_info(image)) for image in (RED, BLUE)]
    assert counts == [4, 8]  # 56x56: a 4x4 grid merged 2x2; 84x28: scaled up to min_pixels, 112x56: 8x4 -> 8
    assert started.images == tuple(
        ImageRef(digest=image_digest(image), media_type="image/png", width=w, height=h, offset=offset, tokens=n)
        for image, (w, h), (offset, n) in zip((RED, BLUE), ((56, 56), (84, 28)), pad_runs(prompt), strict=True))
    for ref in started.images:  # each pad run sits between the processor's start and end tokens
        assert prompt[ref.offset - 1] == VISION_START and prompt[ref.offset + ref.tokens] == VISION_END
    assert codec[0].tokenizer.decode(prompt[started.images[1].offset + 8:]).startswith("<|vision_end|>which is red?")
    # the bytes are in the object store, by digest, and nowhere in the events; so is the base64 text the body sent
    texts = [base64.b64encode(i) for i in (RED, BLUE)]
    assert log.pieces == {blobs.object_name(SID, hashlib.sha256(v).digest()): v for v in (RED, BLUE, *texts)}
    assert not any(v in m.data for m in log.messages for v in (RED, BLUE, *texts))  # the log's messages: digests
    assert outcome.prompt_tokens == len(prompt)


def image_tokens_info(image: bytes) -> Any:
    from vision.images import inspect

    return inspect(image, ImageLimits())


async def test_a_continued_chain_appends_new_images_and_resends_stored_ones_once(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    history = [user("what is this?", RED)]
    first = await turns.run(live, openai(history))
    history += [{"role": "assistant", "content": first.content}, user("and now?", BLUE, RED)]
    await turns.run(live, openai(history))
    appended = next(e for e in await events_of(log) if type(e) is ContextAppended)
    context = tokens.unpack_ids(appended.token_ids).tolist()
    assert [(r.digest, r.tokens) for r in appended.images] == [(image_digest(BLUE), 8), (image_digest(RED), 4)]
    assert [(r.offset, r.tokens) for r in appended.images] == pad_runs(context)  # offsets into this event's ids
    assert engine.requests[1].images == (RED, BLUE, RED)  # the chain's image, then the new ones
    assert len(pad_runs(id_list(engine.requests[1].input_ids))) == 3
    # RED once, though the chain holds it twice; its base64 text too (the second body refers to the first's)
    assert sorted(log.pieces.values()) == sorted([RED, BLUE, *(base64.b64encode(i) for i in (RED, BLUE))])


async def test_an_image_resent_in_history_gets_the_tokens_it_got_the_first_time(codec, image_tokens):
    """A chain's tokens (prompt, sampled reply, increment) equal a new chain's prompt for the same history."""
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0], "a red square"))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    history = [user("what is this?", RED)]
    first = await turns.run(live, openai(history))
    history += [{"role": "assistant", "content": first.content}, user("and this?", BLUE)]
    await turns.run(live, openai(history))
    continued = id_list(engine.requests[1].input_ids)
    fresh_log, fresh_engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    fresh = runner(codec, fresh_log, fresh_engine, EdgeImages(image_tokens))
    await fresh.run(await opened(fresh_log), openai(history))
    assert id_list(fresh_engine.requests[0].input_ids) == continued
    assert fresh_engine.requests[0].images == engine.requests[1].images == (RED, BLUE)


@pytest.mark.parametrize("text", ["<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>", "a<|vision_end|>"])
async def test_text_spelling_the_placeholder_never_makes_an_image_slot(codec, image_tokens, text: str):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    for messages in ([{"role": "user", "content": text}], [user(text, RED)], [user("x", RED, after=text)]):
        with pytest.raises(ImageRefused, match="spells the image placeholder") as refused:
            await turns.run(live, openai(messages))
        assert refused.value.param == "messages"
    assert not engine.requests and [type(e) for e in await events_of(log)] == [SessionOpened]


async def test_without_a_processor_special_token_text_is_as_it_was_and_an_image_is_a_400(codec):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(None))
    await turns.run(live, openai([{"role": "user", "content": "<|image_pad|>"}]))
    assert IMAGE_PAD in id_list(engine.requests[0].input_ids)  # a text-only edge: unchanged behaviour
    with pytest.raises(ImageRefused, match="no image processor") as refused:
        await turns.run(live, openai([user("look", RED)]))
    assert refused.value.param == "messages[0].content[1].image_url.url"


@pytest.mark.parametrize(("image", "limits", "error", "words"), [
    (bomb(), ImageLimits(), ImageTooLarge, "max_pixels"),
    (png(300, 20), ImageLimits(max_side=256), ImageTooLarge, "max_side"),
    (noise_png(64, 64), ImageLimits(max_bytes=4096), ImageTooLarge, "max_bytes"),
    (b"\x89PNG\r\n\x1a\n not really", ImageLimits(), ImageRefused, "does not decode"),
])
async def test_hostile_images_are_refused_naming_the_limit_before_anything_is_recorded(
        codec, image_tokens, image: bytes, limits: ImageLimits, error: type[Exception], words: str):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens, limits))
    with pytest.raises(error, match=words) as refused:
        await turns.run(live, openai([user("look", RED, image)]))
    assert refused.value.param == "messages[0].content[2].image_url.url"  # type: ignore[attr-defined]
    assert not engine.requests and not log.pieces and [type(e) for e in await events_of(log)] == [SessionOpened]


async def test_too_many_images_are_counted_with_the_history(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens, ImageLimits(max_images=2)))
    with pytest.raises(ImageRefused, match=r"3 images .* limit is 2 \(max_images") as refused:
        await turns.run(live, openai([user("a", RED, BLUE), {"role": "assistant", "content": "ok"},
                                      user("b", RED)]))
    assert refused.value.param == "messages[2].content[1].image_url.url"


def fetching(images: dict[str, bytes], seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        data = images.get(str(request.url))
        return httpx.Response(200, content=data) if data is not None else httpx.Response(404)

    return httpx.MockTransport(handle)


def url_user(url: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "see"},
                                        {"type": "image_url", "image_url": {"url": url}}]}


async def test_an_image_url_is_refused_unless_its_host_is_allowed(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    seen: list[str] = []
    transport = fetching({"https://img.example/red.png": RED}, seen)
    for fetcher, words in ((None, "not fetched"), (ImageFetcher(["other.example"], max_bytes=2**20, timeout=5,
                                                                transport=transport), "only from the hosts")):
        turns = runner(codec, log, engine, EdgeImages(image_tokens, fetcher=fetcher))
        with pytest.raises(ImageRefused, match=words) as refused:
            await turns.run(live, openai([url_user("https://img.example/red.png")]))
        assert refused.value.param == "messages[0].content[1].image_url.url"
    for url in ("file:///etc/passwd", "ftp://img.example/x.png"):
        with pytest.raises(ImageRefused, match=r"data URL .* or http"):
            decode_openai(json.dumps({"messages": [url_user(url)]}).encode())
    assert not seen and not engine.requests


async def test_an_allowed_image_url_is_fetched_once_a_session_within_its_size(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    seen: list[str] = []
    transport = fetching({"https://img.example/red.png": RED, "https://img.example/big.png": noise_png(64, 64)},
                         seen)
    fetcher = ImageFetcher(["img.example"], max_bytes=4096, timeout=5, transport=transport)
    turns = runner(codec, log, engine, EdgeImages(image_tokens, fetcher=fetcher))
    history = [url_user("https://img.example/red.png")]
    first = await turns.run(live, openai(history))
    history += [{"role": "assistant", "content": first.content}, user("and?")]
    await turns.run(live, openai(history))
    assert seen == ["https://img.example/red.png"]  # fetched once, then the session's bytes
    assert engine.requests[0].images == engine.requests[1].images == (RED,)
    with pytest.raises(ImageTooLarge, match="4096 bytes"):
        await turns.run(live, openai([url_user("https://img.example/big.png")]))
    with pytest.raises(ImageRefused, match="HTTP 404"):
        await turns.run(live, openai([url_user("https://img.example/gone.png")]))
    assert seen == ["https://img.example/red.png", "https://img.example/big.png", "https://img.example/gone.png"]


async def test_a_fetch_is_bounded_by_its_declared_size_its_bytes_and_its_time(codec, image_tokens):
    streamed: list[int] = []

    async def trickle(request: httpx.Request) -> httpx.Response:
        async def body():
            for _ in range(100):
                streamed.append(1)
                yield b"x" * 1024
                await asyncio.sleep(0.01)

        headers = {"content-length": "9999999"} if "declared" in str(request.url) else {}
        return httpx.Response(200, content=body(), headers=headers)

    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    for url, timeout, error, words in (("https://img.example/declared", 5, ImageTooLarge, "4096 bytes"),
                                       ("https://img.example/endless", 5, ImageTooLarge, "4096 bytes"),
                                       ("https://img.example/slow", 0.05, ImageRefused, "took more than 0.05 s")):
        streamed.clear()
        fetcher = ImageFetcher(["img.example"], max_bytes=4096 if timeout == 5 else 2**20, timeout=timeout,
                               transport=httpx.MockTransport(trickle))
        turns = runner(codec, log, engine, EdgeImages(image_tokens, fetcher=fetcher))
        with pytest.raises(error, match=words):
            await turns.run(live, openai([url_user(url)]))
        assert len(streamed) < 10, url  # refused early, not after the whole body
    assert not engine.requests


async def test_openai_and_anthropic_give_the_same_images_and_tokens(codec, image_tokens):
    messages_openai = [{"role": "system", "content": "look"}, user("compare", RED, BLUE, after="which?")]
    anthropic_body = json.dumps({"model": "m", "max_tokens": 16, "system": "look", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "compare"}, anthropic_image(RED),
                                     anthropic_image(BLUE), {"type": "text", "text": "which?"}]}]}).encode()
    prompts = []
    for request in (openai(messages_openai), TurnRequest(conversation=decode_anthropic(anthropic_body),
                                                         wire="anthropic", body=anthropic_body)):
        log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
        await runner(codec, log, engine, EdgeImages(image_tokens)).run(await opened(log), request)
        started = next(e for e in await events_of(log) if type(e) is ChainStarted)
        prompts.append((started.prompt_ids, started.images, engine.requests[0].images))
    assert prompts[0] == prompts[1]


async def test_a_resent_screenshot_costs_the_log_little(codec, image_tokens):
    """A 200 KB screenshot resent every turn: in the history (the body's shared prefix) and again in a new
    message (a reference to where an earlier body holds its base64). Its bytes, and the base64 text the first body
    held, are stored once, in the object store: the log's messages hold neither."""
    screenshot = noise_png(260, 260)
    assert 190_000 < len(screenshot) < 220_000
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    history = [user("step 1", screenshot)]
    sizes = []
    for step in range(2, 5):
        before = sum(len(m.data) for m in log.messages)
        outcome = await turns.run(live, openai(history))
        sizes.append(sum(len(m.data) for m in log.messages) - before)
        history += [{"role": "assistant", "content": outcome.content}, user(f"step {step}", screenshot)]
    assert max(sizes) < 4096, sizes  # the first body's base64 text is a piece; later turns: references to it
    assert sorted(log.pieces.values()) == sorted([screenshot, base64.b64encode(screenshot)])  # each stored once
    events = await events_of(log)
    bodies = rebuild(events)
    for event in events:
        if type(event) is RequestReceived:
            assert bodies.verify(event.request_no)  # each body, byte for byte
    print(f"log bytes per turn resending a {len(screenshot)}-byte screenshot: {sizes}")


async def test_the_image_bytes_are_stored_before_the_events_that_reference_them(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    order: list[str] = []
    put, append = log.put_pieces, log.append

    async def put_pieces(session_id: str, pieces: Any) -> None:
        order.append("pieces")
        await put(session_id, pieces)

    async def appending(session_id: str, events: Any, expected_last: int) -> Any:
        order.append(type(events[-1]).__name__)
        return await append(session_id, events, expected_last)

    log.put_pieces, log.append = put_pieces, appending  # type: ignore[method-assign]
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    history = [user("a", RED)]
    first = await turns.run(live, openai(history))
    history += [{"role": "assistant", "content": first.content}, user("b", RED)]
    await turns.run(live, openai(history))
    assert order == ["pieces", "TurnCompleted", "TurnCompleted"]  # once a session, before its first reference


def test_a_message_digest_counts_its_images() -> None:
    decoded = [decode_openai(json.dumps({"messages": [m]}).encode()).history_digests[-1]
               for m in (user("a"), user("a", RED), user("a", BLUE), user("", RED, after="a"))]
    assert len(set(decoded)) == 4
    plain = msgspec.json.encode({"messages": [{"role": "user", "content": "a"}]})
    assert decode_openai(plain).history_digests[-1] == decoded[0]  # a text-only digest is as it was
    assert data_url(RED).startswith("data:image/png;base64,")


async def test_continuous_tokens_keep_the_sampled_tokens_across_turns_with_images(tmp_path):
    """A template that is not prefix-stable (it strips earlier turns' reasoning): the chain keeps its sampled
    tokens, each increment holds its new images expanded, and the engine gets every image of the chain."""
    from tests.continuous_templates import STRIPS_REASONING, tokenizer_dir

    template, parser = load_codec(tokenizer_dir(tmp_path / "tokenizer", STRIPS_REASONING), "hermes")
    assert template.continuous
    tokens_of = ImageTokens(load_processor("builtin:qwen2.5-vl", template.tokenizer), template.tokenizer)
    thought = "<think>\nred, surely\n</think>\n\nRed."
    log, engine = InMemoryLog(), HandlerEngine(reply(template, thought))
    live = await opened(log)
    turns = runner((template, parser), log, engine, EdgeImages(tokens_of))
    history = [user("color?", RED)]
    first = await turns.run(live, openai(history))
    chain_tokens = [*id_list(engine.requests[0].input_ids), *first.token_ids]
    history += [{"role": "assistant", "content": first.content}, user("and these?", BLUE, RED)]
    await turns.run(live, openai(history))
    second = id_list(engine.requests[1].input_ids)
    assert second[:len(chain_tokens)] == chain_tokens  # the sampled reasoning stays, as sampled
    appended = next(e for e in await events_of(log) if type(e) is ContextAppended)
    context = tokens.unpack_ids(appended.token_ids).tolist()
    assert second[len(chain_tokens):] == context
    assert [(r.offset, r.tokens) for r in appended.images] == pad_runs(context) == [(pad_runs(context)[0][0], 8),
                                                                                  (pad_runs(context)[1][0], 4)]
    assert engine.requests[1].images == (RED, BLUE, RED) and len(pad_runs(second)) == 3


def test_the_responses_wire_reads_input_image_parts_as_the_chat_wire_reads_image_url_parts() -> None:
    from edge.wires.reasoning_refs import ReasoningRefs, stack_key
    from edge.wires.responses import ResponsesWire

    chat = decode_openai(json.dumps({"messages": [user("compare", RED, BLUE, after="which?")]}).encode())
    wire = ResponsesWire(ReasoningRefs(stack_key("admin")))
    responses = wire.decode(json.dumps({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "compare"}, {"type": "input_image", "image_url": data_url(RED)},
        {"type": "input_image", "image_url": data_url(BLUE), "detail": "high"},
        {"type": "input_text", "text": "which?"}]}]}).encode())
    (got,), (want,) = responses.messages, chat.messages
    assert (got.role, got.content) == (want.role, want.content) == ("user", "comparewhich?")
    assert [(i.at, i.data, i.media_type) for i in got.images] == [(i.at, i.data, i.media_type) for i in want.images]
    assert [i.param for i in got.images] == ["input[0].content[1].image_url", "input[0].content[2].image_url"]
    assert responses.history_digests[-1] == chat.history_digests[-1]


def test_events_without_images_encode_as_before_and_with_them_round_trip() -> None:
    plain = ChainStarted(session_id=SID, seq=3, time=NOW, chain=0, request_no=1, prompt_ids=b"\x01\0\0\0",
                         prefix_digest="d", n_messages=1, chat_turns=1)
    encoded = msgspec.msgpack.encode(plain)
    assert b"images" not in encoded and b"processor" not in msgspec.msgpack.encode(
        SessionOpened(session_id=SID, seq=1, time=NOW, uid="u", session_index=0, api_key_digest="x",
                      max_trajectory_length=8, tokenizer="t", tool_format="hermes"))
    ref = ImageRef(digest="ab" * 32, media_type="image/png", width=56, height=56, offset=0, tokens=4)
    rich = msgspec.structs.replace(plain, images=(ref,))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rich), type=ChainStarted) == rich
    assert msgspec.msgpack.decode(encoded, type=ChainStarted).images is msgspec.UNSET


async def test_a_token_count_counts_each_images_pads(codec, image_tokens):
    log, engine = InMemoryLog(), HandlerEngine(reply(codec[0]))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    request = openai([user("compare", RED, BLUE)])
    counted = await turns.count_prompt(live, request.conversation)
    assert [type(e) for e in await events_of(log)] == [SessionOpened]  # a count records nothing
    await turns.run(live, request)
    await turns.run(live, openai([user("compare")]))
    with_images, text_only = (len(id_list(r.input_ids)) for r in engine.requests)
    assert counted == with_images == text_only + (1 + 4 + 1) + (1 + 8 + 1)  # start, pads, end of each image


async def test_a_chain_holding_a_pad_no_image_put_there_is_not_sent_to_the_engine(codec, image_tokens):
    sampled = [*codec[0].tokenizer.encode("look: "), IMAGE_PAD, IM_END]  # a model that samples an image pad
    log, engine = InMemoryLog(), HandlerEngine(lambda request: result(sampled))
    live = await opened(log)
    turns = runner(codec, log, engine, EdgeImages(image_tokens))
    history = [user("what is this?", RED)]
    first = await turns.run(live, openai(history))
    history += [{"role": "assistant", "content": first.content}, user("and?")]
    with pytest.raises(ImageRefused, match="2 runs of image pad tokens for 1 image") as refused:
        await turns.run(live, openai(history))
    assert refused.value.param == "messages" and len(engine.requests) == 1
