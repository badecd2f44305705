"""The verl side of the adapter tests, importable by Ray workers: a scripted ``LLMServerClient``,
agent runners that fail on cue, and verl's config built the way verl builds it (hydra)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from edge.engines.base import GenerateRequest, SamplingParams
from edge.engines.sglang import SGLangEngine
from rollbus.testing.scripted import ScriptedReply

IM_END = 151645
WEIGHTS = 5  # the weight version the scripted server reports (verl's global_steps of the weights)
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expr": {"type": "string"}}}}}]


def responder(tokenizer: Any):
    """A tool call first; once a tool result is in the context, the answer."""

    def reply(input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        if "<tool_response>" in tokenizer.decode(input_ids[-64:]):
            return ScriptedReply(token_ids=[*tokenizer.encode("The answer is 42."), IM_END])
        call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
        return ScriptedReply(token_ids=[*tokenizer.encode(call), IM_END])

    return reply


class ScriptedLLMClient(LLMServerClient):
    """verl's client, its generate served by a scripted SGLang server over its HTTP protocol."""

    def __init__(self, config: Any, engine_url: str) -> None:
        super().__init__(config, load_balancer_handle=None)
        self.engine_url = engine_url
        self._engine: SGLangEngine | None = None
        self.request_ids: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_engine": None}

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        if self._engine is None:
            self._engine = SGLangEngine([self.engine_url])
        self.request_ids.append(request_id)
        sampling = SamplingParams(max_new_tokens=sampling_params["max_tokens"],
                                  stop_token_ids=tuple(sampling_params.get("stop_token_ids", ())))
        result = await self._engine.generate(GenerateRequest(request_id=f"{request_id}:{len(self.request_ids)}",
                                                             input_ids=prompt_ids, sampling=sampling))
        return TokenOutput(token_ids=list(result.token_ids), log_probs=list(result.logprobs or []),
                           stop_reason="completed",
                           extra_fields={"global_steps": WEIGHTS, "min_global_steps": WEIGHTS,
                                         "max_global_steps": WEIGHTS})


async def tool_agent(*, session: Any, raw_prompt: list[dict[str, Any]], sample_index: int,
                     tools_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Two turns through the official SDK (a tool call, then the answer); fails when told to.

    ``tools_kwargs``: ``fail`` (sample indices that raise after their turns), ``hold_s`` (seconds to
    stay in flight), ``hold`` (sample indices held while ``hold_file`` exists), ``trace_dir`` (a file
    per session with its start and end times).
    """
    tools_kwargs = tools_kwargs or {}
    started = time.time()
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages = list(raw_prompt)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    await client.close()
    await asyncio.sleep(float(tools_kwargs.get("hold_s", 0)))
    while sample_index in tools_kwargs.get("hold", []) and os.path.exists(tools_kwargs["hold_file"]):  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.1)  # held in flight until the test removes the file (another process)
    if sample_index in tools_kwargs.get("fail", []):
        raise RuntimeError(f"scripted failure of {kwargs['uid']} sample {sample_index}")
    if tools_kwargs.get("no_reward"):
        return {}  # leaves the reward to the reward loop
    async with httpx.AsyncClient() as http:
        answer = await http.post(session.reward_url, json={"reward_info": {"reward": sample_index / 4, "acc": 1.0}},
                                 headers={"Authorization": f"Bearer {session.api_key}"})
        answer.raise_for_status()
    if "trace_dir" in tools_kwargs:
        trace = Path(tools_kwargs["trace_dir"]) / f"{session.session_id}.json"
        trace.write_text(json.dumps({"start": started, "end": time.time(), "pid": os.getpid()}))
    return {"reward": sample_index / 4}


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> dict:
    """A verl custom reward function (``reward.custom_reward_function``), run by verl's RewardLoopWorker."""
    return {"score": float(ground_truth in solution_str), "source_seen": data_source}


def peak_overlap(trace_dir: Path) -> int:
    """The most sessions in flight at once, from the runners' own start and end times."""
    spans = [json.loads(p.read_text()) for p in trace_dir.glob("*.json")]
    edges = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans], key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, step in edges:
        current += step
        peak = max(peak, current)
    return peak


def verl_config(overrides: list[str]) -> Any:
    """verl's ppo_trainer config composed by hydra with the overrides, resolved, as main_ppo has it."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    directory = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=directory, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    config.transfer_queue.enable = True  # as TaskRunnerV1.run sets it
    OmegaConf.resolve(config)
    return config


def rollout_batch(uids: list[str], tools_kwargs: list[dict[str, Any]], global_steps: int) -> Any:
    """A batch as verl's dataloader hands it to generate_sequences."""
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    batch = TensorDict({
        "uid": NonTensorStack.from_list(uids),
        "raw_prompt": NonTensorStack.from_list([[{"role": "user", "content": f"What is 6*7? ({u[:4]})"}]
                                                for u in uids]),
        "tools_kwargs": NonTensorStack.from_list(tools_kwargs),
        "data_source": NonTensorStack.from_list(["arith"] * len(uids)),
        "index": torch.arange(len(uids)),
    }, batch_size=[len(uids)])
    batch["global_steps"] = NonTensorData(global_steps)
    return batch


def main() -> None:
    """``python -m tests.tq.verl_side RAY_ADDRESS ENGINE_URL SPEC.json``: a trainer process that dispatches
    one batch through the adapter and then waits to be killed (the resume test's first attempt)."""
    import sys

    import ray
    import transfer_queue as tq
    from verl.utils.import_utils import load_class_from_fqn

    ray_address, engine_url, spec_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    ray.init(address=ray_address, log_to_driver=False, namespace="rollbus-test")
    tq.init()
    config = verl_config(spec["overrides"])
    cls = load_class_from_fqn(spec["fqn"], "AgentLoopManager")
    adapter = cls.create(config=config, llm_client=ScriptedLLMClient(config, engine_url), teacher_client=None,
                         reward_loop_worker_handles=None)
    adapter.generate_sequences(rollout_batch(spec["uids"], spec["tools_kwargs"], spec["global_steps"]))
    print("dispatched", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
