"""The viewer shows each image of a session where it stands in the token stream: its thumbnail, fetched from the
log's object store by digest, in place of its ``<|image_pad|>`` run, with its size and token count. The API part
runs without a browser; the page in headless Chromium as ``test_viewer_browser`` runs it (skipped without one,
unless ``ROLLBUS_REQUIRE_BROWSER=1``)."""

from __future__ import annotations

import asyncio
import hashlib
import io

import httpx
import pytest
from PIL import Image

from edge.tokens.tokenizer import load_tokenizer
from eventlog.pieces import open_pieces
from eventlog.publisher import JetStreamLog
from schemas.events import ImageRef
from stack.provision import connect, provision
from tests.e2e.test_viewer_browser import CHROMIUM, ViewerThread, _artifacts, _browser, open_page
from tests.helpers import SessionScript, append_all, envelopes
from vision.images import ImageLimits, inspect
from vision.processor import BUILTIN, load_processor


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", (width, height), colour)
    for x in range(0, width, 8):  # a pattern, so the thumbnail is more than a flat colour
        for y in range(height):
            image.putpixel((x, y), (255, 255, 255))
    image.save(out, "PNG")
    return out.getvalue()


SCREEN, CHART = _png(112, 84, (30, 90, 200)), _png(56, 56, (200, 60, 30))


def _session() -> tuple[SessionScript, list[bytes]]:
    """A prompt with a screenshot and a chart, a reply, then the screenshot again with the next user turn."""
    tokenizer = load_tokenizer("builtin:qwen2.5")
    processor = load_processor(BUILTIN, tokenizer)

    def placed(text: str, images: list[bytes]) -> tuple[list[int], list[ImageRef]]:
        ids, refs = tokenizer.encode(text), []
        for data in images:
            info = inspect(data, ImageLimits())
            refs.append(ImageRef(digest=info.digest, media_type=info.media_type, width=info.width,
                                 height=info.height, offset=len(ids) + 1, tokens=processor.image_tokens(info)))
            ids += processor.placeholder_ids(info) + tokenizer.encode(" then ")
        return ids, refs

    script = SessionScript(session_id="ab" * 16, uid="viewerimages", processor=BUILTIN)
    prompt, first = placed("<|im_start|>user\nWhat differs? ", [SCREEN, CHART])
    script.turn(0, prompt, tokenizer.encode("The colour.<|im_end|>"), new_chain=True, images=first)
    context, second = placed("\n<|im_start|>user\nAnd now? ", [SCREEN])
    script.turn(0, context, tokenizer.encode("Same.<|im_end|>"), images=second, n_messages=4, tip="t1")
    script.finalize()
    return script, [SCREEN, CHART]


async def _log(url: str, cfg, script: SessionScript, images: list[bytes]) -> None:
    nc = await connect(url, name="viewer-images")
    try:
        await provision(nc.jetstream(), cfg)
        store = await open_pieces(nc.jetstream(), cfg)
        for data in images:  # as the edge stores them: before the events
            await store.put(script.session_id, hashlib.sha256(data).digest(), data)
        await append_all(JetStreamLog(nc, cfg), script.session_id, envelopes(script.events))
    finally:
        await nc.close()


@pytest.fixture
def logged(nats_server, log_config) -> SessionScript:
    script, images = _session()
    asyncio.run(_log(nats_server.url, log_config, script, images))
    return script


def test_the_api_places_each_image_in_its_window_and_serves_it_from_the_object_store(nats_server, log_config,
                                                                                      logged):
    sid = logged.session_id
    with ViewerThread(nats_server.url, log_config) as viewer:
        detail = httpx.get(f"{viewer.url}/api/sessions/{sid}").json()
        (chain,) = detail["chains"]
        prompt, response = chain["prompt"], chain["response"]
        assert [i["digest"] for i in prompt["images"]] == [hashlib.sha256(d).hexdigest() for d in (SCREEN, CHART)]
        for image in prompt["images"] + response["images"]:
            window = prompt if image in prompt["images"] else response
            run = window["ids"][image["offset"]: image["offset"] + image["tokens"]]
            assert run == [151655] * image["tokens"] and window["ids"][image["offset"] - 1] == 151652
        (again,) = response["images"]
        assert again["digest"] == prompt["images"][0]["digest"] and again["tokens"] == prompt["images"][0]["tokens"]

        served = httpx.get(f"{viewer.url}/api/sessions/{sid}/images/{again['digest']}")
        assert served.status_code == 200 and served.content == SCREEN
        assert served.headers["content-type"] == "image/png" and served.headers["x-content-type-options"] == "nosniff"
        unknown = httpx.get(f"{viewer.url}/api/sessions/{sid}/images/{'0' * 64}")
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "digest"


def test_an_image_session_in_chromium(nats_server, log_config, logged):
    sync_playwright, expect = _browser()
    assert CHROMIUM.exists()
    with ViewerThread(nats_server.url, log_config) as viewer, sync_playwright() as playwright:
        browser, page, errors = open_page(playwright)
        page.goto(f"{viewer.url}/session/{logged.session_id}")
        page.wait_for_selector("#chain-0 .tokens.response .image img.thumb")
        page.click("#chain-0 details.prompt > summary")
        thumbs = page.locator("#chain-0 .tokens.prompt .image")
        expect(thumbs).to_have_count(2)
        expect(page.locator("#chain-0 .tokens.response .image")).to_have_count(1)
        page.wait_for_function("""() => [...document.querySelectorAll('#chain-0 .image img')].every(
            img => img.complete && img.naturalWidth > 0)""")  # each thumbnail loaded (they load in parallel)
        shown = page.eval_on_selector_all("#chain-0 .image", """spans => spans.map(s => ({
            digest: s.dataset.digest, tokens: Number(s.dataset.tokens), label: s.innerText,
            loaded: s.querySelector('img').complete && s.querySelector('img').naturalWidth }))""")
        screen, chart = hashlib.sha256(SCREEN).hexdigest(), hashlib.sha256(CHART).hexdigest()
        assert [s["digest"] for s in shown] == [screen, chart, screen]
        assert [s["loaded"] for s in shown] == [112, 56, 112]  # each thumbnail drawn from the object store's bytes
        assert shown[0]["label"] == f"image 112x84 · {shown[0]['tokens']} tokens"
        assert page.locator("#chain-0 .tok[data-id='151655']").count() == 0  # the pad runs are drawn as the images
        assert page.locator("#chain-0 .tok[data-id='151652']").count() == 3  # around them, the vision tokens stay
        shot = _artifacts() / "viewer_images.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"viewer screenshot: {shot}")
        browser.close()
        assert not errors, errors
