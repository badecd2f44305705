"""Image sessions through the materializer into a real TransferQueue: each trajectory's ``multi_modal_inputs`` and
four-row ``position_ids`` come back from ``kv_batch_get`` as verl's trainer reads them (the engines'
``position_ids.values()``, ``extract_multi_modal_inputs``), equal to what the processor builds for its images; a
text-only session of the same prompt partition keeps its own fields."""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import transfer_queue as tq

from edge.tokens.tokenizer import load_tokenizer
from eventlog.publisher import JetStreamLog
from tests.integration.test_materializer import _drained
from tests.sessions import append
from tests.tq.test_transfer_queue import materializing
from tests.unit.test_records_images import CHART, PHOTO, SCREEN, _session
from vision.processor import BUILTIN, load_processor
from vision.records import trajectory_inputs


async def test_image_trajectories_come_back_from_transfer_queue_as_verl_reads_them(nc, js, log_config, tmp_path,
                                                                                   partition):
    from verl.utils.model import extract_multi_modal_inputs

    from tests.helpers import SessionScript

    processor = load_processor(BUILTIN, load_tokenizer("builtin:qwen2.5"))
    images = {hashlib.sha256(d).hexdigest(): d for d in (SCREEN, CHART, PHOTO)}
    scripts = [_session(processor, session_id=f"{i:032x}", uid=f"vl{i}") for i in range(2)]
    text = SessionScript(session_id="e" * 32, uid="txt", metadata={"rollout_n": 1, "global_steps": 3})
    text.turn(0, [1, 2, 3], [4, 5], new_chain=True)
    text.finalize()
    log = JetStreamLog(nc, log_config)
    async with materializing(nc, log_config, tmp_path, partition):
        for script in scripts:
            await log.put_pieces(script.session_id, {bytes.fromhex(d): v for d, v in images.items()})
            await append(log, script)
        await append(log, text)
        await _drained(js, log_config, len(scripts) + 1)
    listing = tq.kv_list(partition_id=partition)[partition]
    keys = sorted(k for k, t in listing.items() if not t.get("is_prompt") and k.startswith("vl"))
    assert len(keys) == 4  # two trajectories a session (the main chain and the sub-agent's)
    data = tq.kv_batch_get(keys=keys, partition_id=partition)
    positions, inputs = data["position_ids"], list(data["multi_modal_inputs"])
    assert positions.dim() == 3 and positions.shape[:2] == (4, 4)
    expected_rows, expected_inputs = [], []
    for i in range(len(keys)):
        ids = data["input_ids"].unbind()[i]
        order = [SCREEN, CHART, SCREEN] if keys[i].endswith("_0") else [SCREEN, CHART, PHOTO]  # main, sub-agent
        built = trajectory_inputs(processor, ids, torch.ones_like(ids), order)
        expected_rows.append(built["position_ids"])
        expected_inputs.append(built["multi_modal_inputs"])
    assert torch.equal(positions.values(), torch.cat(expected_rows, dim=1))  # what verl's engines read: (4, nnz)
    ours, theirs = extract_multi_modal_inputs(inputs), extract_multi_modal_inputs(expected_inputs)
    assert ours.keys() == theirs.keys() == {"pixel_values", "image_grid_thw", "images_seqlens"}
    for key in theirs:
        assert torch.equal(ours[key], theirs[key])
    (text_key,) = [k for k in listing if k.startswith("txt_")]
    plain = tq.kv_batch_get(keys=[text_key], partition_id=partition)
    assert "multi_modal_inputs" not in plain.keys() and plain["position_ids"].dim() == 2  # noqa: SIM118
    assert np.array_equal(plain["position_ids"].unbind()[0].numpy(), np.arange(5))

