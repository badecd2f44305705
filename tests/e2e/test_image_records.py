"""A vision-language session through the whole stack (``--processor builtin:qwen2.5-vl``) and the official
OpenAI SDK: two images, a tool call, its result, the first image sent again (and the same conversation through the
Anthropic SDK leaves the identical record). The trajectory's Parquet row holds
the images by digest at their placeholder runs and the M-RoPE rows; the reader helper restores from the log's
object store the ``multi_modal_inputs`` the processor returns for those images; ``rollbus replay --verify``
fetches the images back and passes."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io

import anthropic
import httpx
import numpy as np
import torch
from openai import OpenAI
from PIL import Image

from eventlog.jetstream import JetStreamPort
from materializer.dataset import session_rows
from materializer.parquet import ParquetSink
from materializer.rematerialize import Rematerializer
from materializer.vision import log_images, restore
from rollbus.cli import build_parser
from rollbus.commands.replay import replay_main
from stack.provision import connect
from tests.e2e.test_openai_session import TOOLS, call_text, open_session, reply, wait_for_parquet
from vision.processor import BUILTIN, load_processor


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, "PNG")
    return out.getvalue()


SCREEN, CHART = _png(112, 84, (20, 120, 220)), _png(56, 112, (220, 90, 10))


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_image_session_becomes_records_verl_reads_and_replays_verified(make_stack, engine, tokenizer, capsys,
                                                                           tmp_path):
    stack = make_stack(processor=BUILTIN)
    session = open_session(stack, uid="vlrecords")
    engine.push(reply(tokenizer, call_text("6*7")), reply(tokenizer, "The same screen."))
    _openai_conversation(session)
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    httpx.post(session["reward_url"], json={"reward_info": {"reward": 1.0}}, headers=auth).raise_for_status()
    httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin).raise_for_status()
    (row,) = wait_for_parquet(stack.trajectories, session["session_id"])

    processor = load_processor(BUILTIN, tokenizer)
    screen, chart = hashlib.sha256(SCREEN).hexdigest(), hashlib.sha256(CHART).hexdigest()
    assert row["processor"] == BUILTIN and [i["digest"] for i in row["images"]] == [screen, chart, screen]
    ids = np.asarray(row["input_ids"])
    for image in row["images"]:
        assert (ids[image["offset"]: image["offset"] + image["tokens"]] == processor.pad_id).all()
    assert (ids == processor.pad_id).sum() == sum(i["tokens"] for i in row["images"])
    expected = processor.model_inputs([SCREEN, CHART, SCREEN])
    rope = processor.position_ids(torch.as_tensor(ids), torch.ones(len(ids), dtype=torch.long),
                                  expected["image_grid_thw"])
    assert np.array_equal(np.asarray(row["vision_position_ids"]), rope.numpy())

    async def from_log() -> tuple[dict, int]:
        nc = await connect(stack.nats_url, name="image-records")
        try:
            images = await log_images(JetStreamPort(nc, stack.options.log).image, [row])
            await Rematerializer(ParquetSink(tmp_path / "again")).run(nc.jetstream(), stack.options.log)
            return restore(row, images, processor), await replay_main(
                nc.jetstream(), stack.options.log, build_parser().parse_args(
                    ["replay", "--verify", session["session_id"], "--nats", "nats://unused"]))
        finally:
            await nc.close()

    restored, verified = asyncio.run(from_log())
    (again,) = session_rows(tmp_path / "again", [session["session_id"]])  # rollbus materialize --from-log
    assert again["images"] == row["images"] and again["vision_position_ids"] == row["vision_position_ids"]
    for key, value in expected.items():
        assert torch.equal(restored["multi_modal_inputs"][key], value)
    assert restored["position_ids"].shape == (4, len(ids))
    assert verified == 0 and "0 differences" in capsys.readouterr().out


def _anthropic_conversation(session: dict) -> None:
    """The conversation of the test above, through the Anthropic SDK (base64 image blocks, tool_use, tool_result)."""
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]

    def image(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}

    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Here is the screen"}, image(SCREEN),
                                                         {"type": "text", "text": "and the chart."}, image(CHART)]}]
    message = client.messages.create(model="m", max_tokens=256, messages=messages, tools=tools)
    blocks = [b.model_dump(exclude_none=True) for b in message.content]
    (use,) = [b for b in blocks if b["type"] == "tool_use"]
    messages += [{"role": "assistant", "content": blocks},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "42"},
                                              {"type": "text", "text": "Again:"}, image(SCREEN)]}]
    client.messages.create(model="m", max_tokens=256, messages=messages, tools=tools)


def _openai_conversation(session: dict) -> None:
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict] = [{"role": "user", "content": [
        {"type": "text", "text": "Here is the screen"}, {"type": "image_url", "image_url": {"url": _url(SCREEN)}},
        {"type": "text", "text": "and the chart."}, {"type": "image_url", "image_url": {"url": _url(CHART)}}]}]
    message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"},
                 {"role": "user", "content": [{"type": "text", "text": "Again:"},
                                              {"type": "image_url", "image_url": {"url": _url(SCREEN)}}]}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)


def test_the_same_image_conversation_on_both_sdks_leaves_identical_records(make_stack, engine, tokenizer):
    stack = make_stack(processor=BUILTIN)
    rows = []
    for wire, converse in (("openai", _openai_conversation), ("anthropic", _anthropic_conversation)):
        engine.push(reply(tokenizer, call_text("6*7")), reply(tokenizer, "The same screen."))
        session = open_session(stack, uid=wire)
        converse(session)
        httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin).raise_for_status()
        (row,) = wait_for_parquet(stack.trajectories, session["session_id"])
        rows.append(row)
    for field in ("prompts", "responses", "input_ids", "response_mask", "rollout_log_probs", "num_turns", "processor",
                  "images", "vision_position_ids"):
        assert rows[0][field] == rows[1][field], field
    assert [i["digest"] for i in rows[0]["images"]] == [hashlib.sha256(d).hexdigest() for d in (SCREEN, CHART, SCREEN)]
