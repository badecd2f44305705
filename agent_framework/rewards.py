"""verl's reward-loop worker as the materializer's reward scorer.

With ``use_reward_loop_worker``, a session whose task posted no reward is scored by one of
the ``reward_loop_worker_handles`` verl passed to ``create``: ``compute_score.remote(data)``
with ``data`` a one-row ``DataProto`` of the session's final trajectory, as verl's own
agent loop builds it (``prompts``, ``responses``, ``input_ids``, ``attention_mask``,
``position_ids``; the task fields ``data_source``, ``reward_model``, ``extra_info``,
``raw_prompt``, ``tools_kwargs``, ``uid`` as object arrays), answering
``{"reward_score": float, "reward_extra_info": {...}}``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reward.scorer import ScoreRequest

TASK_FIELDS = ("data_source", "reward_model", "extra_info", "raw_prompt", "tools_kwargs")


def verl_reward_input(request: ScoreRequest) -> Any:
    import torch
    from tensordict import TensorDict
    from verl import DataProto

    record = request.trajectory
    prompts = torch.from_numpy(record.prompts.astype(np.int64)).unsqueeze(0)
    responses = torch.from_numpy(record.responses.astype(np.int64)).unsqueeze(0)
    input_ids = torch.cat([prompts, responses], dim=1)
    batch = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids), "position_ids": torch.arange(input_ids.shape[1]).unsqueeze(0),
    }, batch_size=[1])
    non_tensor: dict[str, np.ndarray] = {}
    for name in (*TASK_FIELDS, "uid"):
        value = request.uid if name == "uid" else request.metadata.get(name)
        if value is not None or name in ("data_source", "reward_model", "extra_info"):
            cell = np.empty(1, dtype=object)
            cell[0] = value if value is not None else ({} if name != "data_source" else "")
            non_tensor[name] = cell
    return DataProto(batch=batch, non_tensor_batch=non_tensor)
