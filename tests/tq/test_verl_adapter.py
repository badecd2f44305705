"""The adapter as verl's trainer uses it, with verl's own classes on the other side.

verl's config composed by hydra, the adapter loaded by verl's ``load_class_from_fqn`` and built
through ``create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)``, an
``llm_client`` that is a subclass of verl's ``LLMServerClient``, prompts tagged ``pending`` as
verl tags them, and the results read back with verl's ``ReplayBuffer`` and ``kv_batch_get``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transfer_queue as tq
from tensordict import NonTensorData, NonTensorStack, TensorDict
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils.import_utils import load_class_from_fqn

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer
from tests.tq.verl_side import WEIGHTS, ScriptedLLMClient, peak_overlap, responder, rollout_batch, verl_config

FQN = "agent_framework.AgentFrameworkRolloutAdapter"
STEPS = 3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return load_tokenizer("builtin:qwen2.5").save(tmp_path_factory.mktemp("model") / "qwen2.5")


@pytest.fixture(scope="module")
def engine() -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(responder=responder(load_tokenizer("builtin:qwen2.5"))) as server:
        yield server


def overrides(tokenizer_dir: Path, nats_url: str, data_dir: Path, runner: dict[str, object], **custom: object
              ) -> list[str]:
    settings = {"gateway_count": 2, "nats_url": nats_url, "data_dir": str(data_dir),
                "log_namespace": "af" + uuid.uuid4().hex[:8], "agent_runners": {"tools": runner}, **custom}
    return verl_overrides(tokenizer_dir, settings)


def verl_overrides(tokenizer_dir: Path, settings: dict[str, object]) -> list[str]:
    rendered = repr(settings).replace("'", "").replace("True", "true").replace("False", "false")
    return [f"actor_rollout_ref.model.path={tokenizer_dir}", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.prompt_length=1024", "actor_rollout_ref.rollout.response_length=1024",
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={FQN}",
            f"+actor_rollout_ref.rollout.custom={{agent_framework:{rendered}}}"]


def prompt_batch(uids: list[str], tools_kwargs: list[dict[str, object]]) -> TensorDict:
    return rollout_batch(uids, tools_kwargs, STEPS)


def tag_pending(uids: list[str], partition: str) -> None:
    """What verl's trainer does before generate_sequences."""
    tq.kv_batch_put(keys=uids, partition_id=partition,
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": STEPS} for _ in uids])


def replay_buffer(config: object) -> ReplayBuffer:
    sampler = config.trainer.v1.sampler  # type: ignore[attr-defined]
    return ReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.get("sync", {}),  # type: ignore[attr-defined]
                        max_off_policy_threshold=sampler.max_off_policy_threshold,
                        max_off_policy_strategy=sampler.max_off_policy_strategy,
                        sampler_kwargs=sampler.sampler_kwargs, poll_interval=0.2,
                        refill_fn=lambda n: pytest.fail(f"verl asked for {n} refills"))


def create(config: object, engine_url: str) -> object:
    cls = load_class_from_fqn(FQN, "AgentLoopManager")
    return cls.create(config=config, llm_client=ScriptedLLMClient(config, engine_url), teacher_client=None,
                      reward_loop_worker_handles=None)


def test_a_verl_trainer_reads_the_groups_with_its_own_replay_buffer(tq_cluster, nats_server, engine, tokenizer_dir,
                                                                     tmp_path):
    uids = [str(uuid.uuid4()) for _ in range(8)]
    rng = random.Random(12)
    fails = [sorted(rng.sample(range(4), rng.randint(0, 3))) for _ in uids]
    fails[0], fails[1] = [0, 1, 2, 3], []  # one prompt whose sessions all fail, one whose none do
    config = verl_config(overrides(tokenizer_dir, nats_server.url, tmp_path / "data",
                                   {"runner_fqn": "tests.tq.verl_side.tool_agent"},
                                   log_dir=str(tmp_path / "logs")))
    adapter = create(config, engine.url)
    try:
        tag_pending(uids, "train")
        started = time.monotonic()
        adapter.generate_sequences(prompt_batch(uids, [{"fail": f} for f in fails]))
        assert time.monotonic() - started < 1.0  # the trainer goes straight on to sample()
        meta, _ = replay_buffer(config).sample(global_steps=STEPS, partition_id="train", batch_size=len(uids))
    finally:
        adapter.close()
    by_uid: dict[str, list[str]] = {}
    for key in meta.keys:
        by_uid.setdefault(key.split("_")[0], []).append(key)
    assert set(by_uid) == {u for u, f in zip(uids, fails, strict=True) if len(f) < 4}
    for uid, fail in zip(uids, fails, strict=True):
        assert sorted(by_uid.get(uid, [])) == [f"{uid}_{i}_0" for i in range(4) if i not in fail]
    for key, tag in zip(meta.keys, meta.tags, strict=True):
        assert tag["status"] == "success" and tag["global_steps"] == STEPS
        assert tag["min_global_steps"] == WEIGHTS and tag["max_global_steps"] == WEIGHTS
        assert tag["seq_len"] == tag["prompt_len"] + tag["response_len"], key
    data = tq.kv_batch_get(keys=meta.keys, partition_id="train")
    responses, masks = data["responses"].unbind(), data["response_mask"].unbind()
    for i, key in enumerate(meta.keys):
        index = int(key.split("_")[1])
        mask = masks[i].tolist()
        assert len(responses[i]) == meta.tags[i]["response_len"] == len(mask)
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1  # sampled, tool result, sampled
        assert data["rm_scores"].unbind()[i].sum().item() == pytest.approx(index / 4)
        assert data["input_ids"].unbind()[i].tolist() == data["prompts"].unbind()[i].tolist() + responses[i].tolist()
        assert data["extra_fields"][i]["reward_extra_info"] == {"acc": 1.0}
        assert data["data_source"][i] == "arith" and int(data["num_turns"][i]) == 4
    sessions = {str(data["session_id"][i]) for i in range(len(meta.keys))}
    per_session = collections.Counter(str(r["rid"]).split(":")[0] for r in engine.requests)
    assert all(per_session[s] == 2 for s in sessions)  # verl's client got the session id as request_id
    failed = [u for u, f in zip(uids, fails, strict=True) if len(f) == 4]
    listing = tq.kv_list(partition_id="train").get("train", {})
    assert all(u not in listing for u in uids)  # verl's sample() consumed every group, failure ones included
    assert failed == [uids[0]]
    exported = list((tmp_path / "logs" / f"step_{STEPS}").glob("*.events.jsonl"))
    assert len(exported) == 32  # every session's log, the failed ones too
    for sid in list(sessions)[:2]:
        document = json.loads((tmp_path / "logs" / f"step_{STEPS}" / f"{sid}.json").read_text())
        (trajectory,) = document["trajectories"]
        assert document["summary"]["status"] == "finalized" and trajectory["key"] in meta.keys
        events = (tmp_path / "logs" / f"step_{STEPS}" / f"{sid}.events.jsonl").read_text().splitlines()
        assert json.loads(events[0])["type"] == "session_opened" and len(events) >= 8


def test_a_prompt_whose_sessions_all_fail_is_tagged_failure_and_the_wait_raises(tq_cluster, nats_server, engine,
                                                                                 tokenizer_dir, tmp_path):
    from agent_framework import RolloutFailed

    uid = str(uuid.uuid4())
    config = verl_config(overrides(tokenizer_dir, nats_server.url, tmp_path / "data",
                                   {"runner_fqn": "tests.tq.verl_side.tool_agent"}, gateway_count=1))
    adapter = create(config, engine.url)
    try:
        tag_pending([uid], "val")
        batch = prompt_batch([uid], [{"fail": [0, 1]}])
        batch["validate"] = NonTensorData(True)  # val_kwargs.n = 1... overridden per prompt below
        batch["__rollout_n__"] = torch.tensor([2])
        with pytest.raises(RolloutFailed, match="all 2 rollouts"):
            adapter.generate_sequences_and_wait(batch, timeout=120)
        deadline = time.monotonic() + 60
        while tq.kv_list(partition_id="val")["val"][uid]["status"] != "failure":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert adapter.metrics["sessions_failed:runner_error"] == 2
    finally:
        adapter.close()


def test_ray_task_dispatch_never_exceeds_max_concurrent_sessions(tq_cluster, nats_server, engine, tokenizer_dir,
                                                                 tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    uids = [str(uuid.uuid4()) for _ in range(3)]
    runner = {"runner_fqn": "tests.tq.verl_side.tool_agent", "dispatch_mode": "ray_task",
              "max_concurrent_sessions": 3}
    config = verl_config(overrides(tokenizer_dir, nats_server.url, tmp_path / "data", runner))
    adapter = create(config, engine.url)
    try:
        tag_pending(uids, "train")
        kwargs = [{"hold_s": 0.5, "trace_dir": str(traces), "fail": [1] if i == 0 else []} for i in range(3)]
        result = adapter.generate_sequences_and_wait(prompt_batch(uids, kwargs), timeout=300)
    finally:
        adapter.close()
    assert result.succeeded == 11 and result.failed == 1
    assert len(list(traces.glob("*.json"))) == 11
    assert 2 <= peak_overlap(traces) <= 3
    assert adapter.peak_concurrency == {"tools": 3}
    pids = {json.loads(p.read_text())["pid"] for p in traces.glob("*.json")}
    assert os.getpid() not in pids  # each ran in a Ray worker process
    listing = tq.kv_list(partition_id="train")["train"]
    assert [listing[u]["status"] for u in uids] == ["finished"] * 3
    assert f"{uids[0]}_1_0" not in listing and f"{uids[0]}_0_0" in listing  # the raising sibling alone is missing


def _wait(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_killed_adapter_is_resumed_by_verls_reissue_and_each_group_ends_complete_and_clean(
        tq_cluster, nats_server, engine, tokenizer_dir, tmp_path):
    uids = [str(uuid.uuid4()) for _ in range(3)]
    hold = tmp_path / "hold"
    hold.touch()
    kwargs = [{}, {"hold": [2, 3], "hold_file": str(hold)}, {"hold": [0, 1, 2, 3], "hold_file": str(hold)}]
    settings = {"gateway_count": 1, "nats_url": nats_server.url, "data_dir": str(tmp_path / "data"),
                "log_namespace": "af" + uuid.uuid4().hex[:8],
                "agent_runners": {"tools": {"runner_fqn": "tests.tq.verl_side.tool_agent"}}}
    config = verl_config(verl_overrides(tokenizer_dir, settings))
    batch = rollout_batch(uids, kwargs, STEPS)
    tq.kv_batch_put(keys=uids, partition_id="train",  # as verl's async trainers persist prompts for resume
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": STEPS} for _ in uids],
                    fields=batch.select(*[k for k in batch.keys() if not isinstance(batch.get(k), NonTensorData)]))  # noqa: SIM118
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"overrides": verl_overrides(tokenizer_dir, settings), "fqn": FQN, "uids": uids,
                                "tools_kwargs": kwargs, "global_steps": STEPS}))
    output = (tmp_path / "trainer.log").open("w")
    trainer = subprocess.Popen([sys.executable, "-m", "tests.tq.verl_side", tq_cluster, engine.url, str(spec)],
                               stdout=output, stderr=subprocess.STDOUT)
    try:
        def listing() -> dict[str, dict]:
            return tq.kv_list(partition_id="train").get("train", {})

        _wait(lambda: listing().get(uids[0], {}).get("status") == "finished" and f"{uids[1]}_1_0" in listing(),
              240, "the first attempt did not get part-way")
    finally:
        trainer.kill()  # SIGKILL, mid-batch: uids[1] has 2 of 4 sessions ended, uids[2] none
        trainer.wait(30)
    hold.unlink()
    adapter = create(config, engine.url)  # the restarted trainer's
    try:
        resumed = SimpleNamespace(trainer_mode="colocate_async", global_steps=STEPS + 1, agent_loop_manager=adapter)
        PPOTrainer._reissue_inflight_prompts(resumed, "train")  # verl's own resume path
        _wait(lambda: all(listing().get(u, {}).get("status") == "finished" for u in uids), 240,
              "the re-issued prompts did not finish")
    finally:
        adapter.close()
    rows = listing()
    assert sorted(k for k in rows if k.startswith(uids[0] + "_")) == [f"{uids[0]}_{i}_0" for i in range(4)]
    assert {rows[f"{uids[0]}_{i}_0"]["global_steps"] for i in range(4)} == {STEPS}  # finished before the kill
    for uid in uids[1:]:
        keys = sorted(k for k in rows if k.startswith(uid + "_"))
        assert keys == [f"{uid}_{i}_0" for i in range(4)]  # complete, and nothing from the first attempt
        assert {rows[k]["global_steps"] for k in keys} == {STEPS + 1}


def test_the_reward_loop_scores_sessions_whose_task_posted_no_reward(tq_cluster, nats_server, engine, tokenizer_dir,
                                                                     tmp_path):
    import ray
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    uids = [str(uuid.uuid4()) for _ in range(2)]
    score_file = Path(__file__).with_name("verl_side.py")
    config = verl_config([*overrides(tokenizer_dir, nats_server.url, tmp_path / "data",
                                     {"runner_fqn": "tests.tq.verl_side.tool_agent"}, gateway_count=1,
                                     num_workers=2, use_reward_loop_worker=True),
                          f"reward.custom_reward_function.path={score_file}",
                          "reward.custom_reward_function.name=compute_score"])
    worker = ray.remote(RewardLoopWorker).options(num_cpus=0).remote(config, None)
    cls = load_class_from_fqn(FQN, "AgentLoopManager")
    with pytest.raises(ValueError, match="use_reward_loop_worker"):
        cls.create(config=config, llm_client=ScriptedLLMClient(config, engine.url))
    adapter = cls.create(config=config, llm_client=ScriptedLLMClient(config, engine.url), teacher_client=None,
                         reward_loop_worker_handles=[worker])
    try:
        tag_pending(uids, "train")
        batch = prompt_batch(uids, [{"no_reward": True}, {"no_reward": True}])
        batch["reward_model"] = NonTensorStack.from_list([{"ground_truth": "42"}, {"ground_truth": "41"}])
        result = adapter.generate_sequences_and_wait(batch, timeout=300)
    finally:
        adapter.close()
        ray.kill(worker)
    assert result.succeeded == 8
    keys = [f"{u}_{i}_0" for u in uids for i in range(4)]
    data = tq.kv_batch_get(keys=keys, partition_id="train")
    for i, key in enumerate(keys):
        expected = 1.0 if key.startswith(uids[0]) else 0.0  # "The answer is 42." holds 42, not 41
        assert data["rm_scores"].unbind()[i].sum().item() == expected
        assert data["extra_fields"][i]["reward_source"] == "scorer"
        assert data["extra_fields"][i]["reward_extra_info"]["source_seen"] == "arith"
