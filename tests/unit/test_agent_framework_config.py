"""The adapter's configuration (verl's keys, checked up front) and verl's batch as prompts."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from agent_framework.config import load_config
from agent_framework.dispatch import load_runner
from agent_framework.samples import prompts_of
from schemas.errors import BatchError, ConfigError, RunnerLoadError

BASE = {
    "actor_rollout_ref": {
        "model": {"path": "builtin:qwen2.5"},
        "rollout": {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "prompt_length": 1000,
                    "response_length": 3000, "multi_turn": {"format": "hermes"},
                    "val_kwargs": {"n": 1, "temperature": 0, "top_p": 1.0, "top_k": -1, "do_sample": False},
                    "custom": {"agent_framework": {"agent_runners": {
                        "react": {"runner_fqn": "agent_framework.builtin.run_task", "dispatch_mode": "ray_task",
                                  "max_concurrent_sessions": 8, "trajectory_selection": "longest"}}}}}},
    "transfer_queue": {"enable": True},
}


def with_(path: str, value: object) -> dict:
    config = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


def test_verls_keys_are_read_with_their_defaults():
    c = load_config(BASE)
    assert (c.train.n, c.train.temperature, c.train.top_p, c.val.n, c.val.do_sample) == (4, 0.7, 0.9, 1, False)
    assert c.max_trajectory_length == 4000 and c.tool_format == "hermes" and c.tokenizer == "builtin:qwen2.5"
    runner = c.runner_for(None)
    assert (runner.name, runner.dispatch_mode, runner.max_concurrent_sessions, runner.trajectory_selection) == (
        "react", "ray_task", 8, "longest")
    assert (c.gateway_count, c.num_workers, c.prompt_status_rule, c.enable_last_assistant_rollback) == (
        1, 0, "any_success", True)


def test_the_image_processor_is_the_model_directorys_own_unless_given(tmp_path: Path):
    from edge.tokens.tokenizer import load_tokenizer

    model = load_tokenizer("builtin:qwen2.5").save(tmp_path / "vl")
    assert load_config(with_("actor_rollout_ref.model.path", str(model))).processor == ""  # a text model
    (model / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    assert load_config(with_("actor_rollout_ref.model.path", str(model))).processor == str(model)
    section = "actor_rollout_ref.rollout.custom.agent_framework"
    given = with_("actor_rollout_ref.model.path", str(model))
    given["actor_rollout_ref"]["rollout"]["custom"]["agent_framework"]["processor"] = ""
    assert load_config(given).processor == ""  # "": none, whatever the model holds
    assert load_config(with_(f"{section}.processor", "builtin:qwen2.5-vl")).processor == "builtin:qwen2.5-vl"
    assert load_config(BASE).processor == ""


def test_an_omegaconf_config_reads_the_same():
    from omegaconf import OmegaConf

    assert load_config(OmegaConf.create(BASE)) == load_config(BASE)


@pytest.mark.parametrize(("path", "value", "message"), [
    ("actor_rollout_ref.rollout.n", 0, "actor_rollout_ref.rollout.n must be >= 1"),
    ("actor_rollout_ref.rollout.top_p", 1.5, "actor_rollout_ref.rollout.top_p must be in (0, 1]"),
    ("actor_rollout_ref.rollout.val_kwargs.top_k", 0, "actor_rollout_ref.rollout.val_kwargs.top_k must be -1"),
    ("actor_rollout_ref.rollout.response_length", "long", "actor_rollout_ref.rollout.response_length must be int"),
    ("actor_rollout_ref.model.path", "/nowhere/model", "actor_rollout_ref.model.path '/nowhere/model' is not"),
    ("actor_rollout_ref.rollout.custom.agent_framework.gateway_count", 0, "agent_framework.gateway_count must be"),
    ("actor_rollout_ref.rollout.custom.agent_framework.gatway_count", 2,
     "actor_rollout_ref.rollout.custom.agent_framework.gatway_count: unknown key (did you mean gateway_count?)"),
    ("actor_rollout_ref.rollout.custom.agent_framework.prompt_status_rule", "most",
     "agent_framework.prompt_status_rule must be one of any_success, all_success"),
    ("actor_rollout_ref.rollout.custom.agent_framework.agent_runners", {},
     "agent_framework.agent_runners must be a mapping of at least one runner"),
    ("actor_rollout_ref.rollout.custom.agent_framework.agent_runners.react.dispatch_mode", "thread",
     "agent_runners.react.dispatch_mode must be one of inline_async, ray_task"),
    ("actor_rollout_ref.rollout.custom.agent_framework.agent_runners.react.max_concurrent_sessions", -1,
     "agent_runners.react.max_concurrent_sessions must be >= 0"),
    ("actor_rollout_ref.rollout.custom.agent_framework.agent_runners.react.runner_fqn", "run_task",
     "agent_runners.react.runner_fqn must be a class or function named as module.attr, got 'run_task'"),
    ("actor_rollout_ref.rollout.custom.agent_framework.default_agent", "coder", "default_agent 'coder' is not in"),
    ("actor_rollout_ref.rollout.custom.agent_framework.log_namespace", "Bad_Name", "log namespace is 1-32"),
    ("actor_rollout_ref.rollout.custom.agent_framework.session_timeout", 0, "session_timeout must be > 0"),
    ("transfer_queue.enable", False, "transfer_queue.enable is false"),
])
def test_each_bad_value_is_refused_naming_its_key(path, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(with_(path, value))


CUSTOM = "actor_rollout_ref.rollout.custom.agent_framework"


@pytest.mark.parametrize(("path", "value", "message"), [
    # rollbus's own section: any key that is not a field, at any depth
    (f"{CUSTOM}.agent_runners.react.runner_kwarg", {}, f"{CUSTOM}.agent_runners.react.runner_kwarg: unknown key "
                                                        "(did you mean runner_kwargs?)"),
    (f"{CUSTOM}.colour", "blue", f"{CUSTOM}.colour: unknown key"),
    # a wrong type, with the type (and constraint) expected
    (f"{CUSTOM}.num_workers", "two", f"{CUSTOM}.num_workers must be int >= 0, got 'two'"),
    (f"{CUSTOM}.use_reward_loop_worker", "yes", f"{CUSTOM}.use_reward_loop_worker must be bool, got 'yes'"),
    ("actor_rollout_ref.rollout.n", True, "actor_rollout_ref.rollout.n must be int >= 1, got True"),
    (f"{CUSTOM}.engine_urls", ["http://a:1", 3], f"{CUSTOM}.engine_urls[1] must be str, got int"),
    (f"{CUSTOM}.agent_runners.react.runner_kwargs", [1], f"{CUSTOM}.agent_runners.react.runner_kwargs must be a "
                                                         "mapping, got [1]"),
    ("actor_rollout_ref.rollout.val_kwargs", "greedy",
     "actor_rollout_ref.rollout.val_kwargs must be a mapping, got 'greedy'"),
    # constraints
    ("actor_rollout_ref.rollout.temperature", -0.1, "actor_rollout_ref.rollout.temperature must be >= 0, got -0.1"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", 0,
     "actor_rollout_ref.rollout.val_kwargs.top_p must be in (0, 1], got 0"),
    ("actor_rollout_ref.rollout.top_k", -2, "actor_rollout_ref.rollout.top_k must be >= -1, got -2"),
    ("actor_rollout_ref.rollout.top_k", 0, "actor_rollout_ref.rollout.top_k must be -1 (off) or >= 1, got 0"),
    (f"{CUSTOM}.actor_num_cpus", -1, f"{CUSTOM}.actor_num_cpus must be >= 0, got -1"),
    (f"{CUSTOM}.engine", "tgi", f"{CUSTOM}.engine must be one of local, sglang, vllm, got 'tgi'"),
])
def test_each_unknown_or_mistyped_key_is_named_by_its_full_path(path, value, message):
    with pytest.raises(ConfigError) as refused:
        load_config(with_(path, value))
    assert str(refused.value) == message


def test_every_problem_is_named_at_once_in_one_line():
    config = with_(f"{CUSTOM}.gatway_count", 2)
    config["actor_rollout_ref"]["rollout"].update(n=0, prompt_length="long")
    config["actor_rollout_ref"]["rollout"]["custom"]["agent_framework"]["agent_runners"]["react"]["dispatch_mode"] = 1
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert str(refused.value).split("; ") == [
        "actor_rollout_ref.rollout.n must be >= 1, got 0",
        "actor_rollout_ref.rollout.prompt_length must be int >= 1, got 'long'",
        f"{CUSTOM}.gatway_count: unknown key (did you mean gateway_count?)",
        f"{CUSTOM}.agent_runners.react.dispatch_mode must be one of inline_async, ray_task, got 1",
    ]
    assert "\n" not in str(refused.value)


def test_null_reads_as_the_default_and_an_int_as_a_float():
    config = with_(f"{CUSTOM}.gateway_count", None)
    config["actor_rollout_ref"]["rollout"]["custom"]["agent_framework"]["session_timeout"] = 60
    c = load_config(config)
    assert c.gateway_count == 1 and c.session_timeout == 60.0 and isinstance(c.session_timeout, float)


def test_a_typo_of_a_verl_key_rollbus_reads_is_named_where_verl_has_no_such_field():
    pytest.importorskip("verl")
    with pytest.raises(ConfigError, match=re.escape("actor_rollout_ref.rollout.nn: unknown key (did you mean n?)")):
        load_config(with_("actor_rollout_ref.rollout.nn", 2))
    with pytest.raises(ConfigError, match=re.escape("actor_rollout_ref.rollout.val_kwargs.temprature: unknown key "
                                                    "(did you mean temperature?)")):
        load_config(with_("actor_rollout_ref.rollout.val_kwargs.temprature", 0.5))
    with pytest.raises(ConfigError, match=re.escape("actor_rollout_ref.model.tokenizer_pth: unknown key "
                                                    "(did you mean tokenizer_path?)")):
        load_config(with_("actor_rollout_ref.model.tokenizer_pth", "/models/q"))
    # verl's keys rollbus does not read, in those sections and elsewhere, are verl's
    config = with_("actor_rollout_ref.rollout.gpu_memory_utilization", 0.6)
    config["actor_rollout_ref"]["rollout"]["agent"] = {"agent_loop_manager_class": "agent_framework.Adapter"}
    config["actor_rollout_ref"]["rollout"]["multi_turn"]["max_assistant_turns"] = 8
    config["actor_rollout_ref"]["actor"] = {"anything": 1}
    config["trainer"] = {"total_epochs": 1}
    config["actor_rollout_ref"]["rollout"]["custom"]["other_framework"] = {"x": 1}
    assert load_config(config) == load_config(BASE)


def test_verls_own_config_with_the_section_added_loads_as_it_is():
    verl = pytest.importorskip("verl")
    from omegaconf import OmegaConf

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    config.actor_rollout_ref.model.path = "builtin:qwen2.5"
    config.actor_rollout_ref.rollout.custom = {"agent_framework": {"agent_runners": {
        "react": {"runner_fqn": "agent_framework.builtin.run_task"}}}}
    config.transfer_queue.enable = True
    c = load_config(config)
    assert (c.train.n, c.val.do_sample, c.prompt_length, c.tool_format) == (
        config.actor_rollout_ref.rollout.n, config.actor_rollout_ref.rollout.val_kwargs.do_sample,
        config.actor_rollout_ref.rollout.prompt_length, config.actor_rollout_ref.rollout.multi_turn.format)


def test_a_missing_section_and_an_unknown_agent_name_the_keys():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.custom\.agent_framework is missing"):
        load_config({"actor_rollout_ref": {"rollout": {}}})
    with pytest.raises(ConfigError, match=r"agent_name 'coder' names no runner .* \(known: react\)"):
        load_config(BASE).runner_for("coder")


def test_runners_load_as_classes_or_functions_and_a_bad_one_fails_clearly():
    config = load_config(with_("actor_rollout_ref.rollout.custom.agent_framework.agent_runners.react.runner_fqn",
                               "agent_framework.builtin.RunTask"))
    assert callable(load_runner(config.runner_for(None)))
    broken = load_config(with_("actor_rollout_ref.rollout.custom.agent_framework.agent_runners.react.runner_fqn",
                               "agent_framework.builtin.no_such_runner"))
    with pytest.raises(RunnerLoadError, match=r"agent runner react: cannot load agent_framework\.builtin\.no_such"):
        load_runner(broken.runner_for(None))


def batch(**extra: object) -> TensorDict:
    b = TensorDict({
        "uid": NonTensorStack.from_list(["3f1c-a", "77e0-b"]),
        "raw_prompt": NonTensorStack.from_list([[{"role": "user", "content": "hi"}],
                                                [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
                                                ]),
        "tools_kwargs": NonTensorStack.from_list([{"task": "arithmetic", "answer": np.int64(3)}, {}]),
        "index": torch.tensor([7, 8]),
        **extra,
    }, batch_size=[2])
    b["global_steps"] = NonTensorData(12)
    return b


def test_verls_batch_becomes_plain_prompts():
    first, second = prompts_of(batch(__rollout_n__=torch.tensor([2, 3]), __do_sample__=torch.tensor([True, False]),
                                     data_source=NonTensorStack.from_list(["gsm8k", "math"]),
                                     input_ids=torch.ones(2, 16, dtype=torch.int64)))  # verl's tokenized prompt
    assert (first.uid, first.index, first.global_steps, first.rollout_n, first.do_sample) == ("3f1c-a", 7, 12, 2, True)
    assert first.tools_kwargs == {"task": "arithmetic", "answer": 3} and type(first.tools_kwargs["answer"]) is int
    assert second.raw_prompt[0] == {"role": "system", "content": "s"} and not second.do_sample
    assert first.task == {"data_source": "gsm8k"} and first.partition == "train"
    validating = batch()
    validating["validate"] = NonTensorData(True)
    assert all(p.validate and p.partition == "val" for p in prompts_of(validating))


def test_a_malformed_batch_names_the_row_and_field():
    bad = batch()
    bad["uid"] = NonTensorStack.from_list(["ok", "has_underscore"])
    with pytest.raises(BatchError, match="row 1: uid must be 1-128 characters without '_'"):
        prompts_of(bad)
    worse = batch()
    worse["raw_prompt"] = NonTensorStack.from_list(["just text", "also text"])
    with pytest.raises(BatchError, match=r"row 0 \(3f1c-a\): raw_prompt must be a list of chat messages"):
        prompts_of(worse)


async def test_new_sessions_go_to_the_least_busy_edge_reserved_before_the_open_is_awaited():
    from agent_framework.pool import EdgePool

    pool = EdgePool(["http://a", "http://b", "http://c"], "token")
    placed = [pool.reserve() for _ in range(5)]
    assert [p.url for p in placed] == ["http://a", "http://b", "http://c", "http://a", "http://b"]
    placed[0].release()
    placed[0].release()  # once only
    placed[3].release()
    assert pool.reserve().url == "http://a" and pool.active == [1, 2, 1]
    placed[1].move(2)  # a retried open moved to the next edge
    assert pool.active == [1, 1, 2]
    await pool.aclose()
