"""The step of ``tests/scale/test_burst.py`` (1,024 sessions finalized at once, ``rollbus up`` killed and
restarted) into TransferQueue: the test process owns TransferQueue, as verl's trainer does, so what the
killed stack put survives it. Every trajectory key once, every prompt finished."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import transfer_queue as tq

from tests.scale.test_burst import SESSIONS, killed_step


# About 2 minutes alone; a drain that has not ended in killed_step's 300 s fails with its explanation.
@pytest.mark.timeout(900)
def test_a_step_of_1024_sessions_reaches_transfer_queue_exactly_once_across_a_kill(tmp_path: Path, tq_cluster,
                                                                                   partition):
    step = killed_step(tmp_path / "data", ["--transfer-queue", "--ray-address", tq_cluster, "--tq-partition",
                                           partition])
    listing = tq.kv_list(partition_id=partition).get(partition, {})
    prompts = {key: tags for key, tags in listing.items() if tags.get("is_prompt")}
    trajectories = {key: tags for key, tags in listing.items() if not tags.get("is_prompt")}
    assert len(trajectories) == SESSIONS == len(step.session_ids)
    assert Counter(key.rsplit("_", 2)[0] for key in trajectories) == Counter({uid: 8 for uid in prompts})
    assert {tags["status"] for tags in prompts.values()} == {"finished"} and len(prompts) == SESSIONS // 8
    assert {tags["status"] for tags in trajectories.values()} == {"success"}
